"""Shared helpers: per-step metric dicts as the recipe makes them, and a check for leftover W&B processes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from r3rl.metrics import step_metrics
from r3rl.train.correction import Correction, correct


def _make_step_metrics(step: int, *, r3: bool, layers: int = 4, samples: int = 8, seed: int = 0) -> dict[str, float]:
    """One step's metrics from synthetic log-probs, routes and timings (R3 on: smaller replayed mismatch)."""
    rng = np.random.default_rng([seed, step])
    lengths = rng.integers(4, 12, size=samples)
    rollout = [rng.normal(-1.0, 0.5, n) for n in lengths]
    no_replay = [r + rng.normal(0, 0.04, r.shape) for r in rollout]
    replay = [r + rng.normal(0, 0.01, r.shape) for r in rollout]
    masks = [np.ones(n) for n in lengths]
    trainer = replay if r3 else no_replay
    return {**correct(Correction(), trainer, rollout, masks).metrics, **step_metrics(
        rollout_logprobs=rollout, trainer_logprobs=replay if r3 else no_replay, loss_masks=masks,
        trainer_logprobs_no_replay=no_replay if r3 else None,
        rewards=rng.integers(0, 2, size=samples).astype(float), response_lengths=lengths,
        prompt_lengths=[20] * samples, sample_groups=[i // 2 for i in range(samples)],  # 2 samples per prompt
        routing_flip_per_layer=np.linspace(0.01, 0.03, layers) + 0.001 * step if r3 else None,
        replay_mismatch_rows=0 if r3 else None,
        loss=float(rng.normal()), grad_norm=float(rng.uniform(0.5, 2.0)),
        timings_s={"rollout": 2.0 + step * 0.1, "logprobs": 0.5, "train": 1.0, "weight_sync": 0.25},
    )}


def _wandb_processes() -> list[int]:
    """PIDs of wandb-core processes started by this test process."""
    me = os.getpid()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        if ppid == me and comm.startswith("wandb"):
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def no_wandb_env(monkeypatch):
    """Keep the developer's W&B settings out: the tests pick every mode and folder themselves."""
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_RUN_ID",
                "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def make_step_metrics():
    """make_step_metrics(step, r3=...) -> one step's metric dict."""
    return _make_step_metrics


@pytest.fixture(scope="session")
def wandb_processes():
    """wandb_processes() -> PIDs of wandb-core processes this test process started."""
    return _wandb_processes
