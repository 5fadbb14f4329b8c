"""Training trains: a shortened default learning run (SFT warm start, then GRPO with R3) raises the held-out score."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from r3rl.eval.records import paired_gain

from .conftest import REPO, assert_nothing_left, wandb_runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The default CPU recipe (its warm start, cached like make run's), shortened to 20 GRPO steps with an eval point
# before and after them on 128 held-out problems x 8 samples (the held-out split: no warm-start or GRPO problem, each
# problem once, 'a + b' and 'b + a' being one). The default 60-step run's gain is about 1.4 of its standard errors at
# step 10 and 4.2 at step 20 (docs/training.md), and a 20-step run's cosine ends its lr there: 20 steps leave
# a margin over the 2 asserted. Eval requests and rollouts are seeded, so the run is the same run every time.
STEPS = 20
SHORT = (f"run.num_steps={STEPS}", f"run.eval_every={STEPS}", "eval.sets.arithmetic.n_samples_per_prompt=8")


def test_a_short_learning_run_raises_the_held_out_score(tmp_path):
    """The held-out avg@8 after 20 GRPO steps exceeds the one before them by at least 2 standard errors of the
    per-prompt change, clustered by problem (``r3rl.eval.records.paired_gain``); the warm start, exported and
    loaded into vLLM, answers some held-out problems right before any GRPO step. Fails when training does not
    train: a sign error in the policy loss, advantages that never reach the loss, an optimizer that does not step,
    or engines that keep serving the old weights after a sync; and if the generated set held both orderings of a
    problem again (fewer problems than prompts), or its records lacked their problem keys (``paired_gain`` refuses
    them)."""
    run_dir = tmp_path / "learn"
    cmd = [sys.executable, "run.py", "parallelism=cpu", f"run.output_dir={run_dir}",
           *SHORT]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = wandb_runs(run_dir)
    points = [row for row in run.history if "eval/arithmetic/avg@8" in row]
    assert [row["_step"] for row in points] == [0, STEPS]
    first, last = (row["eval/arithmetic/avg@8"] for row in points)
    # the same prompts at both points: the mean per-prompt change, clustered by problem (the recipe's records)
    gain, se, problems = paired_gain(run_dir / "eval", "arithmetic", 0, STEPS)
    assert math.isclose(gain, last - first, abs_tol=1e-9)
    assert problems == len(json.loads((run_dir / "eval" / "arithmetic-step000000.json").read_text())["problems"])
    assert first > 0, "the exported warm start answers no held-out problem in vLLM"
    assert gain >= 2 * se, f"held-out avg@8 {first:.3f} -> {last:.3f} (se of the change {se:.3f}, {problems} problems)"
    assert "SFT warm start" in out.stdout
    assert_nothing_left(run_dir)
