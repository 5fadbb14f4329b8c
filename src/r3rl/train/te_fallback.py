"""Megatron's fused GPU kernels when TransformerEngine (or Apex) is missing: on a GPU as much as on a CPU.

The plan turns the GPU speed settings on for GPU layouts (``r3rl.plan.GPU_SPEED_SETTINGS``). Most of them are
TransformerEngine kernels: without TE, Megatron refuses RoPE fusion and permute fusion at config time and has no
grouped GEMM for the local spec. Gradient-accumulation fusion needs Apex's ``fused_weight_gradient_mlp_cuda`` whether
TE is there or not: GPTModel's output layer is Megatron's own ``ColumnParallelLinear`` (TE's LM head only under
MXFP8), whose constructor raises without that module, and TE does not ship it. A GPU machine without TE or Apex (the
one-GPU check, a user's minimal install, the gpu profile, which installs TE but not Apex) still trains, with each
missing kernel turned off and named in a warning.
Independently of those settings, 0.16.1 calls ``te_general_gemm`` in the router's gating GEMM with no fallback when
TE failed to import; ``guard_router_gemm`` gives it the torch path. Its OptimizerConfig also reads TE's version for
the precision-aware optimizer and fails on ``None`` without TE: that option is turned off the same way. Megatron's
local attention refuses packed (THD) input, which TE's attention takes natively: ``packed_core_attention`` is the
local attention with a packed path, what the local layer spec (CPU, or a GPU without TE) is built with.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any

import numpy as np
import torch

# settings -> what provides the kernel; bias_activation_fusion is Megatron's own jit kernel and needs neither
NEEDS_TRANSFORMER_ENGINE = ("apply_rope_fusion", "moe_permute_fusion", "moe_grouped_gemm")


def have_transformer_engine() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def have_grad_accum_fusion() -> bool:
    """Apex's ``fused_weight_gradient_mlp_cuda`` imported, by the flag Megatron's ``ColumnParallelLinear`` checks
    before it raises (the module's presence where an older Megatron lacks the flag)."""
    from megatron.core.tensor_parallel import layers

    flag = getattr(layers, "_grad_accum_fusion_available", None)
    return bool(flag) if flag is not None else importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def available_kernels(transformer: dict[str, Any], *, have_te: bool, have_apex_fusion: bool
                      ) -> tuple[dict[str, Any], list[str]]:
    """``transformer`` with every fused kernel this install lacks turned off, and the names of those turned off."""
    out = dict(transformer)
    missing = [] if have_te else [k for k in NEEDS_TRANSFORMER_ENGINE if out.get(k)]
    # TE's layers fuse it themselves, but the output layer is Megatron's own: it needs Apex's module with or without TE
    if out.get("gradient_accumulation_fusion") and not have_apex_fusion:
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


@functools.lru_cache(maxsize=64)
def segment_groups(cu_seqlens: tuple[int, ...]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """A packed row's segments grouped for batched attention: ``(index [L, n], real [L, n])`` per group, where
    column j of ``index`` runs over one segment's positions (past its end it repeats the last one, and ``real`` is
    False there). Segments go longest first into a group while they are at least 0.95x its longest: attention's
    S x S work dominates long rows, so a group wastes at most a tenth of it on padding, and a row of equal lengths
    is still one call."""
    starts, lengths = np.asarray(cu_seqlens[:-1]), np.diff(cu_seqlens)
    order = np.argsort(-lengths, kind="stable")
    groups, i = [], 0
    while i < len(order):
        longest = lengths[order[i]]
        j = i + 1
        while j < len(order) and lengths[order[j]] * 100 >= longest * 95:
            j += 1
        members = order[i:j]
        steps = np.arange(longest)[:, None]
        real = steps < lengths[members][None, :]
        index = starts[members][None, :] + np.minimum(steps, lengths[members][None, :] - 1)
        groups.append((index, real))
        i = j
    return tuple(groups)


@functools.lru_cache(maxsize=64)
def _group_tensors(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Per group of ``segment_groups``: the gather index ``[L, n]``, the flat positions of its real entries in an
    ``[L * n]`` result, where they go in the row, and the causal mask (True = masked), on ``device`` once per row."""
    out = []
    for index, real in segment_groups(cu_seqlens):
        flat = np.flatnonzero(real.ravel())
        causal = torch.triu(torch.ones(len(index), len(index), dtype=torch.bool, device=device), diagonal=1)
        out.append((torch.from_numpy(index).to(device), torch.from_numpy(flat).to(device),
                    torch.from_numpy(index.ravel()[flat]).to(device), causal[None, None]))
    return tuple(out)


@functools.cache
def packed_core_attention():
    """Megatron's local ``DotProductAttention`` that also takes packed input (``PackedSeqParams`` in THD format).

    Padded input goes to Megatron's own forward unchanged. A packed ``[T, heads, dim]`` row is cut at its padded
    cu_seqlens (what TE's THD attention and Megatron's THD RoPE read), segments of similar length are stacked into a
    right-padded ``[L, n, heads, dim]`` batch, and Megatron's forward runs on it with the causal mask the padded
    path uses: every token attends within its own segment only, and each real row's arithmetic is the padded
    path's, so packed and padded log-probs agree. Cross-segment attention never forms (no T x T matrix)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed attention without TransformerEngine takes qkv_format 'thd', got "
                                 f"{packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            total, heads, dim = query.shape
            out = query.new_empty(total, heads * dim)
            for at, real, rows, causal in _group_tensors(tuple(int(v) for v in cu.tolist()), query.device):
                context = super().forward(query[at], key[at], value[at], causal, attn_mask_type, attention_bias)
                out[rows] = context.reshape(-1, heads * dim)[real]
            return out

    return PackedDotProductAttention
