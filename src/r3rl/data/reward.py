"""Math reward: 1.0 when the response's final answer equals the label, else 0.0.

The final answer is the content of the last complete ``\\boxed{...}`` (braces may nest, as in
``\\boxed{\\frac{1}{2}}``); without one, the last number in the text. Answer and label compare as exact rationals
when both parse (``0.5`` equals ``1/2`` and ``\\frac{1}{2}``; ``1,000`` equals ``1000``), else as normalised text.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BOXED = "\\boxed"
# A number not glued to a word or another number on its left, so "7-5" yields "5", not "-5".
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_WRAPPERS = re.compile(r"^\\text\{(.*)\}$|^\\mathrm\{(.*)\}$")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces close; None when there is none."""
    found: str | None = None
    start = text.find(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        found = text[i + 1 : j]
                        break
                j += 1
        start = text.find(_BOXED, start + len(_BOXED))
    return found


def extract_answer(response_text: str) -> str | None:
    """The final answer of a response: the last boxed content, else the last number; None when neither exists."""
    boxed = _last_boxed(response_text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response_text)
    return numbers[-1] if numbers else None


def _normalise(text: str) -> str:
    s = text.strip().strip("$").strip()
    m = _WRAPPERS.match(s)
    if m:
        s = next(g for g in m.groups() if g is not None).strip()
    s = s.rstrip(".").replace("\\!", "").replace("\\,", "").replace(" ", "")
    if s.startswith("+"):
        s = s[1:]
    return s


def _as_number(text: str) -> Fraction | None:
    s = _normalise(text)
    m = _FRAC.match(s)
    if m:
        sign, num, den = m.groups()
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign else value
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response_text: str, label: str | int | float) -> float:
    """1.0 when the final answer of ``response_text`` equals ``label``, else 0.0 (also when there is no answer)."""
    answer = extract_answer(response_text)
    if answer is None:
        return 0.0
    label_text = str(label)
    a, b = _as_number(answer), _as_number(label_text)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    na, nb = _normalise(answer), _normalise(label_text)
    return 1.0 if na and na == nb else 0.0


def shaped_math_reward(response_text: str, label: str | int | float, partial_credit: float) -> float:
    """``math_reward``, plus partial credit for a wrong numeric answer that lands near the label.

    A wrong answer ``a`` for label ``b`` scores ``partial_credit * exp(-|a - b| / (|b| + 1))`` (< partial_credit < 1,
    so a right answer always scores more). With ``partial_credit=0`` this is ``math_reward``. The shaping exists for
    models that never answer right (a random tiny MoE), whose groups would otherwise all score 0 and give GRPO no
    advantage to learn from.
    """
    score = math_reward(response_text, label)
    if score > 0.0 or partial_credit <= 0.0:
        return score
    answer = extract_answer(response_text)
    a = _as_number(answer) if answer is not None else None
    b = _as_number(str(label))
    if a is None or b is None:
        return 0.0
    return partial_credit * math.exp(-abs(float(a) - float(b)) / (abs(float(b)) + 1.0))
