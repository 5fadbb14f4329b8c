"""A small arithmetic prompt set made by r3rl, so the default run needs no download.

Problems are +, - and * on small integers, asking for the answer in ``\\boxed{}`` (the shape the math reward and
the tiny model's tokenizer expect). The same seed and count give the same file on every machine.
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

from r3rl.config.schema import DataConfig

_OPS = ("+", "-", "*")
PROMPT_TEMPLATE = "What is {a} {op} {b}? Think step by step and put the final answer in \\boxed{{}}."
_PROBLEM = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
# The SFT solution of a problem: the equation with its result boxed. Short on purpose: with the tokenizer's
# end-of-turn token it stays within the CPU profile's 16-token responses (at most 13 tokens), so a model that learnt
# it is never truncated before the box closes.
SOLUTION_TEMPLATE = "{a} {op} {b} = \\boxed{{{answer}}}"
# bumped when the solutions change, so cached SFT files are regenerated (their fingerprint records it)
SOLUTION_VERSION = 1


def draw_problem(rng: random.Random) -> dict[str, str]:
    """One problem as ``{"prompt": ..., "label": ...}``; products stay small (operands up to 20)."""
    op = rng.choice(_OPS)
    hi = 20 if op == "*" else 99
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return {"prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b), "label": str(answer)}


def generate_problems(num: int, seed: int) -> list[dict[str, str]]:
    """``num`` problems drawn from ``seed`` (repeats possible, as in any sample of the problem space)."""
    if num <= 0:
        raise ValueError(f"data.num_generated_prompts={num}: must be positive to generate prompts")
    rng = random.Random(seed)
    return [draw_problem(rng) for _ in range(num)]


def worked_solution(prompt: str) -> tuple[str, str]:
    """(response, label) for a prompt of ``PROMPT_TEMPLATE``: the equation and its result in ``\\boxed{}``, which
    ``r3rl.data.reward.math_reward`` grades as correct."""
    m = _PROBLEM.search(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt of r3rl.data.arithmetic: {prompt!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return SOLUTION_TEMPLATE.format(a=a, op=op, b=b, answer=answer), str(answer)


def generate_sft_examples(num: int, seed: int) -> list[dict[str, str]]:
    """The problems of ``generate_problems(num, seed)`` (the same draw as the prompt file of that seed and count)
    with a worked solution each: ``{"prompt", "label", "response"}``."""
    out = []
    for problem in generate_problems(num, seed):
        response, label = worked_solution(problem["prompt"])
        assert label == problem["label"]
        out.append({**problem, "response": response})
    return out


def sft_fingerprint(data_cfg: DataConfig) -> dict:
    """What a generated SFT file was made from; a cached file with another fingerprint is regenerated."""
    return {"generator": "arithmetic_sft", "solution_version": SOLUTION_VERSION, "template": SOLUTION_TEMPLATE,
            "prompt_template": PROMPT_TEMPLATE, "num": data_cfg.num_generated_prompts, "seed": data_cfg.seed,
            "keys": [data_cfg.prompt_key, data_cfg.label_key, data_cfg.response_key]}


def fingerprint_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".r3rl_generated.json")


def ensure_sft_data(data_cfg: DataConfig) -> Path:
    """The SFT file of ``data_cfg``: generated (worked arithmetic solutions) when missing, or regenerated when it
    is one r3rl made from another fingerprint, with ``data.generate_if_missing``; a file r3rl did not make is used
    as it is and never overwritten."""
    path = Path(data_cfg.path)
    marker = fingerprint_path(path)
    fingerprint = sft_fingerprint(data_cfg)
    if path.is_file():
        if not marker.is_file() or not data_cfg.generate_if_missing:
            return path
        if json.loads(marker.read_text()) == fingerprint:
            return path
    elif not data_cfg.generate_if_missing:
        raise FileNotFoundError(
            f"data.path={data_cfg.path}: no such file. Point data.path at a JSONL file with one object per line "
            f"holding '{data_cfg.prompt_key}' and '{data_cfg.response_key}' (or '{data_cfg.messages_key}'), or use "
            f"data=arithmetic_sft, which generates its records."
        )
    examples = generate_sft_examples(data_cfg.num_generated_prompts, data_cfg.seed)
    for ex in examples:  # the response under its configured key (write_jsonl renames prompt and label)
        ex[data_cfg.response_key] = ex.pop("response")
    out = write_jsonl(examples, path, prompt_key=data_cfg.prompt_key, label_key=data_cfg.label_key)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps(fingerprint, sort_keys=True))
    os.replace(tmp, marker)
    return out


def generate_heldout(num: int, seed: int, exclude: Iterable[str]) -> list[dict[str, str]]:
    """``num`` distinct problems drawn like the training prompts, none of whose prompt text is in ``exclude``.

    Drawing from the same distribution keeps the held-out split comparable; excluding by prompt text (not by seed)
    holds whatever file the training prompts came from.
    """
    if num <= 0:
        raise ValueError(f"num_generated_prompts={num}: must be positive to generate prompts")
    taken = set(exclude)
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    for _ in range(1000 * num):  # the space holds ~21k problems: only a near-exhaustive training set runs out
        problem = draw_problem(rng)
        if problem["prompt"] not in taken:
            taken.add(problem["prompt"])
            out.append(problem)
            if len(out) == num:
                return out
    raise ValueError(f"could draw only {len(out)} of {num} arithmetic problems outside the training prompts")


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


def ensure_prompts(data_cfg: DataConfig) -> Path:
    """The prompt file of ``data_cfg``, generated first when missing and ``data.generate_if_missing`` allows it."""
    path = Path(data_cfg.path)
    if path.is_file():
        return path
    if not data_cfg.generate_if_missing:
        raise FileNotFoundError(
            f"data.path={data_cfg.path}: no such file. Point data.path at a JSONL file with one object per line "
            f"holding '{data_cfg.prompt_key}' and '{data_cfg.label_key}' (data={data_cfg.name}), or use "
            f"data=arithmetic, which generates its prompts."
        )
    problems = generate_problems(data_cfg.num_generated_prompts, data_cfg.seed)
    return write_jsonl(problems, path, prompt_key=data_cfg.prompt_key, label_key=data_cfg.label_key)
