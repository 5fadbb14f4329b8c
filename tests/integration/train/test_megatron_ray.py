"""The trainer in Ray actors: expert parallel 2 over two actors (gloo on 127.0.0.1), as the recipe deploys it."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

from megatron_helpers import build_samples, random_routes, with_routes

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    temp = tempfile.mkdtemp(prefix="r3rl-ray-")  # Ray's socket paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, _node_ip_address="127.0.0.1",
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}})
    try:
        yield ray
    finally:
        # ends the actors and every Ray process this driver started (never `ray stop`, which kills by name)
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@ray.remote(num_cpus=0.5)
class Rank:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def rendezvous(self) -> int:
        """Rank 0 listens before the others are told the port, as the recipe's TrainerActor does."""
        from r3rl.train import distributed

        return distributed.open_rendezvous("127.0.0.1", self.world_size)

    def setup(self, port: int) -> None:
        from r3rl.train import distributed

        os.environ.update(distributed.rendezvous_env(self.rank, self.world_size, "127.0.0.1", port))
        from r3rl.config import compose
        from r3rl.train.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(compose([
            "model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", "parallelism.gpus_per_node=3",
            "parallelism.trainer.num_gpus=2",
            "parallelism.trainer.expert_parallel=2", "trainer.micro_batch_size=2"]))

    def step(self, samples, advantages):
        replayed = self.trainer.logprobs(samples, replay=True)
        metrics = self.trainer.train_step(samples, advantages, replay=True, old_logprobs=replayed.logprobs)
        return {"logprobs": replayed.logprobs, "match": replayed.replayed_routes_match, "metrics": metrics,
                "pid": os.getpid(), "dp_size": self.trainer.info.dp_size}

    def shutdown(self):
        self.trainer.shutdown()


def test_expert_parallel_trainer_in_two_ray_actors(local_ray, tiny_model_dir):
    samples = build_samples(8, 41)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=41))
    adv = np.linspace(-1, 1, 8).astype(np.float32)
    ranks = [Rank.remote(r, 2) for r in range(2)]
    port = ray.get(ranks[0].rendezvous.remote(), timeout=120)
    ray.get([r.setup.remote(port) for r in ranks], timeout=300)
    out = ray.get([r.step.remote(samples, adv) for r in ranks], timeout=300)
    ray.get([r.shutdown.remote() for r in ranks], timeout=60)
    assert out[0]["pid"] != out[1]["pid"] and all(o["dp_size"] == 2 for o in out)
    assert all(o["match"] is True for o in out)
    # every rank returns the complete, identical result
    assert all(np.array_equal(a, b) for a, b in zip(out[0]["logprobs"], out[1]["logprobs"]))
    assert out[0]["metrics"] == out[1]["metrics"]
    assert np.isfinite(out[0]["metrics"]["loss"]) and out[0]["metrics"]["grad_norm"] > 0
