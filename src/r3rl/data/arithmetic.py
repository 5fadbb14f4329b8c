"""A small arithmetic prompt set made by r3rl, so the default run needs no download.

Problems are +, - and * on small integers, asking for the answer in ``\\boxed{}`` (the shape the math reward and
the tiny model's tokenizer expect). The same seed and count give the same file on every machine.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path

from r3rl.config.schema import DataConfig

_OPS = ("+", "-", "*")
PROMPT_TEMPLATE = "What is {a} {op} {b}? Think step by step and put the final answer in \\boxed{{}}."


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
