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
the precision-aware optimizer and fails on ``None`` without TE: that option is turned off the same way.

The local layer spec (CPU, or a GPU without TE) is built with ``local_core_attention``: Megatron's local
``DotProductAttention`` with a packed (THD) path, which TE's attention has natively and Megatron's refuses, and on
CUDA torch's fused ``scaled_dot_product_attention`` in place of Megatron's unfused arithmetic, whose S x S scores per
head (32 x 9216^2 in bf16 plus a float32 softmax, per layer) the memory plan does not count: it assumes fused
attention, as TE's is. The CPU keeps Megatron's arithmetic, so packed and padded rows agree bit for bit there.
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


def guard_mla_without_te() -> None:
    """Megatron 0.16's multi-latent attention takes TransformerEngine for present when its wrapper module imports,
    which it does without TE (its classes are then mocks), and then calls ``isinstance(linear_proj, <a mock>)``:
    MLA cannot be built without TE. Its flag is set to what is installed (idempotent; a no-op with TE)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


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
    ``[L * n]`` result, and where they go in the row, on ``device`` once per row (O(tokens): no masks here)."""
    out = []
    for index, real in segment_groups(cu_seqlens):
        flat = np.flatnonzero(real.ravel())
        out.append((torch.from_numpy(index).to(device), torch.from_numpy(flat).to(device),
                    torch.from_numpy(index.ravel()[flat]).to(device)))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask for its unfused path (True = masked), ``[1, 1, L, L]``; the fused path needs none."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def fused_attention(query: torch.Tensor) -> bool:
    """The local attention runs torch's fused SDPA on CUDA; the CPU keeps Megatron's arithmetic."""
    return query.is_cuda


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *,
                   scale: float) -> torch.Tensor:
    """Megatron's core-attention interface over ``torch.nn.functional.scaled_dot_product_attention``: ``[sq, b, np,
    hn]`` query, ``[sk, b, ng, hn]`` key and value (each key/value head serves ``np / ng`` consecutive query heads,
    as Megatron's ``repeat_interleave``), a boolean ``mask`` marking masked positions True or None for causal, and
    ``[sq, b, np * hn]`` out. On CUDA the math backend, which would materialise the scores, is excluded: a call no
    fused kernel takes fails loudly instead of silently using the memory the plan does not count."""
    sq, b, heads, hn = query.shape
    groups = key.shape[2]
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
    if groups != heads:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    kwargs = {"is_causal": True} if mask is None else {"attn_mask": ~mask.bool()}
    attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, scale=scale, **kwargs)
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = [getattr(SDPBackend, n) for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
                 if hasattr(SDPBackend, n)]
        with sdpa_kernel(fused):
            out = attend()
    else:
        out = attend()
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


@functools.cache
def local_core_attention():
    """Megatron's local ``DotProductAttention`` that also takes packed input (``PackedSeqParams`` in THD format) and
    runs fused on CUDA (``sdpa_attention``, where Megatron's options allow: no attention bias, window, softmax
    offset or attention dropout, none of which a Qwen3-MoE uses).

    A packed ``[T, heads, dim]`` row is cut at its padded cu_seqlens (what TE's THD attention and Megatron's THD RoPE
    read), segments of similar length are stacked into a right-padded ``[L, n, heads, dim]`` batch, and the padded
    path's attention runs on it causally: every token attends within its own segment only, and each real row's
    arithmetic is the padded path's, so packed and padded log-probs agree. Cross-segment attention never forms (no
    T x T matrix)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalCoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            # multi-latent attention hands the head sizes of q/k and v (48 and 32 on the DeepSeek-V3 stand-in),
            # which Megatron's local attention does not take: it sizes its output by kv_channels. The output is
            # sized by the value each forward gets instead (Megatron 0.19 pads MLA's packed value to the query's)
            super().__init__(*args, **kwargs)
            self.sdpa_applies = (getattr(self.config, "window_size", None) is None
                                 and getattr(self, "softmax_offset", None) is None
                                 and self.attention_dropout.p == 0.0)

        def _fused(self, query, attention_bias) -> bool:
            return attention_bias is None and self.sdpa_applies and fused_attention(query)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            self.hidden_size_per_partition = query.shape[-2] * value.shape[-1]  # query heads x value's head size
            fused = self._fused(query, attention_bias)
            if packed_seq_params is None:
                if fused:
                    return sdpa_attention(query, key, value, attention_mask, scale=self.softmax_scale)
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed attention without TransformerEngine takes qkv_format 'thd', got "
                                 f"{packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            # query heads (value has one per group), each of value's size (MLA's differs from the query's)
            total, heads, dim = query.shape[0], query.shape[1], value.shape[-1]
            out = query.new_empty(total, heads * dim)
            for at, real, rows in _group_tensors(tuple(int(v) for v in cu.tolist()), query.device):
                q, k, v = query[at], key[at], value[at]
                context = (sdpa_attention(q, k, v, None, scale=self.softmax_scale) if fused else
                           super().forward(q, k, v, _causal_mask(len(at), query.device), attn_mask_type,
                                           attention_bias))
                out[rows] = context.reshape(-1, heads * dim)[real]
            return out

    return LocalCoreAttention
