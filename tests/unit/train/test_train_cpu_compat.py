"""The CPU stand-ins for Megatron (``r3rl.cpu_only.megatron``) behind the trainer's seam (``r3rl.train.hardware``):
on without a GPU; with CUDA available Megatron is untouched and no module of ``r3rl.cpu_only`` is even imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from r3rl.cpu_only import megatron as cpu_compat
from r3rl.train import hardware

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU side of the compat layer")

CUDA_PRESENT = textwrap.dedent("""
    import torch
    # Without a GPU (CI) CUDA cannot really be made available; only this report is faked (a no-op on a GPU host).
    torch.cuda.is_available = lambda: True
    original_device, original_stream = torch.cuda.current_device, torch.cuda.current_stream
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.fusions import fused_softmax
    before = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, fused_softmax.get_default_causal_mask,
              mrandom._CUDA_RNG_STATE_TRACKER)
    import os, sys
    os.environ.pop("R3RL_MRV2_TORCH_KERNELS", None)  # a GPU engine's environment (r3rl.plan)
    # what a GPU run of the trainer imports: its modules, the seam, the engine worker's extension
    from r3rl.train import distributed, forward, hardware, model, optim, trainer  # noqa: F401
    from r3rl.sync import worker_extension
    assert hardware.apply_if_needed() is False
    assert not hardware.cpu_active()
    assert torch.cuda.current_device is original_device and torch.cuda.current_stream is original_stream
    after = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, fused_softmax.get_default_causal_mask,
             mrandom._CUDA_RNG_STATE_TRACKER)
    assert all(a is b for a, b in zip(before, after)), "Megatron was patched although CUDA is available"
    assert hardware.transformer_overrides() == {}
    import contextlib
    assert isinstance(hardware.optimizer_scope(), contextlib.nullcontext)
    assert hardware.attention_mask(4, torch.device("cpu")) is None
    hardware.check_supported(2, 2, 2)  # GPU layouts are not refused
    assert hardware.seed_rng_tracker(0, 0, 0, 0) is False and hardware.cpu_optimizer([]) is None
    assert worker_extension._cpu_stand_ins() is None
    loaded = sorted(m for m in sys.modules if m.startswith("r3rl.cpu_only"))
    assert not loaded, f"CPU-only code imported with CUDA present: {loaded}"
    print("COMPAT-OFF-OK")
""")


def test_compat_stays_off_when_cuda_is_available():
    """Fails if a GPU run would patch Megatron, get a CPU setting from the seam, or import any module of
    ``r3rl.cpu_only`` (an import at module level in the trainer or the worker extension, or a seam that imports the
    room before it checks for CUDA)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", CUDA_PRESENT], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "COMPAT-OFF-OK" in out.stdout


@cpu_only
def test_compat_applies_without_a_gpu():
    assert hardware.apply_if_needed() is True and hardware.cpu_active()
    from megatron.core.tensor_parallel import random as mrandom

    assert torch.cuda.current_device() == torch.device("cpu")
    assert isinstance(torch.cuda.current_stream(), cpu_compat.CpuStream)
    assert isinstance(mrandom.get_cuda_rng_tracker(), cpu_compat.CpuRNGStatesTracker)
    mask = cpu_compat.attention_mask(3, torch.device("cpu"))
    assert mask.shape == (1, 1, 3, 3) and mask[0, 0].tolist() == [[False, True, True], [False, False, True],
                                                                  [False, False, False]]
    overrides = cpu_compat.transformer_overrides()
    assert overrides["moe_token_dispatcher_type"] == "allgather" and overrides["use_cpu_initialization"]
    with pytest.raises(RuntimeError, match="pipeline_parallel"):
        cpu_compat.check_supported(1, 2, 1)


def test_cpu_rng_tracker_forks_like_the_cuda_one():
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("a", 11)
    torch.manual_seed(0)
    outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), outside)  # the default stream is untouched by the fork
    with tracker.fork("a"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the named stream advanced
    saved = tracker.get_states()
    with tracker.fork("a"):
        third = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), third)  # restoring states replays the stream (activation recompute)
    with pytest.raises(RuntimeError):
        tracker.add("b", 11)


@cpu_only
def test_megatron_optimizer_scope_puts_cuda_allocations_on_the_cpu():
    cpu_compat.apply_if_needed()
    param = torch.zeros(3)
    with cpu_compat.megatron_optimizer_scope():
        made = torch.tensor([0], dtype=torch.int, device="cuda")
        moved = param.cuda()
        name = param.type()
    assert made.device.type == "cpu" and moved is param
    # Megatron's optimizers compare param.type() with the CUDA type names
    assert name == "torch.cuda.FloatTensor" and param.type() == "torch.FloatTensor"


MISSING_KERNELS = textwrap.dedent("""
    from r3rl.train import distributed
    distributed.init(distributed.Layout(1, 1, 1, 1), seed=1)
    # what a trainer rank imports later: the optimizer stack and the layer specs
    import megatron.core.optimizer, megatron.core.optimizer.clip_grads  # noqa: E401
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401
    distributed.release()
""")


@cpu_only
def test_missing_transformer_engine_and_apex_is_said_once():
    # every warning shown, as a Ray actor shows them
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    out = subprocess.run([sys.executable, "-c", MISSING_KERNELS], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Apex is not installed" not in out.stderr and "Apex are not installed" not in out.stderr, out.stderr
    assert out.stderr.count("no Transformer Engine or Apex (expected without a GPU)") == 1
