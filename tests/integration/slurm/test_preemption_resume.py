"""A job of the tiny recipe stopped mid-run leaves a checkpoint, and the same job submitted again resumes from it.

The recipe's contract (recipes/grpo.py): checkpoints in `run.output_dir/checkpoints/step_{step:06d}/` with a
`meta.json` holding `{"step": N}`, the newest one's folder name in `checkpoints/latest`, a checkpoint on SIGTERM
before exiting, and with `run.resume=true` a start from `latest` that prints `resumed from step N`.
"""

from __future__ import annotations

import json
import time

import pytest

from slurm_testbed import REPO

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / "recipes" / "grpo.py").exists(),
                       reason="recipes/grpo.py (the end-to-end GRPO recipe) is not in this checkout yet"),
]

# vLLM on a CPU takes about a minute to serve; a step of the tiny recipe some seconds more
RUN_TIMEOUT = 600


def _wait_for(predicate, what: str, launch, job: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        state = launch.slurm.job(job).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} ended ({state}) before {what}:\n{launch.output(job)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s:\n{launch.output(job)[-4000:]}")
        time.sleep(1)


def test_preempted_job_leaves_a_checkpoint_that_the_next_job_resumes_from(slurm, launch):
    out = launch.root / "run"
    # the random model (no SFT warm start), partial credit so the steps train, small steps (4 prompts x 4): this
    # test is about preemption
    overrides = ("parallelism=cpu", "warm_start.enabled=false", "data.partial_credit=0.1", f"run.output_dir={out}",
                 "algorithm.rollout_batch_size=4", "algorithm.n_samples_per_prompt=4", "algorithm.global_batch_size=16",
                 "run.num_steps=1000", "run.save_every=1", "run.eval_every=0", "run.resume=true",
                 "logger.wandb.mode=offline",
                 f"rollout.engine.base_port={launch.env['R3RL_TEST_ENGINE_PORT']}")
    latest = out / "checkpoints" / "latest"

    first = launch.submit("--gres=gpu:2", overrides=overrides)
    _wait_for(latest.exists, "first checkpoint", launch, first, RUN_TIMEOUT)
    # Slurm's warning before the time limit or a preemption (#SBATCH --signal=B:TERM@120): SIGTERM to the batch
    # shell, which the launcher forwards to the driver while Ray stays up.
    slurm.run("scancel", "--batch", "--signal=TERM", first)
    info = slurm.wait_job(first, 300)
    # stopped by a signal: the job says so whatever the driver's own exit code was
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "143:0"), launch.output(first)[-4000:]
    assert "received SIGTERM: forwarding SIGTERM to the driver" in launch.launcher_log(first)
    launch.assert_nothing_left(first)

    ckpt = out / "checkpoints" / latest.read_text().strip()
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    assert step >= 1
    assert ckpt.name == f"step_{step:06d}"

    second = launch.submit("--gres=gpu:2", overrides=overrides)
    driver_log = launch.log_dir(second) / "driver.log"
    _wait_for(lambda: driver_log.exists() and "resumed from step" in driver_log.read_text(),
              "'resumed from step' line", launch, second, RUN_TIMEOUT)
    assert f"resumed from step {step}" in driver_log.read_text()
    # a plain scancel signals every process of the job at once (Ray, engines, driver): nothing may survive it
    slurm.run("scancel", second)
    assert slurm.wait_job(second, 300)["JobState"] == "CANCELLED"
    launch.assert_nothing_left(second)
