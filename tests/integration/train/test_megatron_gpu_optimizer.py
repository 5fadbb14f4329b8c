"""The branches only a GPU run takes, on one GPU (world size 1, NCCL): Megatron's distributed optimizer with CPU
offload in a GRPO step and a checkpoint round trip, replay bitwise equal on the trainer's own routes, an HF export,
token-budget micro batches, the TransformerEngine fallbacks when TE is missing, and issue 45's device checks (a
fresh trainer's resume in both formats, an async save under CUDA, packed vs padded rows with replay, no host sync
per router call). Skipped without CUDA; runs in ``pytest -m gpu`` on a machine with one GPU and no vLLM, TE or
network (scripts/gpu_check.sh)."""

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
    from r3rl.train import hardware, te_fallback

    samples, adv = batch
    trainer = make(f"trainer.checkpoint.sharding={sharding}")
    try:
        assert not hardware.cpu_active() and trainer.device.type == "cuda"
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


class PeakRss:
    """This process's resident set, sampled every 5 ms while the block runs: the peak above where it started."""

    def __enter__(self):
        import threading

        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self.start = self.peak = self._proc.memory_info().rss

        def sample():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, self._proc.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def grew(self) -> int:
        return self.peak - self.start


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable"])
def test_a_fresh_trainer_resumes_the_offloaded_optimizer_in_both_formats(batch, tmp_path, tiny_model_dir, sharding):
    """Issue 45, device check 1: a checkpoint loaded into a new trainer, whose hybrid CPU-offloaded optimizer has
    never stepped (Megatron then runs its dummy step and rebuilds the sub-optimizers at load), continues exactly:
    the next step's loss and grad norm equal the saving trainer's. Prints the load's GPU peak and host RSS growth
    next to ``r3rl.memory.checkpoint_load_host_bytes`` for the format. Fails if the load leaves the dummy step's
    random moments or a stale master copy in the optimizer (the step after it would differ)."""
    from r3rl import memory

    samples, adv = batch
    saver = make(f"trainer.checkpoint.sharding={sharding}")
    try:
        saver.train_step(samples, adv, replay=True)
        folder = saver.save_checkpoint(tmp_path / "ckpt")
        straight = saver.train_step(samples, adv, replay=True)
    finally:
        saver.shutdown()
    fresh = make(f"trainer.checkpoint.sharding={sharding}")
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with PeakRss() as rss:
            fresh.load_checkpoint(folder)
        gpu_peak = torch.cuda.max_memory_allocated() - before
        again = fresh.train_step(samples, adv, replay=True)
        planned = memory.checkpoint_load_host_bytes(fresh.cfg, "bfloat16", sharding)
        print(f"gpu_check: resume {sharding} into a fresh trainer: GPU peak +{gpu_peak / 2**20:.1f} MiB, host RSS "
              f"+{rss.grew / 2**20:.1f} MiB (plan's load {planned / 2**20:.1f} MiB; the tiny model's bytes are small "
              "next to the CUDA and checkpoint libraries' own); loss "
              f"{again['loss']:.6f} vs {straight['loss']:.6f}, grad norm {again['grad_norm']:.6f} vs "
              f"{straight['grad_norm']:.6f}")
        assert again["loss"] == straight["loss"] and again["grad_norm"] == straight["grad_norm"]
    finally:
        fresh.shutdown()


def test_an_async_save_under_cuda_holds_its_step_and_resumes(batch, tmp_path, tiny_model_dir):
    """Issue 45, device check 3: ``trainer.checkpoint.async_save`` on CUDA (the writer's staging copies from the GPU,
    Megatron's forked writer): save, train a step meanwhile, finish, load into a fresh trainer: its log-probs equal
    the saving trainer's at the save, bit for bit. Fails if the staging reads the GPU tensors after the next step
    changed them (a copy not awaited on its stream), or the folder is named before the writer finished."""
    samples, adv = batch
    trainer = make("trainer.checkpoint.async_save=true")
    try:
        trainer.train_step(samples, adv, replay=True)
        at_save = trainer.logprobs(samples, replay=True).logprobs
        folder = trainer.save_checkpoint(tmp_path / "ckpt")
        trainer.train_step(samples, adv, replay=True)  # while the writer runs
        moved = max(np.abs(a - b).max() for a, b in zip(trainer.logprobs(samples, replay=True).logprobs, at_save))
        trainer.finish_saves()
        assert moved > 0 and trainer.poll_saves() and (folder / "COMPLETE").is_file()
    finally:
        trainer.shutdown()
    fresh = make()
    try:
        fresh.load_checkpoint(folder)
        resumed = fresh.logprobs(samples, replay=True).logprobs
        assert all(np.array_equal(a, b) for a, b in zip(resumed, at_save))
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_rows_give_the_padded_log_probs_on_cuda_with_replay(tiny_model_dir, dtype):
    """Issue 45, device check 4: the same samples (lengths vary) packed into THD rows and right-padded, through
    the local spec's fused attention on CUDA with replay: 0 replay mismatch rows either way, and the log-probs agree
    (float32: to 1e-4; bfloat16: printed, bounded by 0.1, where a misplaced route or segment boundary moves them by
    whole nats). Fails if the CUDA path packs routes or segments other than the CPU-tested layout does."""
    samples = build_samples(16, 57)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=57))
    trainer = make(f"trainer.params_dtype={dtype}", "trainer.max_tokens_per_micro_batch=96")
    try:
        out = {}
        for packing in (True, False):
            trainer.packing = packing
            out[packing] = trainer.logprobs(samples, replay=True)
            assert out[packing].replay_mismatch_rows == 0 and out[packing].replayed_routes_match is True
        diff = max(np.abs(a - b).max() for a, b in zip(out[True].logprobs, out[False].logprobs))
        print(f"gpu_check: packed vs padded on CUDA, {dtype}, replayed: max |dlogp| {diff:.3g}, replay mismatch rows "
              f"{out[True].replay_mismatch_rows} / {out[False].replay_mismatch_rows}")
        assert diff < (1e-4 if dtype == "float32" else 0.1)
    finally:
        trainer.shutdown()


def test_the_route_probe_never_syncs_with_the_host_per_router_call(batch, tiny_model_dir, monkeypatch):
    """Issue 45, device check 5: every router call of a replayed and an unreplayed pass runs the probe's hook under
    ``torch.cuda.set_sync_debug_mode("error")`` (after the micro batch's routes were copied to the device, which
    happens once per micro batch): any host sync raises. Fails if the hook indexes with a boolean mask, runs
    CUDA's bincount, or reads a count back."""
    from r3rl.train.replay import RouteProbe

    hook, calls = RouteProbe._hook, []

    def strict(self, router, args, output):
        if self._expected is not None:
            self._expected.on(args[0].device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            hook(self, router, args, output)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(router.layer_number)

    monkeypatch.setattr(RouteProbe, "_hook", strict)
    samples, _ = batch
    trainer = make()
    try:
        replayed = trainer.logprobs(samples, replay=True)
        live = trainer.logprobs(samples, replay=False)
    finally:
        trainer.shutdown()
    print(f"gpu_check: route probe: {len(calls)} router calls under set_sync_debug_mode('error'), 0 host syncs")
    assert calls and replayed.replay_mismatch_rows == 0 and np.isfinite(live.flip_per_layer).all()
