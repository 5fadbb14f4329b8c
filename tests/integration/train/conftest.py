"""Real Megatron-core trainers on the tiny Qwen3-MoE, samples with real routes, and the HF model to compare with."""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path

import pytest

from megatron_helpers import HFReference

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # Megatron 0.16 repeats deprecation notices on every layer it builds; keep this folder's reports readable
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning:megatron.*"))


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir, tiny_cfg) -> HFReference:
    return HFReference(tiny_model_dir, tiny_cfg.model.moe_topk)


@pytest.fixture(scope="session")
def policy(tiny_model_dir):
    """One trainer for the tests that never step the optimizer; micro batches of 4 so they carry padding."""
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    trainer = MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", "trainer.micro_batch_size=4"]))
    yield trainer
    trainer.shutdown()


@pytest.fixture
def new_trainer(tiny_model_dir):
    """new_trainer(*overrides) -> a fresh MegatronTrainer on the tiny model, shut down after the test."""
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    made = []

    def make(*overrides: str):
        trainer = MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *overrides]))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.shutdown()


@pytest.fixture
def torchrun_rendezvous():
    """rendezvous(world_size) -> the environment for ranks started as processes, as torchrun's agent gives it: the
    store listens on a port the OS picked before any rank starts, and every rank connects to it as a client (a port
    found free and bound by rank 0 seconds later is lost, now and then, to another process in between)."""
    import torch.distributed

    stores = []

    def rendezvous(world_size: int) -> dict[str, str]:
        store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                           timeout=datetime.timedelta(minutes=10))
        stores.append(store)
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    yield rendezvous
    stores.clear()  # the stores stop listening once the ranks are done with them
