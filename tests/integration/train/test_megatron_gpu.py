"""GPU-only paths: NCCL, TransformerEngine layers, the alltoall dispatcher, context/sequence/pipeline parallel
route packing, Megatron's distributed optimizer. Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_helpers import build_samples, random_routes, with_routes

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

WORKER = Path(__file__).with_name("megatron_ep_worker.py")


def gpu_overrides(world: int, *extra: str) -> list[str]:
    return ["parallelism.device=cuda", f"parallelism.gpus_per_node={world + 1}",
            f"parallelism.trainer.num_gpus={world}", "trainer.moe_token_dispatcher_type=alltoall",
            "trainer.params_dtype=float32", "trainer.micro_batch_size=2", *extra]


def run_ranks(world: int, overrides: list[str], samples, adv, tmp: Path, rendezvous: dict[str, str]) -> dict:
    src, dst = tmp / "in.pkl", tmp / "out.pkl"
    src.write_bytes(pickle.dumps((samples, adv)))
    procs = []
    try:
        for rank in range(world):
            env = {**os.environ, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(src), str(dst), *overrides], env=env,
                                          start_new_session=True))
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all(p.returncode == 0 for p in procs)
    return pickle.loads(dst.read_bytes())


@pytest.fixture(scope="module")
def batch():
    samples = build_samples(8, 51)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=51))
    return samples, np.linspace(-1, 1, 8).astype(np.float32)


@pytest.fixture(scope="module")
def one_gpu(batch, tmp_path_factory, tiny_model_dir):
    # a lone rank needs no rendezvous (an in-process store)
    return run_ranks(1, gpu_overrides(1), *batch, tmp_path_factory.mktemp("one"), rendezvous={})


def test_single_gpu_uses_megatron_unpatched(one_gpu, batch):
    from r3rl.train import hardware

    assert hardware.apply_if_needed() is False and not hardware.cpu_active()
    assert one_gpu["match"] is True and np.isfinite(one_gpu["metrics"]["loss"])


def needs(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


@needs(2)
@pytest.mark.parametrize("layout", [
    ["parallelism.trainer.context_parallel=2"],
    ["parallelism.trainer.tensor_parallel=2", "parallelism.trainer.sequence_parallel=true"],
    ["parallelism.trainer.pipeline_parallel=2"],
    ["parallelism.trainer.expert_parallel=2", "trainer.use_distributed_optimizer=true"],
], ids=["cp2", "tp2-sp", "pp2", "ep2-distopt"])
def test_two_gpu_layouts_match_one_gpu(layout, batch, one_gpu, tmp_path, torchrun_rendezvous):
    """Routes packed through CP zigzag / SP shards / PP-local layers reach the right tokens: the routing maps equal
    the replay targets and log-probs, loss and the updated policy match one GPU."""
    got = run_ranks(2, gpu_overrides(2, *layout), *batch, tmp_path, torchrun_rendezvous(2))
    assert got["match"] is True
    for key in ("replayed", "live", "after"):
        assert max(np.abs(a - b).max() for a, b in zip(got[key], one_gpu[key])) < 1e-4, key
    assert abs(got["metrics"]["loss"] - one_gpu["metrics"]["loss"]) < 1e-5
    assert np.allclose(got["flips"], one_gpu["flips"], atol=0.02)


def test_transformer_engine_names_convert_exactly(tiny_model_dir, tmp_path):
    pytest.importorskip("transformer_engine")
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    trainer = MegatronTrainer(compose(["model=tiny_moe"] + gpu_overrides(1)))
    try:
        names = [n for n, _ in trainer.bare.named_parameters()]
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
        out = trainer.export_hf(tmp_path / "hf")
    finally:
        trainer.shutdown()
    from safetensors.torch import load_file

    src = load_file(str(tiny_model_dir / "model.safetensors"))
    dst = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


def test_optimizer_state_leaves_the_gpu_while_engines_generate(batch, tiny_model_dir):
    """Colocated handoff, trainer side: Adam's moments move to host memory and back, and training goes on."""
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    samples, adv = batch
    trainer = MegatronTrainer(compose(["model=tiny_moe", "algorithm.global_batch_size=8"] + gpu_overrides(1)))
    try:
        trainer.train_step(samples, adv, replay=True)  # Adam's state exists from the first step on
        held = torch.cuda.memory_allocated()
        moved = trainer.offload_optimizer_state()
        assert moved > 0 and torch.cuda.memory_allocated() <= held - moved
        assert trainer.onload_optimizer_state() == moved
        assert torch.cuda.memory_allocated() == held
        assert np.isfinite(trainer.train_step(samples, adv, replay=True)["loss"])
    finally:
        trainer.shutdown()
