"""Rewards: the graders ``reward=`` names (``GRADERS``), and ``grade``, which runs one under a wall-clock deadline.

- ``boxed_exact`` (``math_reward``, the generated arithmetic task's reward): 1.0 when the response's final answer
  equals the label, else 0.0. The final answer is the content of the last complete ``\\boxed{...}`` (braces may
  nest, as in ``\\boxed{\\frac{1}{2}}``); without one, the last number in the text. Answer and label compare as
  exact rationals when both parse (``0.5`` equals ``1/2`` and ``\\frac{1}{2}``; ``1,000`` equals ``1000``), else as
  normalised text.
- ``exact``: the whole response, normalised the same way (``$``, ``\\text{}``, spaces, a final period), equals the
  label: for sets whose responses are the bare answer.
- ``math_verify``: Hugging Face's math-verify (``math_verify.parse`` and ``verify``) on the response and the label
  (boxed, so a bare ``\\frac{1}{2}`` label parses as LaTeX): symbolic and numeric equality, sets, intervals, units,
  ``\\dfrac`` and the like. What it does not do keeps ``boxed_exact`` for the arithmetic task: several boxes are one
  set to it (not "the last box counts"), a box cut off by the token limit is no answer to it (not a fallback to the
  last number), and it gives no partial credit (``data.partial_credit`` needs ``exact`` or ``boxed_exact``).

``grade`` bounds each response's grading by ``reward.timeout_s`` with SIGALRM (``signal.setitimer``), which only the
main thread can take, and that is where the recipes grade (the GRPO step and the eval point, after its event loop has
returned). math-verify's own timeouts are per parse and per comparison, in whole seconds, so a response can run
several of them in a row; they are switched off and this one deadline covers the whole request. A response that
exceeds it scores 0, with a warning.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

log = logging.getLogger(__name__)

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


# longer numeric text compares as text: Python refuses int() of over 4300 digits (ValueError), and an exponent such
# as 1e99999999 would build an integer of that many digits before any deadline could fire
_MAX_NUMBER_CHARS = 400
_MAX_EXPONENT = 1000
_EXPONENT = re.compile(r"[eE]([-+]?\d+)")


def _as_number(text: str) -> Fraction | None:
    """``text`` as an exact rational, or None when it is not a number r3rl compares as one."""
    s = _normalise(text)
    if len(s) > _MAX_NUMBER_CHARS or any(abs(int(e)) > _MAX_EXPONENT for e in _EXPONENT.findall(s[:_MAX_NUMBER_CHARS])):
        return None
    m = _FRAC.match(s)
    try:
        if m:
            sign, num, den = m.groups()
            if int(den) == 0:
                return None
            value = Fraction(int(num), int(den))
            return -value if sign else value
        if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
            s = s.replace(",", "")
        return Fraction(s)
    except (ValueError, ZeroDivisionError, OverflowError):
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


def _partial_credit(answer: str | None, label: str | int | float, partial_credit: float) -> float:
    """A wrong numeric answer ``a`` for label ``b`` scores ``partial_credit * exp(-|a - b| / (|b| + 1))`` (below
    ``partial_credit`` < 1, so a right answer always scores more). The shaping exists for models that never answer
    right (a random tiny MoE), whose groups would otherwise all score 0 and give GRPO no advantage to learn from."""
    a = _as_number(answer) if answer is not None else None
    b = _as_number(str(label))
    if a is None or b is None:
        return 0.0
    try:  # exact until the ratio, which may be past float's range (1e400 against 3): its credit is then 0
        distance = float(abs(a - b) / (abs(b) + 1))
    except OverflowError:
        return 0.0
    return partial_credit * math.exp(-distance)


def exact_reward(response_text: str, label: str | int | float) -> float:
    """1.0 when the whole response, normalised, equals ``label`` (as exact rationals when both parse), else 0.0."""
    a, b = _as_number(response_text), _as_number(str(label))
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    na, nb = _normalise(response_text), _normalise(str(label))
    return 1.0 if na and na == nb else 0.0


def _load_math_verify() -> Any:
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # its "timeout is disabled, provide your own" warning: ``grade``'s deadline is that timeout
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


@functools.lru_cache(maxsize=4096)
def _gold(label: str) -> tuple:
    """math-verify's parse of a label (the samples of a group share it); boxed unless it holds a box already."""
    mv = _load_math_verify()
    text = label if "\\boxed" in label else "\\boxed{" + label + "}"
    return tuple(mv.parse(text, parsing_timeout=None))


_E_NOTATION = re.compile(r"\d\.?\d*[eE]([-+]?\d+)")
_LONG_DIGITS = re.compile(r"\d{%d,}" % (_MAX_NUMBER_CHARS + 1))


def _beyond_reach(text: str) -> bool:
    """Numbers no deadline can stop: sympy turns ``1.5e-99999999`` into an exact rational, an integer power of that
    many digits computed in C, which holds the interpreter (SIGALRM waits for it); and digit runs past Python's
    int-string limit."""
    return bool(_LONG_DIGITS.search(text)) or any(abs(int(e)) > _MAX_EXPONENT for e in _E_NOTATION.findall(text))


def math_verify_reward(response_text: str, label: str | int | float) -> float:
    """1.0 when math-verify finds the response's answer equal to ``label``, else 0.0 (also for a response holding a
    number ``_beyond_reach``). No timeout of its own: call it through ``grade`` (in the main thread), whose deadline
    bounds parse and verify together."""
    if _beyond_reach(response_text) or _beyond_reach(str(label)):
        return 0.0
    mv = _load_math_verify()
    gold = _gold(str(label))
    if not gold:
        return 0.0
    answer = mv.parse(response_text, parsing_timeout=None)
    return 1.0 if answer and mv.verify(list(gold), answer, timeout_seconds=None) else 0.0


@dataclass(frozen=True)
class Grader:
    """A reward ``reward.name`` (and ``eval.sets.<name>.reward``) may name."""

    # 1.0 for a right response, 0.0 otherwise
    correct: Callable[[str, Any], float]
    # the answer ``data.partial_credit`` measures against the label; None: the grader gives no partial credit
    answer: Callable[[str], str | None] | None
    # work done before the deadline is armed (a first import)
    setup: Callable[[], Any] | None = None
    # linear in the response (regular expressions, rationals): safe to run without a deadline where none can be armed
    linear: bool = True


GRADERS: dict[str, Grader] = {
    "exact": Grader(exact_reward, answer=lambda text: text),
    "boxed_exact": Grader(math_reward, answer=extract_answer),
    "math_verify": Grader(math_verify_reward, answer=None, setup=_load_math_verify, linear=False),
}
# former names: ``math`` was the only reward of eval sets, today's boxed_exact
ALIASES = {"math": "boxed_exact"}


def grader(name: str) -> Grader:
    """The grader named ``name`` (or an alias of one); KeyError for an unknown name."""
    return GRADERS[ALIASES.get(name, name)]


class GradingTimeout(BaseException):
    """Raised by the deadline's SIGALRM handler; a BaseException, so no ``except Exception`` of a library keeps it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``GradingTimeout`` in the block once ``seconds`` of wall-clock time have passed (main thread only).

    The alarm repeats every 50 ms after the first, in case code in the block swallows one; the handler is disarmed
    before the timer is cancelled and the previous SIGALRM handler comes back on the way out."""
    armed = [True]

    def on_alarm(signum: int, frame: Any) -> None:
        if armed[0]:
            raise GradingTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
        yield
    finally:
        while True:  # an alarm may land in here too: repeat until the timer is off and the handler inert
            try:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                break
            except GradingTimeout:
                continue
        signal.signal(signal.SIGALRM, previous)


def grade_samples(samples: Sequence, decode: Callable[[Sequence[int]], str], reward: Any,
                  partial_credit: float = 0.0) -> None:
    """Each ``Sample``'s ``reward`` where its environment set none: ``grade`` on its answer (an episode's last policy
    turn, ``extra["answer_ids"]``: observations and tool calls are not the answer); and its raw accuracy
    ``extra["correct"]`` (a grade of 1: partial credit never reaches it), which dynamic sampling filters on."""
    for s in samples:
        if s.reward is None:
            s.reward = grade(reward, decode(s.extra.get("answer_ids", s.response_ids)), s.label, partial_credit)
        s.extra["correct"] = float(s.reward >= 1.0)


def grade(reward: Any, response_text: str, label: str | int | float, partial_credit: float = 0.0) -> float:
    """The reward of one response: grader ``reward.name`` within ``reward.timeout_s`` seconds (0.0 past them), plus
    ``partial_credit`` for a wrong numeric answer near the label (``_partial_credit``, on the grader's
    answer). ``reward`` is a ``RewardConfig`` or anything with ``name`` and ``timeout_s``.

    Outside the main thread no deadline can be armed: ``exact`` and ``boxed_exact`` (regular expressions and
    rationals, linear in the response) run without one, ``math_verify`` refuses to run."""
    g = grader(reward.name)

    def graded() -> float:
        score = g.correct(response_text, label)
        if score > 0.0 or partial_credit <= 0.0 or g.answer is None:
            return score
        return _partial_credit(g.answer(response_text), label, partial_credit)

    def run() -> float:
        # a response is the model's text: whatever it holds, it grades to a score in [0, 1], never an exception
        # that would end the run (a grader's own bug shows in the warning, naming the grader)
        try:
            return min(max(float(graded()), 0.0), 1.0)
        except Exception as err:  # noqa: BLE001
            log.warning("reward=%s raised %s grading a response of %d characters against label %.80r; it scores 0",
                        reward.name, f"{type(err).__name__}: {err}"[:300], len(response_text), str(label))
            return 0.0

    if threading.current_thread() is not threading.main_thread():
        if not g.linear:
            raise RuntimeError(f"reward={reward.name} grades under a SIGALRM deadline (reward.timeout_s), which only "
                               f"the main thread can arm; grade in the main thread")
        return run()
    if g.setup is not None:
        g.setup()
    started = time.perf_counter()
    try:
        with deadline(reward.timeout_s):
            return run()
    except GradingTimeout:
        log.warning("reward=%s: grading a response of %d characters took over reward.timeout_s=%ss (%.1fs); it "
                    "scores 0", reward.name, len(response_text), reward.timeout_s, time.perf_counter() - started)
        return 0.0
