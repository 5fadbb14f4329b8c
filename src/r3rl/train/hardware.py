"""Where the trainer meets its device: Megatron as shipped where CUDA is available, and without CUDA the stand-ins
of ``r3rl.cpu_only.megatron``, imported only then (so a GPU run never loads them). Each function here is what a GPU
run does (nothing, or Megatron's own) unless the CPU stand-ins are active."""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch

_cpu: ModuleType | None = None  # r3rl.cpu_only.megatron, once active


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_if_needed() -> bool:
    """Without CUDA, patch Megatron for the CPU (``r3rl.cpu_only.megatron``); return whether the stand-ins are
    active. Idempotent; with CUDA nothing is imported or touched."""
    global _cpu
    if _cpu is None and not cuda_available():
        from r3rl.cpu_only import megatron

        if megatron.apply_if_needed():
            _cpu = megatron
    return _cpu is not None


def cpu_active() -> bool:
    return _cpu is not None


def transformer_overrides() -> dict[str, Any]:
    """TransformerConfig settings the CPU needs on top of the plan's; none on a GPU."""
    return _cpu.transformer_overrides() if _cpu else {}


def attention_mask(seq_len: int, device: torch.device) -> torch.Tensor | None:
    """The CPU's explicit causal mask; None lets the GPU kernels build theirs."""
    return _cpu.attention_mask(seq_len, device) if _cpu else None


def check_supported(tensor_parallel: int, pipeline_parallel: int, context_parallel: int) -> None:
    """Refuse the layouts Megatron cannot run on a CPU; every layout passes on a GPU."""
    if _cpu:
        _cpu.check_supported(tensor_parallel, pipeline_parallel, context_parallel)


def seed_rng_tracker(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> bool:
    """Seed the CPU's RNG tracker; False on a GPU, where Megatron's ``model_parallel_cuda_manual_seed`` does."""
    if _cpu:
        _cpu.seed_rng_tracker(seed, tp_rank, ep_rank, etp_rank)
    return _cpu is not None


def optimizer_scope() -> contextlib.AbstractContextManager:
    """Where Megatron's optimizer runs: on a CPU its CUDA allocations land on the CPU; on a GPU, nothing."""
    return _cpu.megatron_optimizer_scope() if _cpu else contextlib.nullcontext()


def cpu_optimizer(params, **settings):
    """The CPU's one-rank optimizer (an AdamW over ``main_grad``), or None on a GPU (Megatron's optimizer runs)."""
    return _cpu.CpuOptimizer(_cpu.MainGradAdam(params, **settings)) if _cpu else None
