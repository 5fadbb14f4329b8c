"""``kill -9`` of a trainer in the middle of a run checkpoint's save leaves a checkpoint that resumes (issue 59 item 1):
``latest`` names a complete folder whose weights are those saved under its step, whatever point the kill hit."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl import checkpoint

WORKER = Path(__file__).with_name("checkpoint_kill_worker.py")


def start(run_dir: Path, records: Path, point: str, log: Path) -> subprocess.Popen:
    records.mkdir(parents=True, exist_ok=True)
    # its own process group: Megatron's checkpoint writer starts a Manager process that the kill must take too
    return subprocess.Popen([sys.executable, str(WORKER), str(run_dir), str(records), point],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture
def resume_check(new_trainer):
    """resume_check(run_dir, records) -> the step ``latest`` names, after loading it into a fresh trainer and
    comparing its log-probs with those the worker recorded for that step."""
    samples = build_samples(4, 45)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=45))
    trainer = new_trainer("algorithm.global_batch_size=4")

    def check(run_dir: Path, records: Path) -> int:
        folder = checkpoint.latest(run_dir)
        step = checkpoint.read_meta(folder).step
        trainer.load_checkpoint(folder / checkpoint.TRAINER_DIR)
        saved = pickle.loads((records / f"step_{step}.pkl").read_bytes())["logprobs"]
        got = trainer.logprobs(samples, replay=True).logprobs
        assert max(float(np.abs(a - b).max()) for a, b in zip(got, saved)) <= 1e-6, step
        return step

    return check


@pytest.mark.parametrize("point, resumes", [("trainer_state", 1), ("pointer", 1), ("resave", 2)])
def test_kill_9_at_each_point_of_a_save_leaves_a_checkpoint_that_resumes(tmp_path, resume_check, point, resumes):
    """The trainer killed (SIGKILL, by itself at an exact point of the save): with its shards written and the
    trainer folder not yet named; with the step folder published and ``latest`` not yet moved; while step 2 is saved
    a second time, its old folder renamed aside and the new one not yet in place. Each time ``latest`` resolves to
    a complete checkpoint that loads and holds the weights saved at its step. Fails if ``publish`` removes the old
    folder before the new one takes the name (``resave``: the only copy of step 2 is gone) or ``latest`` does not
    fall back to the folder aside, or if a folder is named before its trainer state is complete."""
    proc = start(tmp_path / "run", tmp_path / "records", point, tmp_path / "worker.log")
    try:
        proc.wait(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "worker.log").read_text()[-3000:]
    assert resume_check(tmp_path / "run", tmp_path / "records") == resumes


def test_kill_9_from_outside_while_saving_leaves_a_checkpoint_that_resumes(tmp_path, resume_check):
    """The same, killed from outside (``killpg`` SIGKILL) at whatever point a run of back-to-back saves has reached
    0.3 s after its second save. Fails if any point of a save leaves ``latest`` naming a folder that is missing,
    incomplete or holds another step's weights."""
    log = tmp_path / "worker.log"
    proc = start(tmp_path / "run", tmp_path / "records", "loop", log)
    try:
        deadline = time.monotonic() + 300
        while "saved 2" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.3)
    finally:
        kill_group(proc)
    assert resume_check(tmp_path / "run", tmp_path / "records") >= 2
