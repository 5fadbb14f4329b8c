"""Combining per-rank results: every rank computes its share, every rank returns the whole.

Which group a sum runs over follows from what is split where: samples over data parallel, a sample's tokens over
context parallel (and over tensor-parallel ranks under sequence parallel), layers over pipeline stages.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _multi_rank() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def all_gather_dicts(local: dict) -> list[dict]:
    """Every rank's dict (picklable values), in rank order."""
    if not _multi_rank():
        return [local]
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return parts


def merge_by_index(local: dict[int, np.ndarray], count: int, what: str) -> list[np.ndarray]:
    merged: dict[int, np.ndarray] = {}
    for part in all_gather_dicts(local):
        merged.update(part)
    missing = [i for i in range(count) if i not in merged]
    if missing:
        raise RuntimeError(f"{what} missing for samples {missing}")
    return [merged[i] for i in range(count)]


def merge_routes(local: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]], lengths: list[int], num_layers: int,
                 topk: int, dtype: np.dtype) -> list[np.ndarray]:
    """Per-rank ``{sample: {layer: (held_rows_mask, rows)}}`` -> ``[T-1, L, K]`` per sample in ``dtype``."""
    out = [np.zeros((n, num_layers, topk), dtype=dtype) for n in lengths]
    seen = [np.zeros((n, num_layers), dtype=bool) for n in lengths]
    for part in all_gather_dicts(local):
        for index, layers in part.items():
            for layer, (held, rows) in layers.items():
                out[index][held, layer] = rows[held]
                seen[index][held, layer] = True
    for index, s in enumerate(seen):
        if not s.all():
            layer = int(np.argwhere(~s)[0][1])
            raise RuntimeError(f"sample {index}, layer {layer}: no rank recorded routes for some tokens")
    return out


def sum_over(t: torch.Tensor, groups: list) -> torch.Tensor:
    if _multi_rank():
        for group in groups:
            torch.distributed.all_reduce(t, group=group)
    return t


def share_from_last_stage(t: torch.Tensor, pipelined: bool) -> torch.Tensor:
    """Values only the last pipeline stage computed (losses), broadcast to every stage."""
    if pipelined and _multi_rank():
        from megatron.core import parallel_state as ps

        torch.distributed.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
    return t
