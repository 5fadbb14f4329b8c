"""Normalised problem keys, so an eval problem that is a training problem is found whatever its formatting.

Two prompts are the same problem when their user turns match after Unicode (NFKC), case and whitespace
normalisation. A generated arithmetic problem (``What is a op b?`` with no other number) is keyed by its operation
alone, its operands in order for ``+`` and ``*``: ``What is 3 + 4?`` and ``what is 4+3?`` share a key, since a model
that learnt one has learnt the other whatever the instruction around it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

# the generator's question (r3rl.data.arithmetic.PROMPT_TEMPLATE) after normalisation; a digit in the tail makes it
# another problem (a follow-up computation), so the tail may hold none
_ARITHMETIC = re.compile(r"what is (\d+) ?([-+*]) ?(\d+) ?\?([^\d]*)")


def user_texts(prompt: str | list[dict[str, str]]) -> list[str]:
    """The text a user asks: the prompt itself, or the user turns of a chat (a system prompt is not the problem)."""
    if isinstance(prompt, str):
        return [prompt]
    return [m["content"] for m in prompt if m.get("role") == "user"]


def problem_key(prompt: str | list[dict[str, str]]) -> str:
    """The normalised problem of ``prompt`` (a chat's user turns joined)."""
    text = " ".join(unicodedata.normalize("NFKC", "\n".join(user_texts(prompt))).casefold().split())
    m = _ARITHMETIC.fullmatch(text)
    if m is None:
        return text
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op in "+*":
        a, b = min(a, b), max(a, b)
    return f"arithmetic: {a} {op} {b}"


def problem_keys(prompts: Iterable[str | list[dict[str, str]]]) -> set[str]:
    """Keys of training prompts: every user turn on its own, so an eval problem asked in any turn is caught."""
    return {problem_key(t) for p in prompts for t in user_texts(p)}
