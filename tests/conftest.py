"""Fixtures shared by every test: configs composed like run.py, and the locally generated tiny MoE."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Generated assets (tiny model, prompts) are cached once per checkout and shared by tests and runs.
os.environ.setdefault("R3RL_DATA_DIR", str(REPO / "data"))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> R3RLConfig checked as run.py checks it: schema, rules and preflight (parallelism
    defaults to cpu unless named)."""
    from r3rl.preflight import compose

    def _compose(*overrides: str):
        return compose(list(overrides))

    return _compose


@pytest.fixture(scope="session")
def tiny_cfg():
    from r3rl.preflight import compose

    return compose(["model=tiny_moe", "parallelism=cpu"])


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cfg) -> Path:
    """The tiny Qwen3-MoE checkpoint (4 layers, 8 experts, top-2, float32), generated on first use."""
    from r3rl.models.tiny_moe import ensure_checkpoint

    return ensure_checkpoint(tiny_cfg.model)
