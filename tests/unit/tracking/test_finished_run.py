"""A second `make run` of a finished run: recognised before anything starts, its summary printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from r3rl import checkpoint
from r3rl import metrics as M
from r3rl.config import CONF_DIR, compose
from r3rl.plan import wandb_naming
from r3rl.tracking import WandbLogger
from r3rl.tracking.finished import finished_step

REPO = CONF_DIR.parent
STEPS = 3


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, make_step_metrics):
    """A run folder as the recipe leaves it after STEPS steps: a real W&B offline run and a checkpoint per step."""
    run_dir = tmp_path_factory.mktemp("finished")
    cfg = compose(["parallelism=cpu", f"run.output_dir={run_dir}", f"run.num_steps={STEPS}"])
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_DIR", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME"):
            mp.delenv(var, raising=False)
        logger = WandbLogger({}, wandb_naming(cfg), run_dir)
        for step in range(1, STEPS + 1):
            logger.log(make_step_metrics(step, r3=True), step=step)
            checkpoint.save(run_dir, checkpoint.CheckpointMeta(step=step, wandb_run_id=logger.run_id),
                            complete_trainer_state)
        logger.finish()
    return run_dir


def complete_trainer_state(folder):
    (folder / checkpoint.TRAINER_DIR).mkdir()
    marker = folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE
    marker.write_text(json.dumps({"format": checkpoint.TRAINER_FORMAT}))


def snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_finished_step_only_at_num_steps_and_with_resume(finished_run):
    def at(*overrides):
        return finished_step(compose(["parallelism=cpu", f"run.output_dir={finished_run}", *overrides]))

    assert at(f"run.num_steps={STEPS}") == STEPS
    assert at(f"run.num_steps={STEPS - 1}") == STEPS
    assert at(f"run.num_steps={STEPS + 1}") is None
    assert at(f"run.num_steps={STEPS}", "run.resume=false") is None


def test_second_run_prints_the_summary_and_starts_nothing(finished_run):
    before = snapshot(finished_run)
    # a timeout, not a timing assertion: starting Ray, Megatron or vLLM here would be the bug
    out = subprocess.run([sys.executable, "run.py", "parallelism=cpu", f"run.output_dir={finished_run}",
                          f"run.num_steps={STEPS}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert f"already finished: step {STEPS} of run.num_steps={STEPS}" in text
    assert M.LOGPROB_ABS_DIFF in text and f"({STEPS} steps)" in text, out.stdout
    assert f"run folder: {finished_run}" in text and "W&B files:" in text
    assert "run.num_steps=N for any N > 3" in text and "start over" in text
    # nothing written: no Hydra files, no new W&B segment, no process table
    assert snapshot(finished_run) == before
