"""``env=calculator``: the policy may ask a calculator before it answers.

A policy turn that holds ``<calc>EXPRESSION</calc>`` and no ``\\boxed{}`` answer is a tool call: the environment
answers ``<result>VALUE</result>``, or ``<result>error: ...</result>`` for an expression it cannot evaluate, and the
policy takes another turn. A turn with a boxed answer, or with neither, ends the episode; the run's ``reward``
config grades its text.

Expressions are parsed with ``ast`` and evaluated node by node: integers and decimals, ``+ - * / // %`` and
parentheses, nothing else (no names, calls, attributes or powers), at most ``max_chars`` characters and results of at
most ``max_digits`` digits. Nothing reaches ``eval``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction

from r3rl.env.base import Environment, Episode, Turn

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
BOXED = "\\boxed{"
# how a call and its answer are written (the SFT warm start's worked tool episodes use the same)
CALL_TEMPLATE = "<calc>{expression}</calc>"
RESULT_TEMPLATE = "<result>{result}</result>"

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the policy reads."""


def evaluate(expression: str, *, max_chars: int = 200, max_digits: int = 40) -> str:
    """The value of ``expression`` as text (exact: integers stay integers, a division's value is a fraction written
    as a decimal when it ends, else ``p/q``); ``CalcError`` for anything else."""
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > max_chars:
        raise CalcError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {text!r}") from None

    def bounded(out: Fraction) -> Fraction:
        # digit counts from bit lengths: str() of a huge integer is what the bound exists to avoid
        if max(abs(out.numerator).bit_length(), out.denominator.bit_length()) > max_digits * 3.33 + 4 or \
                len(str(abs(out.numerator))) > max_digits or len(str(out.denominator)) > max_digits:
            raise CalcError(f"result longer than {max_digits} digits")
        return out

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if isinstance(node.value, float) and not math.isfinite(node.value):  # 1e999 parses as inf
                raise CalcError(f"number out of range in {text!r}")
            return bounded(Fraction(str(node.value)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
                raise CalcError("division by zero")
            return bounded(Fraction(_BINARY[type(node.op)](left, right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise CalcError(f"unsupported {type(node).__name__} in {text!r}: only numbers, + - * / // % and parentheses")

    return _as_text(value(tree))


def _as_text(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d != 1:  # not a terminating decimal
        return f"{x.numerator}/{x.denominator}"
    digits = 0
    while (x * 10 ** digits).denominator != 1:
        digits += 1
    scaled = x * 10 ** digits
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled.numerator), 10 ** digits)
    return f"{sign}{whole}.{frac:0{digits}d}"


class CalculatorEpisode(Episode):
    def __init__(self, env: CalculatorEnv):
        self.env = env

    def step(self, text: str) -> Turn:
        calls = CALL.findall(text)
        if BOXED in text or not calls:
            return Turn(observation=None, done=True)
        try:
            result, error = evaluate(calls[-1], max_chars=self.env.max_chars, max_digits=self.env.max_digits), False
        except CalcError as err:
            result, error = f"error: {err}", True
        return Turn(observation=RESULT_TEMPLATE.format(result=result), tool_call=True, tool_error=error)


class CalculatorEnv(Environment):
    def __init__(self, max_chars: int = 200, max_digits: int = 40):
        self.max_chars = max_chars
        self.max_digits = max_digits

    def start(self, prompt: str, label: str | None) -> Episode:
        return CalculatorEpisode(self)
