"""Samples -> micro batches (tokens, positions, labels, per-token inputs, routes): right-padded ``[B, S]``, or packed.

Position s predicts token s+1, so a sample's response token j (token ``P + j``) is scored at position ``P + j - 1``;
per-response-token inputs (loss mask, advantages, old and reference log-probs) are placed on those positions. All
per-token tensors and the routes go through the same ``TokenLayout``.

Packed (``trainer.packing``), a micro batch is one ``[1, T]`` row: each sample's fed tokens form a segment, padded to
the layout's alignment (context and sequence parallel), laid end to end, with an alignment segment at the end when
the row must reach a common length (equal shapes over expert-parallel ranks, pipeline stages). ``segments`` are the
row's cu_seqlens (padded lengths, which is what Megatron's THD attention and RoPE read); every per-token input and
route of sample b is written at its segment's offset, so a route stays on its token as in the padded layout.

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
    seq_len: int  # full length S of a row (padded: the longest sample's T-1, aligned; packed: the row's total)
    tokens: torch.Tensor  # [B, S_local] int64 (packed: [1, S_local])
    position_ids: torch.Tensor  # [B, S_local] int64 (packed: each segment counts from 0)
    labels: torch.Tensor  # [B, S_local] int64
    spans: list[tuple[int, int]]  # per sample, the positions [P-1, T-1) of its own sequence that score its response
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, S_local] float32 each
    routes: PackedRoutes | None = None
    # packed only: the row's cu_seqlens over padded segments (sample b's is segment b; a last one may be alignment)
    segments: np.ndarray | None = None

    @property
    def packed(self) -> bool:
        return self.segments is not None

    def place(self, b: int) -> tuple[int, int]:
        """(row, offset) of slot b's sequence: its own row from 0, or the packed row from its segment's start."""
        return (0, int(self.segments[b])) if self.packed else (b, 0)

    def scored(self, b: int) -> tuple[int, int, int]:
        """(row, start, end) of the full-sequence positions that score slot b's response tokens."""
        row, offset = self.place(b)
        start, end = self.spans[b]
        return row, offset + start, offset + end

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Per full-sequence position ``[rows, S]``: the slot it belongs to (-1 on a packed row's alignment segment)
        and its position within that slot's sequence. Built from the layout alone, never from the routes."""
        if not self.packed:
            batch = len(self.indices)
            return (np.repeat(np.arange(batch)[:, None], self.seq_len, axis=1),
                    np.repeat(np.arange(self.seq_len)[None, :], batch, axis=0))
        lengths = np.diff(self.segments)
        owner = np.repeat(np.arange(len(lengths)), lengths)
        slot = np.where(owner < len(self.indices), owner, -1)
        pos = np.arange(self.seq_len) - self.segments[owner]
        return slot[None], pos[None]


def response_positions(sample: Sample) -> tuple[int, int]:
    start = len(sample.prompt_ids) - 1
    return start, start + sample.response_length


def packed_segments(fed_lengths: Sequence[int], layout: TokenLayout, total: int | None = None) -> np.ndarray:
    """cu_seqlens of a packed row: each fed length padded to the layout's alignment, then an alignment segment up to
    ``total`` when that is longer."""
    cu = np.concatenate([[0], np.cumsum([layout.padded_len(max(n, 1)) for n in fed_lengths])]).astype(np.int64)
    if total is not None and total > cu[-1]:
        if total % layout.align:
            raise ValueError(f"packed row length {total} is not a multiple of the layout's alignment {layout.align}")
        cu = np.append(cu, total)
    return cu


def build_micro_batch(samples: Sequence[Sample], indices: Sequence[int], layout: TokenLayout, device: torch.device,
                      *, per_token: dict[str, Sequence[np.ndarray]] | None = None,
                      routes: Sequence[np.ndarray] | None = None, route_shape: RouteShape | None = None,
                      seq_len: int | None = None, packed: bool = False) -> MicroBatch:
    """``per_token[name][i]`` and ``routes[i]`` belong to ``samples[indices[i]]``; routes are already validated.
    ``seq_len``: the length to pad a row to at least (padded) or the packed row's total (packed)."""
    chosen = [samples[i] for i in indices]
    for b, s in enumerate(chosen):
        if len(s.prompt_ids) < 1:
            raise ValueError(f"sample {indices[b]}: empty prompt (nothing to condition the first response token on)")
    fed = [s.num_tokens - 1 for s in chosen]
    segments = None
    if packed:
        segments = packed_segments(fed, layout, seq_len)
        length, rows = int(segments[-1]), 1
        positions = np.concatenate([np.arange(n) for n in np.diff(segments)])[None].astype(np.int64)
    else:
        length, rows = layout.padded_len(max(max(fed), seq_len or 0, 1)), len(chosen)
        positions = np.tile(np.arange(length, dtype=np.int64), (rows, 1))
    tokens = np.full((rows, length), PAD_ID, dtype=np.int64)
    labels = np.full((rows, length), PAD_ID, dtype=np.int64)
    spans = [response_positions(s) for s in chosen]
    mb = MicroBatch(indices=list(indices), seq_len=length, tokens=None, position_ids=None, labels=None,
                    spans=spans, segments=segments)
    for b, s in enumerate(chosen):
        row, offset = mb.place(b)
        t = s.tokens
        tokens[row, offset:offset + len(t) - 1] = t[:-1]
        labels[row, offset:offset + len(t) - 1] = t[1:]

    def local(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(layout.local_tokens(x, segments))).to(device)

    for name, values in (per_token or {}).items():
        dense = np.zeros((rows, length), dtype=np.float32)
        for b in range(len(chosen)):
            row, start, end = mb.scored(b)
            v = np.asarray(values[b], dtype=np.float32)
            if v.shape != (end - start,):
                raise ValueError(f"sample {indices[b]}: {name} has shape {v.shape}, the response has {end - start} "
                                 f"tokens")
            dense[row, start:end] = v
        mb.per_token[name] = local(dense)
    if routes is not None:
        assert route_shape is not None
        mb.routes = pack_routes(list(routes), length, layout, num_layers=route_shape.num_layers,
                                topk=route_shape.topk, num_experts=route_shape.num_experts, segments=segments)
    mb.tokens, mb.position_ids, mb.labels = local(tokens), local(positions), local(labels)
    return mb


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


def plan_packed_micro_batches(lengths: Mapping[int, int], indices: Sequence[int], dp_rank: int, dp_size: int,
                              padded_len: Callable[[int], int], *, max_tokens: int | None, micro_batch_size: int,
                              equal_shapes: bool, uniform: bool) -> list[tuple[list[int | None], int | None]]:
    """This data-parallel rank's packed rows over ``indices``: ``(slots, total)`` each, where ``total`` is the row
    length to pad to (None: its own).

    With a token budget (``max_tokens``) each rank packs its contiguous share first-fit, longest first, into rows
    whose padded segments sum to at most the budget (a longer sample goes alone); without one, a row holds the
    ``micro_batch_size`` samples ``plan_micro_batches`` gives. Every rank gets the same number of rows (a trailing
    row is ``[None]``, which the caller fills with the shortest sample and a zero loss mask). With ``equal_shapes``
    (a dispatcher that gathers equal token counts) row k has the same total on every rank (the longest over ranks);
    with ``uniform`` (pipeline stages pass fixed-size activations) every row has the longest total of all.
    """
    shortest = min(padded_len(max(lengths[i], 1)) for i in indices)  # what fills a [None] row

    def size(i: int | None) -> int:
        return padded_len(max(lengths[i], 1)) if i is not None else shortest

    ranks: list[list[list[int | None]]] = []
    if max_tokens is None:
        for r in range(dp_size):
            rows = plan_micro_batches(indices, r, dp_size, micro_batch_size)
            ranks.append([[i for i in row if i is not None] or [None] for row in rows])
    else:
        per_rank = -(-len(indices) // dp_size)
        for r in range(dp_size):
            rows, room = [], []
            for i in sorted(indices[r * per_rank:(r + 1) * per_rank], key=lambda i: -lengths[i]):
                fit = next((k for k, left in enumerate(room) if size(i) <= left), None)
                if fit is None:
                    rows.append([i])
                    room.append(max_tokens - size(i))
                else:
                    rows[fit].append(i)
                    room[fit] -= size(i)
            ranks.append(rows)
    count = max(len(rows) for rows in ranks)
    ranks = [rows + [[None]] * (count - len(rows)) for rows in ranks]
    totals = np.asarray([[sum(size(i) for i in row) for row in rows] for rows in ranks])
    if uniform:
        return [(row, int(totals.max())) for row in ranks[dp_rank]]
    if equal_shapes:
        return [(row, int(totals[:, k].max())) for k, row in enumerate(ranks[dp_rank])]
    return [(row, None) for row in ranks[dp_rank]]
