"""Training trains: a shortened default learning run (SFT warm start, then GRPO with R3) raises the held-out score."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from r3rl.net import free_port

from .conftest import REPO, assert_nothing_left, wandb_runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The default CPU recipe (its warm start, cached like make run's), shortened to 8 GRPO steps with an eval point
# before and after them on 64 held-out problems x 4 samples (the held-out split: no warm-start or GRPO problem). A
# 200-step warm start left too little to build on: 0.074 -> 0.062 in 8 steps.
SHORT = ("run.num_steps=8", "run.eval_every=8")


def test_a_short_learning_run_raises_the_held_out_score(tmp_path):
    """The held-out avg@4 after 8 GRPO steps exceeds the one before them by more than the standard error of the
    difference, seeds fixed; the warm start, exported and loaded into vLLM, answers some held-out problems right
    before any GRPO step. Fails when training does not train: a sign error in the policy loss, advantages that never
    reach the loss, an optimizer that does not step, or engines that keep serving the old weights after a sync."""
    run_dir = tmp_path / "learn"
    cmd = [sys.executable, "run.py", "parallelism=cpu", f"run.output_dir={run_dir}",
           f"rollout.engine.base_port={free_port()}", *SHORT]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = wandb_runs(run_dir)
    points = [row for row in run.history if "eval/arithmetic/avg@4" in row]
    assert [row["_step"] for row in points] == [0, 8]
    first, last = (row["eval/arithmetic/avg@4"] for row in points)
    # the same 64 prompts at both points: the standard error of the mean per-prompt change (the recipe's records)
    before, after = (json.loads((run_dir / "eval" / f"arithmetic-step{s:06d}.json").read_text())["prompt_means"]
                     for s in (0, 8))
    assert math.isclose(sum(before) / len(before), first) and math.isclose(sum(after) / len(after), last)
    change = [b - a for a, b in zip(before, after)]
    mean = sum(change) / len(change)
    se = math.sqrt(sum((c - mean) ** 2 for c in change) / (len(change) - 1) / len(change))
    assert first > 0, "the exported warm start answers no held-out problem in vLLM"
    assert last - first > se, f"held-out avg@4 {first:.3f} -> {last:.3f} (se of the change {se:.3f})"
    assert "SFT warm start" in out.stdout
    assert_nothing_left(run_dir)
