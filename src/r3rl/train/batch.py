"""Samples -> right-padded ``[B, S]`` micro batches (tokens, positions, labels, per-token inputs, routes).

Position s predicts token s+1, so a sample's response token j (token ``P + j``) is scored at position ``P + j - 1``;
per-response-token inputs (loss mask, advantages, old and reference log-probs) are placed on those positions. All
per-token tensors and the routes go through the same ``TokenLayout``.

A sample's last token is not fed: it would only predict past the end of the sequence, and the engine never
forwarded it either, so the ``T-1`` input positions are exactly the ``T-1`` rows of rollout routes (no placeholder
row to invent). Rows the routes do not cover (right padding, alignment padding) get filler ids in ``pack_routes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from r3rl.sample import Sample
from r3rl.train.layout import TokenLayout
from r3rl.train.routes import PackedRoutes, pack_routes

PAD_ID = 0


@dataclass(frozen=True)
class RouteShape:
    num_layers: int
    topk: int
    num_experts: int


@dataclass
class MicroBatch:
    indices: list[int]  # positions of its samples in the caller's list
    seq_len: int  # padded full length S (the longest sample's T-1, aligned)
    tokens: torch.Tensor  # [B, S_local] int64
    position_ids: torch.Tensor  # [B, S_local] int64
    labels: torch.Tensor  # [B, S_local] int64
    spans: list[tuple[int, int]]  # per sample, the full-sequence positions [P-1, T-1) that score its response
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, S_local] float32 each
    routes: PackedRoutes | None = None


def response_positions(sample: Sample) -> tuple[int, int]:
    start = len(sample.prompt_ids) - 1
    return start, start + sample.response_length


def build_micro_batch(samples: Sequence[Sample], indices: Sequence[int], layout: TokenLayout, device: torch.device,
                      *, per_token: dict[str, Sequence[np.ndarray]] | None = None,
                      routes: Sequence[np.ndarray] | None = None, route_shape: RouteShape | None = None,
                      seq_len: int | None = None) -> MicroBatch:
    """``per_token[name][i]`` and ``routes[i]`` belong to ``samples[indices[i]]``; routes are already validated."""
    chosen = [samples[i] for i in indices]
    longest = max(s.num_tokens - 1 for s in chosen)
    length = layout.padded_len(max(longest, seq_len or 0, 1))
    batch = len(chosen)
    tokens = np.full((batch, length), PAD_ID, dtype=np.int64)
    labels = np.full((batch, length), PAD_ID, dtype=np.int64)
    spans = []
    for b, s in enumerate(chosen):
        if len(s.prompt_ids) < 1:
            raise ValueError(f"sample {indices[b]}: empty prompt (nothing to condition the first response token on)")
        t = s.tokens
        tokens[b, : len(t) - 1] = t[:-1]
        labels[b, : len(t) - 1] = t[1:]
        spans.append(response_positions(s))
    positions = np.tile(np.arange(length, dtype=np.int64), (batch, 1))
    extra: dict[str, torch.Tensor] = {}
    for name, values in (per_token or {}).items():
        dense = np.zeros((batch, length), dtype=np.float32)
        for b, (start, end) in enumerate(spans):
            v = np.asarray(values[b], dtype=np.float32)
            if v.shape != (end - start,):
                raise ValueError(f"sample {indices[b]}: {name} has shape {v.shape}, the response has {end - start} "
                                 f"tokens")
            dense[b, start:end] = v
        extra[name] = torch.from_numpy(layout.local_tokens(dense).copy()).to(device)
    packed = None
    if routes is not None:
        assert route_shape is not None
        packed = pack_routes(list(routes), length, layout, num_layers=route_shape.num_layers,
                             topk=route_shape.topk, num_experts=route_shape.num_experts)

    def local(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(layout.local_tokens(x))).to(device)

    return MicroBatch(indices=list(indices), seq_len=length, tokens=local(tokens), position_ids=local(positions),
                      labels=local(labels), spans=spans, per_token=extra, routes=packed)


def plan_micro_batches(indices: Sequence[int], dp_rank: int, dp_size: int, micro_batch_size: int
                       ) -> list[list[int | None]]:
    """This data-parallel rank's micro batches over ``indices``: a contiguous share, split in micro batches.

    Every rank gets the same number of equally sized micro batches (slots past the end are None): expert-parallel
    ranks exchange tokens inside every MoE layer, so they must run the same forwards with the same shapes.
    """
    per_step = dp_size * micro_batch_size
    total = -(-len(indices) // per_step) * per_step
    slots: list[int | None] = list(indices) + [None] * (total - len(indices))
    per_rank = total // dp_size
    mine = slots[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def plan_token_micro_batches(lengths: Mapping[int, int], indices: Sequence[int], dp_rank: int, dp_size: int,
                             max_tokens: int, padded_len: Callable[[int], int], *, equal_shapes: bool
                             ) -> list[tuple[list[int | None], int | None]]:
    """This data-parallel rank's micro batches over ``indices``, packed by a token budget (slime's dynamic batch
    size for right-padded batches): ``(slots, seq_len)`` each, where samples x padded length stays within
    ``max_tokens`` (a longer sample goes alone).

    Each rank takes the same contiguous share as ``plan_micro_batches`` and packs it longest first, so a micro batch
    pads only to its own longest sample. Every rank gets the same number of micro batches (trailing ones all None):
    expert-parallel ranks meet in every MoE layer. With ``equal_shapes`` (a dispatcher that gathers equal token
    counts) micro batch k has the same number of slots on every rank and ``seq_len`` is the longest over ranks of
    micro batch k; otherwise ``seq_len`` is None (each pads to its own longest). ``lengths[i]`` is sample i's fed
    length (tokens - 1); None slots are filled by the caller with the shortest sample and a zero loss mask.
    """
    per_rank = -(-len(indices) // dp_size)
    filler = min(padded_len(max(lengths[i], 1)) for i in indices)
    ranks = []
    for r in range(dp_size):
        share = sorted(indices[r * per_rank:(r + 1) * per_rank], key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        for i in share:
            if batches and (len(batches[-1]) + 1) * padded_len(max(lengths[batches[-1][0]], 1)) <= max_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        ranks.append(batches)
    count = max(len(b) for b in ranks)
    padded: list[list[list[int | None]]] = [[list(b) for b in batches] + [[None]] * (count - len(batches))
                                            for batches in ranks]

    def longest(slots: list[int | None]) -> int:
        return max(padded_len(max(lengths[i], 1)) if i is not None else filler for i in slots)

    if not equal_shapes:
        return [(slots, None) for slots in padded[dp_rank]]
    out = []
    for k, slots in enumerate(padded[dp_rank]):
        width = max(len(p[k]) for p in padded)
        out.append((slots + [None] * (width - len(slots)), max(longest(p[k]) for p in padded)))
    return out
