"""The end-to-end recipe on real components: metrics in W&B, R3's effect, resume, faults, cleanup."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from r3rl import checkpoint
from r3rl import metrics as M

from .conftest import (EVAL_KEYS, assert_nothing_left, pid_alive, processes_with, run_recipe, start_recipe, wait_for,
                       wandb_runs)

pytestmark = pytest.mark.integration

EVERY_STEP = [M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY, M.LOGPROB_ABS_DIFF_STDERR,
              M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR, M.TOKEN_MULT_PROB_ERROR, M.K3_KL,
              M.ROUTING_FLIP_RATE, M.ROUTER_MARGIN_MEAN, M.ROUTER_MARGIN_SMALL_SHARE, M.EXPERT_LOAD_MAX_VIO,
              M.REPLAY_MISMATCH_ROWS, M.REWARD_MEAN, M.RESPONSE_LENGTH_MEAN, M.LOSS,
              M.GRAD_NORM, M.PERF_TOKENS_PER_S, M.EXTREME_TOKEN_FRACTION, *M.ROLLOUT_CORR_KEYS] + \
    [M.perf_time_key(s) for s in M.PERF_STAGES]


def train_rows(run):
    return [row for row in run.history if M.LOGPROB_ABS_DIFF in row]


def test_default_recipe_logs_every_metric_every_step(r3_run):
    (run,) = wandb_runs(r3_run)
    steps = {row["_step"]: row for row in run.history}
    assert sorted(steps) == [0, 1, 2]
    assert not any(k.startswith(("train/", "rollout/", "r3/")) for k in steps[0]), "step 0 is the eval baseline"
    for step, row in steps.items():  # eval before the first step and after every step (run.eval_every=1)
        missing = [k for k in EVAL_KEYS if k not in row]
        assert not missing, f"step {step} lacks {missing}"
        assert row["eval/step"] == step
        assert 0.0 <= row["eval/arithmetic/avg@2"] <= row["eval/arithmetic/pass@2"] <= 1.0
        assert 0.0 <= row["eval/arithmetic/truncated_share"] <= 1.0 and row["perf/eval_time_s"] > 0
    for step, row in steps.items():
        if step == 0:
            continue
        missing = [k for k in EVERY_STEP + [M.flip_rate_key(layer) for layer in range(4)] if k not in row]
        assert not missing, f"step {step} lacks {missing}"
        assert 0 < row[M.LOGPROB_ABS_DIFF_STDERR] < row[M.LOGPROB_ABS_DIFF]
        # two optimizer steps per rollout batch, each training forward on the rollout's routes
        assert row["train/optimizer_steps"] == 2 and row["train/replay_mismatch_rows"] == 0
        assert row["train/replayed_rows"] > 0
        # TIS drops nothing; its weights average near 1 with the replayed pi_old
        assert row[M.ROLLOUT_RS_MASKED_FRACTION] == 0 and 0.5 < row[M.ROLLOUT_IS_MEAN] <= 2.0
        assert 0 < row[M.ROLLOUT_IS_ESS] <= 1
        # the paired figure: same samples on both sides, so its mean is the difference of the two means
        assert row[M.LOGPROB_ABS_DIFF_PAIRED_DELTA] == pytest.approx(
            row[M.LOGPROB_ABS_DIFF] - row[M.LOGPROB_ABS_DIFF_NO_REPLAY], abs=1e-9)
        assert row[M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR] > 0 and M.ROUTING_FLIP_RATE_PROMPT in row
        assert "train/k3_kl" not in row  # verl's rollout_corr/k3_kl, once
        # DAPO: the step's batch was filled from at most 2 rounds of 4 groups; groups put back only once rounds ran
        # out; kept groups brought their routes along (the replay checks above are 0 on the regrouped batch)
        rounds, filtered, padded = row[M.GENERATION_ROUNDS], row[M.FILTERED_GROUPS], row[M.PADDED_GROUPS]
        assert rounds in (1, 2) and 0 <= padded <= filtered <= 4 * rounds and (padded == 0 or rounds == 2)
        assert rounds == 1 or filtered >= 1  # a second round only when the first left the batch short
        assert -1.0 <= row[M.OVERLONG_PENALTY_MEAN] <= 0.0
    assert {"r3:on", "replay:r3", "correction:tis"} <= set(run.tags) and run.group == "tiny_moe-cpu"
    assert not any(k.startswith("r2/") for row in run.history for k in row)


def test_every_key_the_runs_log_is_in_the_metric_reference(r3_run, r2_run):
    """Every key the R3 run (TIS, DAPO, two optimizer steps a batch, eval points) and the R2 run (IcePop with the
    sequence gate) logged has an entry in ``r3rl.metric_docs`` (the docs site's metric reference). Fails when the
    recipe or the trainer logs a new key without documenting it."""
    from r3rl.metric_docs import documented

    logged = {k for run_dir in (r3_run, r2_run) for run in wandb_runs(run_dir) for row in run.history for k in row
              if not k.startswith("_")}
    assert len(logged) > 60 and sorted(k for k in logged if documented(k) is None) == []


def test_r2_runs_without_engine_routes_and_replays_the_trainers_own(r2_run):
    (run,) = wandb_runs(r2_run)
    steps = {row["_step"]: row for row in run.history}
    assert sorted(steps) == [1, 2]
    for step, row in steps.items():
        missing = [k for k in [M.R2_REPLAY_MISMATCH_ROWS, M.R2_REPLAYED_ROWS, M.SEQ_ERROR_GATED_FRACTION,
                               M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY, M.EXTREME_TOKEN_FRACTION,
                               *M.ROLLOUT_CORR_KEYS] if k not in row]
        assert not missing, f"step {step} lacks {missing}"
        # every (token, layer) of both optimizer steps' forwards used the route recorded in the old-log-prob pass
        assert row[M.R2_REPLAY_MISMATCH_ROWS] == 0 and row[M.R2_REPLAYED_ROWS] > 0
        assert row["train/optimizer_steps"] == 2
        # no engine routes: nothing to measure a flip rate or an R3 replay against
        assert not any(k.startswith("r3/") for k in row)
        assert 0 <= row[M.ROLLOUT_RS_MASKED_FRACTION] < 1
        # the loss divides by the tokens the option (icepop, zero_weight: rejected tokens stay) and the gate kept
        # (fails if the recipe hands the trainer Sample.loss_mask instead of the correction's masks while the gate
        # drops a sequence, or if the trainer counts tokens otherwise)
        assert row["train/loss_tokens"] == row[M.CORRECTION_KEPT_TOKENS]
        assert M.LOGPROB_ABS_DIFF_PAIRED_DELTA not in row  # no paired pass under R2
    assert_nothing_left(r2_run)


def test_replay_lowers_the_mismatch_on_the_same_batches(r3_run):
    (run,) = wandb_runs(r3_run)
    rows = train_rows(run)
    with_replay = np.mean([row[M.LOGPROB_ABS_DIFF] for row in rows])
    without = np.mean([row[M.LOGPROB_ABS_DIFF_NO_REPLAY] for row in rows])
    assert with_replay < without, (with_replay, without)
    # every replayed (token, layer) was routed as the rollout's Sample says (checked from Megatron's side)
    assert all(row[M.REPLAY_MISMATCH_ROWS] == 0.0 for row in rows)
    # without replay the trainer's router disagrees somewhere (bf16 engine vs fp32 trainer)
    assert max(row[M.ROUTING_FLIP_RATE] for row in rows) > 0


def test_run_leaves_checkpoint_and_nothing_running(r3_run):
    meta = checkpoint.read_meta(checkpoint.latest(r3_run))
    assert meta.step == 2 and meta.wandb_run_id
    assert_nothing_left(r3_run)


def test_the_engine_token_is_in_its_0600_file_and_nowhere_else_in_the_run_folder(r3_run):
    """The run's engines demanded a token (``r3rl.rollout.auth``): fails if the token file is missing or readable by
    others, or if the token reached any other file the run wrote (config, logs, processes.json, the W&B run, the
    checkpoint), where it would outlive the run and travel with the folder."""
    token_file = r3_run / "engine_token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_bytes()
    assert len(token) >= 32
    leaked = [str(p) for p in r3_run.rglob("*") if p.is_file() and p != token_file and token in p.read_bytes()]
    assert not leaked, leaked


def test_a_second_run_of_a_finished_run_starts_nothing(r3_run):
    processes = (r3_run / "processes.json").read_text()
    segments = sorted(r3_run.glob("wandb/offline-run-*"))
    out = run_recipe(r3_run, "run.num_steps=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = " ".join(out.stdout.split())
    assert "already finished: step 2 of run.num_steps=2" in text and M.LOGPROB_ABS_DIFF in text
    assert "run.num_steps=N" in text
    # no Ray session, engine or trainer (their PIDs would be in a new process table), no new W&B segment
    assert (r3_run / "processes.json").read_text() == processes
    assert sorted(r3_run.glob("wandb/offline-run-*")) == segments


def test_sigterm_checkpoints_and_resume_continues_the_same_wandb_run(tmp_path, tiny_model_dir):
    """SIGTERM during step 2, once its rollout is generated: step 2 trains and is saved, its eval point is abandoned;
    the resumed job redoes that eval on step 2's weights and logs every step and eval point once. Fails if the
    eval did not watch for SIGTERM (step 2 would be logged whole and the checkpoint would hold no metrics), or if
    the resume skipped the interrupted eval (step 2 would lack its eval keys)."""
    run_dir = tmp_path / "preempted"
    # step 2's rollout file is written after step 1 was saved and its stop check passed, and before step 2 trains:
    # a signal sent once it exists lands inside step 2 (waiting for step 1's checkpoint alone let it land in the
    # instant between that save and the stop check, ending the run at step 1 with nothing interrupted)
    rollouts = tmp_path / "rollouts"
    proc = start_recipe(run_dir, "run.num_steps=3", "run.save_every=1", "run.eval_every=1",
                        f"debug.save_rollout={rollouts}")
    try:
        wait_for(lambda: (rollouts / "step_000002.npz").exists(), 900, "step 2's rollout", proc, poll=0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    meta = checkpoint.read_meta(checkpoint.latest(run_dir))
    stopped_at = meta.step
    assert stopped_at == 2
    assert meta.unlogged_metrics and M.LOGPROB_ABS_DIFF in meta.unlogged_metrics, "the stopped step's eval point " \
        "was abandoned and its metrics wait in the checkpoint"
    assert_nothing_left(run_dir)

    out = run_recipe(run_dir, "run.num_steps=3", "run.save_every=1", "run.eval_every=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in out.stdout
    assert f"redoing the eval of step {stopped_at} that SIGTERM interrupted" in out.stdout
    runs = wandb_runs(run_dir)
    assert len({r.run_id for r in runs}) == 1, "the resumed job must continue the same W&B run"
    steps = sorted(row["_step"] for r in runs for row in r.history)
    assert steps == [0, 1, 2, 3], "each step logged once, across the two jobs"
    rows = {row["_step"]: row for r in runs for row in r.history}
    assert all(k in rows[s] for s in steps for k in EVAL_KEYS), "an eval point at every step"
    assert all(M.LOGPROB_ABS_DIFF in rows[s] for s in (1, 2, 3))
    assert checkpoint.read_meta(checkpoint.latest(run_dir)).unlogged_metrics is None
    assert_nothing_left(run_dir)


def test_an_engine_that_cannot_start_ends_the_run_naming_it_and_leaves_nothing(tmp_path, tiny_model_dir):
    """The vLLM server starts in the background while the trainer ranks start; here it refuses an argument and exits.
    The run must end with exit 1, the engine's error with its log's reason, and nothing it started left running (the
    trainer rank, the engine's host, Ray). Fails if ``EngineGroup.wait_ready`` were dropped (the run would go on
    against no engine), or if the cleanup skipped engine hosts whose start failed."""
    run_dir = tmp_path / "engine_start"
    ray_temp = Path(tempfile.mkdtemp(prefix="r3rl-t-"))  # given, so every process of the run's Ray can be found
    try:
        out = run_recipe(run_dir, "run.num_steps=1", "run.eval_every=0", f"ray.temp_dir={ray_temp}",
                         "rollout.engine.extra_args=['--no-such-flag']")
        log = out.stdout + out.stderr
        assert out.returncode == 1, log[-3000:]
        assert "no-such-flag" in log and "engine logs:" in log, log[-3000:]
        assert not (run_dir / "processes.json").exists()  # written once the engines answer
        deadline = time.monotonic() + 30
        while (left := processes_with(str(ray_temp))) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of the run's Ray still running: {left}"
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


# in flight, generation outlasts the trainer's step as on GPUs: one sequence at a time and at least 200 tokens each,
# so step 2's batch (started with step 1's) is still generating when step 1's weights go to the engine
ENGINE_BOUND = ("rollout.engine.max_num_seqs=1", "rollout.sampling.min_tokens=200", "rollout.sampling.max_tokens=240")


@pytest.mark.parametrize("overlap", [("algorithm.max_staleness=0",),
                                     ("algorithm.max_staleness=1", "algorithm.weight_update=in_flight",
                                      *ENGINE_BOUND)],
                         ids=["in_turn", "in_flight"])
def test_dead_engine_ends_the_run_with_a_clear_error_and_a_checkpoint(tmp_path, tiny_model_dir, overlap):
    """The engine's process group is killed under the running recipe: exit 1, an error naming the engine, the last
    completed step's checkpoint, nothing left running. In flight (the engines take each step's weights under the
    batch they generate, /pause?mode=keep, and start the next batch beside it; max_staleness 1 between batches runs
    in test_async_recipe.py and the two-host test), the kill comes after three steps whose syncs went in flight,
    which trained with every replayed route matched and no sample older than the bound; step 3's batch was
    generating when step 2's weights landed, so its running sample spans two versions. Fails if the producer threads' failure
    were lost (the run would hang on its batch, or end as a success), if the in-flight sync reset the prefix cache
    (vLLM refuses it while requests hold blocks: the run would end at step 2) or paused otherwise than with
    mode=keep, if replay broke on samples whose tokens span two versions, or if the version a request was sent
    under capped its tokens' versions again (step 3's spanning share would read 0)."""
    run_dir = tmp_path / "dead_engine"
    in_flight = "algorithm.weight_update=in_flight" in overlap
    proc = start_recipe(run_dir, "run.num_steps=6", "run.save_every=1", "run.eval_every=0", *overlap,
                        "correction=tis", "rollout=vllm_r3")
    try:
        wait_for(lambda: (checkpoint.checkpoint_root(run_dir) / "latest").is_file() and
                 checkpoint.read_meta(checkpoint.latest(run_dir)).step >= (3 if in_flight else 1), 900,
                 "step checkpoint", proc)
        engine = json.loads((run_dir / "processes.json").read_text())["engines"][0]
        # a real fault: the vLLM server's whole process group is killed under the running recipe
        os.killpg(engine["pid"], signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (run_dir / "driver.log").read_text()
    assert code == 1, log[-3000:]
    assert engine["url"] in log and "error" in log.lower()
    assert checkpoint.read_meta(checkpoint.latest(run_dir)).step >= 1
    assert not pid_alive(engine["pid"])
    assert_nothing_left(run_dir)
    if in_flight:
        engine_log = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("engine*.log"))
        assert "/pause?mode=keep" in engine_log and "/reset_prefix_cache" not in engine_log.split("mode=keep", 1)[1]
        (run,) = wandb_runs(run_dir)
        rows = {row["_step"]: row for row in run.history if M.LOGPROB_ABS_DIFF in row}
        for step in (1, 2, 3):
            row = rows[step]
            assert row[M.REPLAY_MISMATCH_ROWS] == 0.0 and row[M.DROPPED_STALE] == 0, row
            assert row[M.STALENESS_MAX] == (0 if step == 1 else 1)
            assert row[M.PREEMPTIONS] == 0 and row[M.PREEMPTED_SPANNING_SAMPLES] == 0
        # step 3's batch is the only one generating when step 2's weights land under it (steps 1 and 2 start their
        # batches together, and which of the two the engine serves first is a race)
        assert rows[1][M.SPANNING_VERSIONS_SHARE] == 0 < rows[3][M.SPANNING_VERSIONS_SHARE]
        assert M.LOGPROB_ABS_DIFF_VERSION_TOKENS.format(which="current") in rows[3]
