"""The per-prompt scores of every eval point (``<run>/eval/<set>-step<N>.json``), and the change between two points.

The same prompts are scored at every point with the same request seeds, so the change of a set's avg@n between two
points is best measured per prompt. Its standard error follows the project's one rule (``r3rl.metrics``): clustered
by normalised problem, since two prompts that restate one problem ('a + b', 'b + a') are not independent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from r3rl import metrics as M


def record_path(record_dir: Path, name: str, step: int) -> Path:
    return Path(record_dir) / f"{name}-step{step:06d}.json"


def write_record(record_dir: Path, name: str, step: int, rewards: Sequence[float], groups: Sequence[int],
                 problems: Sequence[str]) -> None:
    """Set ``name``'s mean reward per prompt at ``step`` (prompts in index order) with each prompt's problem."""
    per_prompt: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        per_prompt.setdefault(int(g), []).append(float(r))
    order = sorted(per_prompt)
    path = record_path(record_dir, name, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"set": name, "step": step,
                                "prompt_means": [sum(per_prompt[g]) / len(per_prompt[g]) for g in order],
                                "problems": [problems[g] if problems else str(g) for g in order]}))


def prompt_changes(record_dir: Path, name: str, first: int, last: int) -> tuple[list[float], list[str]]:
    """Per prompt of set ``name`` (index order), its score at ``last`` minus at ``first``, and its problem. Records
    written before problems were kept raise: their prompts' problems are unknown, and counting every prompt as
    independent overstates the evidence."""
    a, b = (json.loads(record_path(record_dir, name, s).read_text()) for s in (first, last))
    if "problems" not in a or a.get("problems") != b.get("problems"):
        raise ValueError(f"{record_path(record_dir, name, first)}: per-prompt records without the same problem keys "
                         "at both points (written before r3rl clustered eval errors by problem); rerun the eval")
    return [y - x for x, y in zip(a["prompt_means"], b["prompt_means"])], list(a["problems"])


def paired_gain(record_dir: Path, name: str, first: int, last: int) -> tuple[float, float, int]:
    """(mean per-prompt change of set ``name``'s score from ``first`` to ``last``, its standard error clustered by
    problem, the number of distinct problems)."""
    changes, problems = prompt_changes(record_dir, name, first, last)
    change, se = M.mean_and_stderr(changes, problems)
    return change, se, len(set(problems))
