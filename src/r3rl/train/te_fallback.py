"""Megatron's fused GPU kernels when TransformerEngine (or Apex) is missing: on a GPU as much as on a CPU.

The plan turns the GPU speed settings on for GPU layouts (``r3rl.plan.GPU_SPEED_SETTINGS``). Most of them are
TransformerEngine kernels: without TE, Megatron refuses RoPE fusion and permute fusion at config time, has no
grouped GEMM for the local spec, and needs Apex for gradient-accumulation fusion. A GPU machine without TE (the
one-GPU check, a user's minimal install) still trains, with each missing kernel turned off and named in a warning.
Independently of those settings, 0.16.1 calls ``te_general_gemm`` in the router's gating GEMM with no fallback when
TE failed to import; ``guard_router_gemm`` gives it the torch path. Its OptimizerConfig also reads TE's version for
the precision-aware optimizer and fails on ``None`` without TE: that option is turned off the same way.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

# settings -> what provides the kernel; bias_activation_fusion is Megatron's own jit kernel and needs neither
NEEDS_TRANSFORMER_ENGINE = ("apply_rope_fusion", "moe_permute_fusion", "moe_grouped_gemm")


def have_transformer_engine() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def have_grad_accum_fusion() -> bool:
    """Apex's ``fused_weight_gradient_mlp_cuda`` (Megatron's local linear layers) or TE's own linear layers."""
    return have_transformer_engine() or importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def available_kernels(transformer: dict[str, Any], *, have_te: bool, have_apex_fusion: bool
                      ) -> tuple[dict[str, Any], list[str]]:
    """``transformer`` with every fused kernel this install lacks turned off, and the names of those turned off."""
    out = dict(transformer)
    missing = [] if have_te else [k for k in NEEDS_TRANSFORMER_ENGINE if out.get(k)]
    if out.get("gradient_accumulation_fusion") and not (have_te or have_apex_fusion):
        missing.append("gradient_accumulation_fusion")
    for key in missing:
        out[key] = False
    return out, missing


def drop_missing_kernels(transformer: dict[str, Any]) -> dict[str, Any]:
    """``available_kernels`` for this install, with a warning naming what runs unfused."""
    out, missing = available_kernels(transformer, have_te=have_transformer_engine(),
                                     have_apex_fusion=have_grad_accum_fusion())
    if missing:
        warnings.warn(f"TransformerEngine/Apex missing: running without {', '.join(missing)} (slower, same results)",
                      stacklevel=2)
    return out


def optimizer_settings(settings: dict[str, Any], *, have_te: bool) -> tuple[dict[str, Any], list[str]]:
    """OptimizerConfig kwargs with the options this install cannot build turned off, and their names."""
    out = dict(settings)
    missing = [] if have_te or not out.get("use_precision_aware_optimizer") else ["use_precision_aware_optimizer"]
    for key in missing:
        out[key] = False
    return out, missing


def drop_missing_optimizer_options(settings: dict[str, Any]) -> dict[str, Any]:
    out, missing = optimizer_settings(settings, have_te=have_transformer_engine())
    if missing:
        warnings.warn(f"TransformerEngine missing: Megatron's optimizer runs without {', '.join(missing)} "
                      "(float32 master weights beside the parameters)", stacklevel=2)
    return out


def guard_router_gemm() -> None:
    """Let the router's gating GEMM fall back to torch when TransformerEngine did not import (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
