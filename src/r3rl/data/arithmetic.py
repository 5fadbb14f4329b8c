"""A small arithmetic prompt set made by r3rl, so the default run needs no download.

Problems are +, - and * on small integers, asking for the answer in ``\\boxed{}`` (the shape the math reward and
the tiny model's tokenizer expect). The same seed and count give the same file on every machine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from r3rl.config.modes import SPLIT_NAMES, TRAIN_SPLIT
from r3rl.config.schema import DataConfig
from r3rl.data.formats import missing_prompts_message
from r3rl.data.overlap import problem_key, problem_keys

_OPS = ("+", "-", "*")
PROMPT_TEMPLATE = "What is {a} {op} {b}? Think step by step and put the final answer in \\boxed{{}}."
_PROBLEM = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
# The SFT solution of a problem: the equation with its result boxed. Short on purpose: with the tokenizer's
# end-of-turn token it stays within the CPU profile's 16-token responses (at most 13 tokens), so a model that learnt
# it is never truncated before the box closes.
SOLUTION_TEMPLATE = "{a} {op} {b} = \\boxed{{{answer}}}"
# The wordy style of the same solution (``data.verbose_share`` of the records): about 20 tokens, so under the CPU
# profile's 16-token responses it is cut before its box closes and scores 0. Cold-start data is like that (long
# solutions, a short rollout budget); GRPO then has to learn to answer within the budget, a behaviour every prompt
# shares, so it shows on the held-out set as well.
VERBOSE_TEMPLATE = "Let me add the two numbers: {a} {op} {b} = \\boxed{{{answer}}}"
# bumped when the solutions change, so cached SFT files are regenerated (their fingerprint records it)
SOLUTION_VERSION = 2


@dataclass(frozen=True)
class ProblemSpace:
    """The problems ``a op b`` the generator draws from: ``ops`` among ``+-*``, operands ``min_operand`` ..
    ``max_operand`` (products at most 0..20), and the ``split`` of that space (``all``, ``train`` = all but the
    held-out share, or one of ``SPLITS``)."""

    ops: str = "+-*"
    max_operand: int = 99
    split: str = "all"
    min_operand: int = 0

    @classmethod
    def of(cls, data_cfg: DataConfig, split: str | None = None) -> ProblemSpace:
        return cls(data_cfg.ops, data_cfg.max_operand, data_cfg.split if split is None else split,
                   data_cfg.min_operand)

    def operand_range(self, op: str) -> tuple[int, int]:
        return self.min_operand, (min(20, self.max_operand) if op == "*" else self.max_operand)

    @property
    def enumerable(self) -> bool:
        """Small enough to list every problem (draws from a larger space are rejection-sampled by split)."""
        return sum((hi - lo + 1) ** 2 for lo, hi in map(self.operand_range, dict.fromkeys(self.ops))
                   if hi >= lo) <= _ENUMERABLE


# Disjoint shares of every problem space, by a stable hash of the problem with its operands in a canonical order
# (a + b and b + a fall in the same split): the SFT warm start, GRPO's prompts and the held-out eval never share a
# problem, whatever their seeds and counts. ``all``: the whole space; ``train``: all but the held-out share.
SPLITS: dict[str, tuple[float, float]] = dict(zip(SPLIT_NAMES, ((0.0, 0.7), (0.7, 0.85), (0.85, 1.0))))


# spaces with more operand pairs than this are sampled, never listed (4-digit additions hold 81 million)
_ENUMERABLE = 1_000_000


def split_of(a: int, op: str, b: int) -> str:
    """Which of ``SPLITS`` the problem ``a op b`` belongs to (the same on every machine)."""
    lo, hi = (min(a, b), max(a, b)) if op in "+*" else (a, b)
    digest = hashlib.sha256(f"{lo} {op} {hi}".encode()).digest()
    share = int.from_bytes(digest[:8], "big") / 2 ** 64
    return next(name for name, (start, end) in SPLITS.items() if start <= share < end)


def in_split(a: int, op: str, b: int, split: str) -> bool:
    """Whether ``a op b`` is drawn by ``data.split=split`` (one share, ``train`` = every share but held-out, or
    ``all``)."""
    if split == "all":
        return True
    name = split_of(a, op, b)
    return name != "heldout" if split == TRAIN_SPLIT else name == split


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


@functools.lru_cache(maxsize=16)
def problems_of(space: ProblemSpace) -> dict[str, tuple[tuple[int, int], ...]]:
    """Every problem of ``space``'s split, as operand pairs per operator (operators with none are left out)."""
    if not space.ops or set(space.ops) - set(_OPS):
        raise ValueError(f"data.ops={space.ops!r}: use one or more of {''.join(_OPS)!r}")
    if space.split not in ("all", TRAIN_SPLIT) and space.split not in SPLITS:
        raise ValueError(f"data.split={space.split!r}: use all, {TRAIN_SPLIT} or one of {sorted(SPLITS)}")
    if not space.enumerable:
        raise ValueError(f"operands {space.min_operand}..{space.max_operand}: too many problems to list "
                         "(draw_problem samples them)")
    out = {}
    for op in dict.fromkeys(space.ops):
        lo, hi = space.operand_range(op)
        pairs = tuple((a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                      if in_split(a, op, b, space.split))
        if pairs:
            out[op] = pairs
    if not out:
        raise ValueError(f"no arithmetic problem in split {space.split!r} of ops={space.ops!r} with operands up "
                         f"to {space.max_operand}")
    return out


def draw_problem(rng: random.Random, space: ProblemSpace = ProblemSpace()) -> dict[str, str]:
    """One problem of ``space`` as ``{"prompt": ..., "label": ...}``: an operator, then one of its operand pairs
    (in a space too large to list, uniform operands redrawn until the problem is in the split)."""
    if space.enumerable:
        problems = problems_of(space)
        op = rng.choice(sorted(problems))
        a, b = rng.choice(problems[op])
    else:
        ops = [op for op in sorted(dict.fromkeys(space.ops)) if space.operand_range(op)[1] >= space.min_operand]
        if not ops:
            raise ValueError(f"no arithmetic problem of ops={space.ops!r} with operands {space.min_operand}.."
                             f"{space.max_operand}")
        op = rng.choice(ops)
        lo, hi = space.operand_range(op)
        while True:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if in_split(a, op, b, space.split):
                break
    return {"prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b), "label": str(_answer(a, op, b))}


def generate_problems(num: int, seed: int, space: ProblemSpace = ProblemSpace()) -> list[dict[str, str]]:
    """``num`` problems of ``space`` drawn from ``seed`` (repeats possible, as in any sample of the space)."""
    if num <= 0:
        raise ValueError(f"data.num_generated_prompts={num}: must be positive to generate prompts")
    rng = random.Random(seed)
    return [draw_problem(rng, space) for _ in range(num)]


def worked_solution(prompt: str, verbose: bool = False) -> tuple[str, str]:
    """(response, label) for a prompt of ``PROMPT_TEMPLATE``: the equation and its result in ``\\boxed{}``, which
    ``r3rl.data.reward.math_reward`` grades as correct (``verbose``: in ``VERBOSE_TEMPLATE``'s words)."""
    m = _PROBLEM.search(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt of r3rl.data.arithmetic: {prompt!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    answer = _answer(a, op, b)
    template = VERBOSE_TEMPLATE if verbose else SOLUTION_TEMPLATE
    return template.format(a=a, op=op, b=b, answer=answer), str(answer)


def worked_tool_episode(prompt: str) -> list[list[dict[str, str]]]:
    """The calculator episode of a prompt of ``PROMPT_TEMPLATE`` as two SFT chats (the loss is on a chat's last
    message): the prompt answered by a tool call, and the whole episode up to the answer taken from the tool's result.
    Rendered by the chat template they are the token sequence ``env=calculator`` runs (its observation template is
    the template's user turn)."""
    from r3rl.env.calculator import CALL_TEMPLATE, RESULT_TEMPLATE

    m = _PROBLEM.search(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt of r3rl.data.arithmetic: {prompt!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    answer = _answer(a, op, b)
    call = {"role": "assistant", "content": CALL_TEMPLATE.format(expression=f"{a} {op} {b}")}
    chat = [{"role": "user", "content": prompt}, call]
    return [chat, chat + [{"role": "user", "content": RESULT_TEMPLATE.format(result=answer)},
                          {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]]


def generate_sft_examples(num: int, seed: int, space: ProblemSpace = ProblemSpace(),
                          verbose_share: float = 0.0, tool_share: float = 0.0,
                          messages_key: str = "messages") -> list[dict]:
    """The problems of ``generate_problems(num, seed, space)`` (the same draw as the prompt file of that seed, count
    and space) with a worked solution each, ``verbose_share`` of them in the wordy style and ``tool_share`` as a
    calculator episode (two records, ``worked_tool_episode``), both drawn from ``seed``: ``{"prompt", "label",
    "response"}`` or ``{"prompt", "label", messages_key}``."""
    out = []
    styles = random.Random(seed + 1)
    tools = random.Random(seed + 2)
    for problem in generate_problems(num, seed, space):
        if tool_share and tools.random() < tool_share:
            out += [{**problem, messages_key: chat} for chat in worked_tool_episode(problem["prompt"])]
            continue
        response, label = worked_solution(problem["prompt"], verbose=styles.random() < verbose_share)
        assert label == problem["label"]
        out.append({**problem, "response": response})
    return out


def sft_fingerprint(data_cfg: DataConfig) -> dict:
    """What a generated SFT file was made from; a cached file with another fingerprint is regenerated."""
    return {"generator": "arithmetic_sft", "solution_version": SOLUTION_VERSION, "template": SOLUTION_TEMPLATE,
            "verbose_template": VERBOSE_TEMPLATE, "verbose_share": data_cfg.verbose_share,
            **({"tool_share": data_cfg.tool_share} if data_cfg.tool_share else {}),
            "prompt_template": PROMPT_TEMPLATE, "num": data_cfg.num_generated_prompts, "seed": data_cfg.seed,
            "keys": [data_cfg.prompt_key, data_cfg.label_key, data_cfg.response_key],
            "space": dataclasses.asdict(ProblemSpace.of(data_cfg)), "splits": SPLITS}


def fingerprint_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".r3rl_generated.json")


def ensure_generated(path: str | os.PathLike, fingerprint: dict, make, *, regenerate: bool = True,
                     missing: str = "") -> Path:
    """``path``, written by ``make(path)`` when missing, or rewritten when r3rl made it from another ``fingerprint``
    (its marker file beside it); both only when ``regenerate`` allows, else a missing file raises FileNotFoundError
    with ``missing``. A file r3rl did not make is used as it is, never overwritten."""
    path = Path(path)
    if not path.exists() and not regenerate:  # a file, or an HF save_to_disk folder
        raise FileNotFoundError(missing)
    if used_as_is(path, fingerprint, regenerate):
        return path
    marker = fingerprint_path(path)
    fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))  # as it reads back (tuples become lists)
    out = make(path)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps(fingerprint, sort_keys=True))
    os.replace(tmp, marker)
    return out


def used_as_is(path: str | os.PathLike, fingerprint: dict, regenerate: bool = True) -> bool:
    """Whether ``ensure_generated`` would use the file at ``path`` as it is (validation reads that file, and draws
    what would be written otherwise, without writing)."""
    path = Path(path)
    if not path.exists():
        return False
    marker = fingerprint_path(path)
    if not marker.is_file() or not regenerate:
        return True
    return json.loads(marker.read_text()) == json.loads(json.dumps(fingerprint, sort_keys=True))


def ensure_sft_data(data_cfg: DataConfig) -> Path:
    """The SFT file of ``data_cfg``: generated (worked arithmetic solutions) when missing, or regenerated when it
    is one r3rl made from another fingerprint, with ``data.generate_if_missing``; a file r3rl did not make is used
    as it is and never overwritten."""
    def make(path: Path) -> Path:
        examples = generate_sft_examples(data_cfg.num_generated_prompts, data_cfg.seed, ProblemSpace.of(data_cfg),
                                         data_cfg.verbose_share, data_cfg.tool_share, data_cfg.messages_key)
        for ex in examples:  # the response under its configured key (write_jsonl renames prompt and label)
            if "response" in ex:
                ex[data_cfg.response_key] = ex.pop("response")
        return write_jsonl(examples, path, prompt_key=data_cfg.prompt_key, label_key=data_cfg.label_key)

    return ensure_generated(
        data_cfg.path, sft_fingerprint(data_cfg), make, regenerate=data_cfg.generate_if_missing,
        missing=f"data.path={data_cfg.path}: no such file. Point data.path at a JSONL file with one object per line "
                f"holding '{data_cfg.prompt_key}' and '{data_cfg.response_key}' (or '{data_cfg.messages_key}'), or "
                f"use data=arithmetic_sft, which generates its records.")


def generate_heldout(num: int, seed: int, exclude: Iterable[str],
                     space: ProblemSpace = ProblemSpace()) -> list[dict[str, str]]:
    """``num`` distinct problems of ``space`` (the training prompts' space, its ``heldout`` split when the training
    data draws from a split), none of which is a prompt of ``exclude``, both by normalised problem
    (``r3rl.data.overlap.problem_key``: ``b + a`` is excluded with ``a + b``, and only one of the two is drawn, so
    the set's prompts are as many independent units as there are prompts).

    Drawing from the same distribution keeps the held-out split comparable; excluding by problem (not by seed)
    holds whatever file the training prompts came from.
    """
    if num <= 0:
        raise ValueError(f"num_generated_prompts={num}: must be positive to generate prompts")
    training = problem_keys(exclude)
    taken: set[str] = set()
    available = len({problem_key(PROMPT_TEMPLATE.format(a=a, op=op, b=b))
                     for op, pairs in problems_of(space).items() for a, b in pairs}) if space.enumerable else None
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    for _ in range(1000 * num):
        problem = draw_problem(rng, space)
        key = problem_key(problem["prompt"])
        if key not in taken and key not in training:
            taken.add(key)
            out.append(problem)
            if len(out) == num:
                return out
    raise ValueError(f"could draw only {len(out)} of {num} arithmetic problems outside the training prompts "
                     f"(split {space.split!r} holds {available} problems, a + b and b + a counted once)")


def write_jsonl(records: Iterable[dict], path: str | os.PathLike, *, prompt_key: str = "prompt",
                label_key: str = "label") -> Path:
    """Write records (with ``prompt``/``label``, renamed to the configured keys) atomically: temp file, then rename.

    Two runs generating the same file at once (a multirun) each rename a complete file into place.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                row = {prompt_key: rec["prompt"], label_key: rec["label"]}
                row.update({k: v for k, v in rec.items() if k not in ("prompt", "label")})
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def prompts_fingerprint(data_cfg: DataConfig) -> dict:
    """What a generated prompt file was made from; a cached file with another fingerprint is regenerated."""
    return {"generator": "arithmetic", "prompt_template": PROMPT_TEMPLATE, "num": data_cfg.num_generated_prompts,
            "seed": data_cfg.seed, "keys": [data_cfg.prompt_key, data_cfg.label_key],
            "space": dataclasses.asdict(ProblemSpace.of(data_cfg)), "splits": SPLITS}


def ensure_prompts(data_cfg: DataConfig) -> Path:
    """The prompt file of ``data_cfg``, generated first when missing (or stale, when r3rl made it from another
    draw) and ``data.generate_if_missing`` allows it."""
    def make(path: Path) -> Path:
        problems = generate_problems(data_cfg.num_generated_prompts, data_cfg.seed, ProblemSpace.of(data_cfg))
        return write_jsonl(problems, path, prompt_key=data_cfg.prompt_key, label_key=data_cfg.label_key)

    return ensure_generated(
        data_cfg.path, prompts_fingerprint(data_cfg), make, regenerate=data_cfg.generate_if_missing,
        missing=missing_prompts_message(data_cfg))
