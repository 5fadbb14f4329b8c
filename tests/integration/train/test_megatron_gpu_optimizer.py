"""The branches only a GPU run takes, on one GPU (world size 1, NCCL): Megatron's distributed optimizer with CPU
offload in a GRPO step and a checkpoint round trip, replay bitwise equal on the trainer's own routes, an HF export,
token-budget micro batches, and the TransformerEngine fallbacks when TE is missing. Skipped without CUDA; runs in
``pytest -m gpu`` on a machine with one GPU and no vLLM, TE or network."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_helpers import build_samples, random_routes, with_routes

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

# the GPU profile's trainer settings on the tiny model: bf16, alltoall, distributed optimizer fully offloaded
GPU_TRAINER = ["parallelism.device=cuda", "trainer.moe_token_dispatcher_type=alltoall", "trainer.params_dtype=bfloat16",
               "trainer.use_distributed_optimizer=true", "trainer.optimizer_cpu_offload=true",
               "trainer.optimizer_offload_fraction=1.0", "trainer.precision_aware_optimizer=true",
               "trainer.micro_batch_size=2"]


@pytest.fixture(scope="module")
def batch():
    samples = build_samples(8, 53)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=53))
    return samples, np.linspace(-1, 1, 8).astype(np.float32)


def make(*overrides: str):
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    return MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *GPU_TRAINER, *overrides]))


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable"])
def test_distributed_optimizer_with_cpu_offload_steps_and_resumes(batch, tmp_path, tiny_model_dir, sharding):
    """The GPU optimizer (hybrid CPU offload, precision-aware: the float32 masters live in its state) through both
    of Megatron's checkpoint formats r3rl writes, on one GPU: the step after a load equals the step straight on."""
    from r3rl.train import cpu_compat, te_fallback

    samples, adv = batch
    trainer = make(f"trainer.checkpoint.sharding={sharding}")
    try:
        assert not cpu_compat.is_active() and trainer.device.type == "cuda"
        parts = trainer.optimizer._parts()
        assert [type(p).__name__ for p in parts] == ["DistributedOptimizer"] * len(parts)
        hybrid = parts[0].optimizer
        assert type(hybrid).__name__ == "HybridDeviceOptimizer" and hybrid.gpu_optimizer is None
        speed = trainer.settings.transformer
        if not te_fallback.have_transformer_engine():
            assert not speed["moe_grouped_gemm"] and not speed["apply_rope_fusion"]
            assert speed["bias_activation_fusion"]  # Megatron's own kernel, kept without TE
        first = trainer.train_step(samples, adv, replay=True)
        assert np.isfinite(first["loss"]) and first["skipped_steps"] == 0 and first["grad_norm"] > 0
        # the Adam moments live in host memory, the parameters on the GPU
        moments = [v for opt in hybrid.cpu_optimizers for s in opt.state.values() for k, v in s.items()
                   if torch.is_tensor(v) and k != "step"]
        assert moments and all(v.device.type == "cpu" for v in moments)
        assert all(p.device.type == "cuda" for p in trainer.bare.parameters())
        trainer.save_checkpoint(tmp_path / "ckpt")
        second = trainer.train_step(samples, adv, replay=True)
        straight = trainer.logprobs(samples, replay=True).logprobs
        trainer.load_checkpoint(tmp_path / "ckpt")
        again = trainer.train_step(samples, adv, replay=True)
        resumed = trainer.logprobs(samples, replay=True).logprobs
        assert again["loss"] == second["loss"] and again["grad_norm"] == second["grad_norm"]
        assert all(np.array_equal(a, b) for a, b in zip(straight, resumed))
    finally:
        trainer.shutdown()


def test_replay_of_own_routes_is_bitwise_and_export_round_trips(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    # equal lengths: no padding rows, so both passes hand every expert exactly the same tokens
    samples = build_samples(8, 54, lengths=(7, 6))
    trainer = make("trainer.params_dtype=float32", "trainer.max_tokens_per_micro_batch=48")
    try:
        own = trainer.record_routes(samples)
        live = trainer.logprobs(samples, replay=False)
        replayed = trainer.logprobs([dataclasses.replace(s, routed_experts=r) for s, r in zip(samples, own)],
                                    replay=True)
        assert replayed.replayed_routes_match is True
        assert all(np.array_equal(a, b) for a, b in zip(live.logprobs, replayed.logprobs))
        out = trainer.export_hf(tmp_path / "hf")
    finally:
        trainer.shutdown()
    src, dst = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_colocated_offload_onload_leaves_the_cpu_optimizer_in_host_memory(batch, fraction, tiny_model_dir):
    """Issue 23 item 1 (colocated step 2): CPU-offloaded optimizer -> train step -> offload -> onload -> train step.
    Fails if onload moves the HybridDeviceOptimizer's CPU part (its fused AdamW state) to the GPU, as
    ``move_optimizer_state`` did when it walked the hybrid's aliased ``state``: the GPU then holds more than before
    offload, the host tensors are replaced, and the next step mixes devices. With ``fraction=0.5`` the GPU part's
    moments do leave the GPU on offload and come back whole on onload."""
    from r3rl import memory
    from r3rl.train import offload

    samples, adv = batch
    trainer = make(f"trainer.optimizer_offload_fraction={fraction}")
    try:
        first = trainer.train_step(samples, adv, replay=True)
        assert np.isfinite(first["loss"])
        hybrids = [p.optimizer for p in trainer.optimizer._parts()]
        assert all(offload.is_hybrid(h) for h in hybrids)
        host = {id(v): v for h in hybrids for o in h.cpu_optimizers for s in o.state.values() for v in s.values()
                if torch.is_tensor(v)}
        assert host and all(v.device.type == "cpu" for v in host.values())
        device_part = sum(v.numel() * v.element_size() for _, _, v in offload.offload_moves(trainer.optimizer))
        assert (device_part > 0) == (fraction < 1.0)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        out = trainer.offload_optimizer_state()
        assert out == device_part
        assert resident - torch.cuda.memory_allocated() >= out  # the GPU part's moments left the GPU
        back = trainer.onload_optimizer_state()
        assert back == out
        torch.cuda.synchronize()
        onloaded = torch.cuda.memory_allocated()
        assert onloaded <= resident + (1 << 20), f"onload grew the GPU by {(onloaded - resident) / 2**20:.1f} MiB"
        after = {id(v): v for h in hybrids for o in h.cpu_optimizers for s in o.state.values() for v in s.values()
                 if torch.is_tensor(v)}
        assert after.keys() == host.keys() and all(v.device.type == "cpu" for v in after.values())
        # what stays on the GPU between steps is what the plan counts (weights, gradients, the GPU part's state)
        plan = memory.estimate(trainer.cfg, "bfloat16", "bfloat16")
        static = sum(p.bytes for _, p in plan.gpus[0].parts if p.name in ("weights", "gradients", "master weights",
                                                                         "optimizer state"))
        assert onloaded <= 1.25 * static + (64 << 20), (onloaded, static)
        second = trainer.train_step(samples, adv, replay=True)
        assert np.isfinite(second["loss"]) and second["skipped_steps"] == 0
    finally:
        trainer.shutdown()
