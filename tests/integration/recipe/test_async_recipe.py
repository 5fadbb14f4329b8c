"""``algorithm.max_staleness=1`` on real components: the engines generate the next batch while the trainer trains,
every sample carries the version that generated it, R3 still replays exactly, eval points score the step's own
weights, and SIGTERM/resume loses no batch and trains none twice (a dead engine: ``test_grpo_recipe.py``)."""

from __future__ import annotations

import os
import signal

import pytest

from r3rl import checkpoint
from r3rl import metrics as M
from r3rl.rollout.store import load_rollout

from .conftest import PLUMBING, SMALL_STEP, assert_nothing_left, run_recipe, start_recipe, wait_for, wandb_runs

pytestmark = pytest.mark.integration

# one step off-policy needs a correction by the generating policy (refused without one)
ASYNC = ("algorithm.max_staleness=1", "correction=tis")


def expected_batches(tiny_model_dir, steps: int, batch_size: int | None = None) -> list[list[tuple[int, ...]]]:
    """The prompts of each step's batch, as the data sampler hands them out (the recipe's own config), or of
    ``batch_size`` prompts each (a stream of groups draws one at a time)."""
    from transformers import AutoTokenizer

    from r3rl.config import compose
    from r3rl.data.dataset import PromptDataset

    cfg = compose(["parallelism=cpu", *PLUMBING, *SMALL_STEP])
    batches = PromptDataset(cfg.data, AutoTokenizer.from_pretrained(tiny_model_dir)).batches(
        batch_size or cfg.algorithm.rollout_batch_size)
    return [sorted(tuple(int(t) for t in p.prompt_ids) for p in next(batches)) for _ in range(steps)]


def trained_prompts(rollouts) -> list[list[tuple[int, ...]]]:
    out = []
    for path in sorted(rollouts.glob("step_*.npz")):
        samples = load_rollout(path)
        out.append(sorted({tuple(int(t) for t in s.prompt_ids) for s in samples}))
    return out


def sigterm_after_first_checkpoint(run_dir, args) -> checkpoint.CheckpointMeta:
    """Start the recipe, SIGTERM it once its first checkpoint is there, and return the checkpoint it stopped with
    (exit 143 asserted)."""
    proc = start_recipe(run_dir, *args)
    try:
        # at once: a CPU step takes ~1 s, so a 1 s poll let SIGTERM land after step 2's eval (or the run's end)
        wait_for(lambda: (checkpoint.checkpoint_root(run_dir) / "latest").is_file(), 900, "step 1 checkpoint", proc,
                 poll=0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, (run_dir / "driver.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return checkpoint.read_meta(checkpoint.latest(run_dir))


@pytest.mark.parametrize("weight_update", ["between_batches", "in_flight"])
def test_one_step_off_policy_run_with_sigterm_and_resume(tmp_path, tiny_model_dir, weight_update):
    """4 steps at max_staleness 1 with R3, eval at 0, 2 and 4, SIGTERM after a checkpoint, then resume; with
    ``in_flight`` the step's weight update goes to the engines under the batch ahead, and the signal lands with
    that batch generating: it must be regenerated after the resume, not lost and not kept half-labelled.

    Fails if: a batch generated ahead were lost or trained twice across the resume (the checkpoint's data state
    must be from before its prompts were drawn); a sample's staleness were not what the schedule gives (0 on a
    run's first step and right after a resume, 1 otherwise: a missed sync makes it 2 and drops the batch, a sync
    before the batch makes it 0 and means nothing overlapped); an eval point scored older weights than its step's
    (the evaluator checks the version the engines served); or R3 stopped replaying the engine's routes."""
    run_dir = tmp_path / "async"
    args = ("run.num_steps=4", "run.save_every=1", "run.eval_every=2", *ASYNC, "rollout=vllm_r3",
            f"algorithm.weight_update={weight_update}",
            f"debug.save_rollout={run_dir / 'rollouts'}")
    stopped_at = sigterm_after_first_checkpoint(run_dir, args).step
    assert 1 <= stopped_at < 4
    assert_nothing_left(run_dir)

    out = run_recipe(run_dir, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in out.stdout

    # every batch trained once, in the sampler's order, across the two jobs
    assert trained_prompts(run_dir / "rollouts") == expected_batches(tiny_model_dir, 4)
    for step in range(1, 5):
        samples = load_rollout(run_dir / "rollouts" / f"step_{step:06d}.npz")
        fresh = step == 1 or step == stopped_at + 1
        want = step - 1 if fresh else step - 2
        assert {s.weight_version or 0 for s in samples} == {want}, (step, stopped_at)

    rows = {row["_step"]: row for r in wandb_runs(run_dir) for row in r.history}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step in range(1, 5):
        fresh = step == 1 or step == stopped_at + 1
        row = rows[step]
        assert row[M.STALENESS_MEAN] == row[M.STALENESS_MAX] == (0 if fresh else 1), (step, row)
        assert row[M.DROPPED_STALE] == 0
        assert row[M.REPLAY_MISMATCH_ROWS] == 0
        assert (M.LOGPROB_ABS_DIFF_FRESH in row) == fresh
        assert row[M.perf_time_key("generate")] > 0
    for step in (0, 2, 4):
        assert "eval/arithmetic/avg@2" in rows[step]
    assert_nothing_left(run_dir)



def test_groups_taken_in_completion_order_across_sigterm_and_resume(tmp_path, tiny_model_dir):
    """``algorithm.group_intake=completion`` (a stream of groups, 8 drawn at most, a step takes the first 4 to
    complete), 4 steps with eval at 2 and 4, SIGTERM after a checkpoint, then resume.

    Also fails if the stream drew past the staleness bound's limit (more groups pending at the checkpoint) or past
    what the run's last step takes.

    Fails if: a group drawn before the signal and not trained were lost or trained twice across the resume (the
    checkpoint must save the pending groups, and the resumed stream generate them again before it draws on); the
    stream drew past its buffer; a group older than the staleness bound stayed in the loss; the step right after the
    resume trained anything but the resumed weights' samples; an eval point scored older weights than its step's
    (the stream generates on while the weights go to the engines in flight); or R3 stopped replaying exactly."""
    from r3rl.rollout.store import load_rollout as load

    run_dir = tmp_path / "stream"
    args = ("run.num_steps=4", "run.save_every=1", "run.eval_every=2", *ASYNC, "rollout=vllm_r3",
            "algorithm.weight_update=in_flight", "algorithm.group_intake=completion", "algorithm.group_buffer=8",
            f"debug.save_rollout={run_dir / 'rollouts'}")
    stopped = sigterm_after_first_checkpoint(run_dir, args)
    # max_staleness 1: the engines' version v (the trainer's, or one behind it) lets serials below (v + 2) x 4 be
    # drawn, so 4 or 8 groups are pending
    assert 1 <= stopped.step < 4 and 4 <= len(stopped.data_state["pending"]) <= 8, stopped.data_state
    assert_nothing_left(run_dir)

    out = run_recipe(run_dir, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from step {stopped.step}" in out.stdout

    # every prompt drawn trained once: the stream's draws are the sampler's, one by one, and it draws nothing the
    # run's last step does not take
    final = checkpoint.read_meta(checkpoint.latest(run_dir)).data_state
    assert final["next_serial"] == 4 * 4 and final["pending"] == []
    draws = [p for batch in expected_batches(tiny_model_dir, 4 * 4, batch_size=1) for p in batch]
    trained = []  # one per group: a prompt trained twice in one step counts twice
    for path in sorted((run_dir / "rollouts").glob("step_*.npz")):
        trained += {s.group: tuple(int(t) for t in s.prompt_ids) for s in load(path)}.values()
    assert sorted(trained) == sorted(draws)

    rows = {row["_step"]: row for r in wandb_runs(run_dir) for row in r.history}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step in range(1, 5):
        samples = load(run_dir / "rollouts" / f"step_{step:06d}.npz")
        ages = {(step - 1) - (s.weight_version or 0) for s in samples}
        assert min(ages) >= 0 and all(s.loss_mask.sum() == 0 for s in samples
                                      if (step - 1) - (s.weight_version or 0) > 1), (step, ages)
        if step == 1 or step == stopped.step + 1:  # the stream (re)starts with the trainer's weights
            assert ages == {0}, (step, ages)
        row = rows[step]
        assert row[M.REPLAY_MISMATCH_ROWS] == 0
        assert 0 <= row[M.GROUPS_PENDING] <= 8 and 0 <= row[M.GROUPS_OVERTAKING] <= 4
    for step in (0, 2, 4):
        assert "eval/arithmetic/avg@2" in rows[step]
    assert_nothing_left(run_dir)
