"""Rollout routes -> the rows each local MoE layer's router sees, packed exactly like the tokens.

Routes arrive per sample as ``uint8[T-1, L, K]`` (uint16 above 256 experts) and stay narrow here: a micro batch is
packed into one ``[S_local * B, L, K]`` array of the same dtype, and only ``layer_targets`` widens one layer's
column to int64 at the moment it is handed to that layer's router.

Row order follows Megatron: the router flattens its ``[s, b, h]`` input, so row = ``s * B + b`` (``s`` on a packed
``[1, T]`` row, whose routes are laid out like its tokens, segment by segment). Every row without
a rollout route (right padding, context-parallel and sequence-parallel alignment padding, and a sample's last token
if a caller feeds it) holds K distinct valid ids: duplicate ids (e.g. zeros) make the dispatcher lose tokens under
expert parallel (pitfall P2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from r3rl.train.layout import TokenLayout


class RouteError(ValueError):
    """A sample's routes cannot be replayed; the message names the sample (and layer where one is at fault)."""


def check_routes(routes: np.ndarray | None, *, sample: int, num_tokens: int, num_layers: int, topk: int,
                 num_experts: int, request_id: str | None = None) -> np.ndarray:
    """Validate one sample's routes and return the ``T-1`` rows to replay (exactly ``T-1``: a surplus row at the
    front would shift every route by one token, so no count but ``T-1`` is accepted)."""
    if routes is None:
        raise RouteError(f"sample {sample}: no routed experts to replay (was the engine started with "
                         f"--enable-return-routed-experts?)")
    if not isinstance(routes, np.ndarray) or routes.dtype.kind not in "ui":
        raise RouteError(f"sample {sample}: routed experts must be an integer numpy array, got "
                         f"{type(routes).__name__} {getattr(routes, 'dtype', '')}")
    if routes.ndim != 3:
        raise RouteError(f"sample {sample}: routed experts must be [tokens-1, layers, top-k], got shape "
                         f"{routes.shape}")
    rows, layers, k = routes.shape
    if layers != num_layers:
        raise RouteError(f"sample {sample}: routed experts cover {layers} layers, the model has {num_layers} "
                         f"(layer axis of shape {routes.shape})")
    if k != topk:
        raise RouteError(f"sample {sample}: routed experts hold {k} experts per token and layer, the model routes "
                         f"to top-{topk} in every layer (shape {routes.shape})")
    if rows != num_tokens - 1:
        raise RouteError(f"sample {sample}: routed experts of request {request_id} have {rows} rows for {num_tokens} "
                         f"tokens; expected {num_tokens - 1} (every token but the last), in every layer")
    if routes.size:
        if routes.dtype.kind == "i" and routes.min() < 0:
            row, layer, _ = np.argwhere(routes < 0)[0]
            raise RouteError(f"sample {sample}, layer {layer}: negative expert id {routes[row, layer].tolist()} at "
                             f"token {row}")
        high = routes.max(axis=(0, 2))
        bad = np.flatnonzero(high >= num_experts)
        if bad.size:
            layer = int(bad[0])
            row = int(np.flatnonzero((routes[:, layer] >= num_experts).any(axis=-1))[0])
            raise RouteError(f"sample {sample}, layer {layer}: expert id {routes[row, layer].tolist()} at token "
                             f"{row} is out of range for {num_experts} experts")
        ordered = np.sort(routes, axis=-1)
        dup = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
        if dup.any():
            row, layer = (int(v) for v in np.argwhere(dup)[0])
            raise RouteError(f"sample {sample}, layer {layer}: token {row} is routed to the same expert twice "
                             f"{routes[row, layer].tolist()}; a replayed row needs {topk} distinct experts")
    return routes


def filler(rows: int, num_layers: int, topk: int, num_experts: int, dtype: np.dtype) -> np.ndarray:
    """``[rows, L, K]`` of valid ids, distinct within every (row, layer): K consecutive integers modulo E."""
    return (np.arange(rows * num_layers * topk, dtype=np.int64) % num_experts).astype(dtype).reshape(
        rows, num_layers, topk)


@dataclass
class PackedRoutes:
    """One micro batch's routes in router row order, still narrow."""

    rows: np.ndarray  # [S_local * B, L, K] uint8/uint16
    has_route: np.ndarray  # [S_local * B] bool: True where the row is a rollout route (not filler)

    def layer_targets(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer ``layer``'s replay target ``[S_local * B, K]``, widened to int64 on ``device`` (the only widening)."""
        column = torch.from_numpy(np.ascontiguousarray(self.rows[:, layer]))
        return column.to(device, non_blocking=True).to(torch.int64)


def pack_routes(routes: list[np.ndarray], seq_len: int, layout: TokenLayout, *, num_layers: int, topk: int,
                num_experts: int, segments: np.ndarray | None = None) -> PackedRoutes:
    """Per-sample validated ``[T_b-1, L, K]`` routes -> this rank's router rows for a ``[B, seq_len]`` token batch
    (sample b on row b from position 0), or for one packed ``[1, seq_len]`` row whose cu_seqlens are ``segments``
    (sample b from the start of segment b).

    The routes go through the same ``TokenLayout`` transform as the tokens (context-parallel chunks, per segment when
    packed, then the sequence-parallel shard of the router input), so row ``s * B + b`` here is the token the router
    sees there. Every row left over gets ``filler``: consecutive ids modulo E, so padding spreads over all experts
    (and so over every expert-parallel rank) rather than piling onto one.
    """
    dtype = np.result_type(*[r.dtype for r in routes]) if routes else np.dtype(np.uint8)
    num_rows = 1 if segments is not None else len(routes)
    full = np.empty((num_rows, seq_len, num_layers, topk), dtype=dtype)
    has = np.zeros((num_rows, seq_len), dtype=bool)
    full[:] = filler(seq_len, num_layers, topk, num_experts, dtype)[None]
    for b, r in enumerate(routes):
        row, start, end = (0, int(segments[b]), int(segments[b + 1])) if segments is not None else (b, 0, seq_len)
        if start + len(r) > end:
            raise RouteError(f"sample in micro-batch slot {b}: {len(r)} route rows exceed its {end - start} "
                             f"positions")
        full[row, start:start + len(r)] = r
        has[row, start:start + len(r)] = True
    local = layout.router_rows(full, segments)
    local_has = layout.router_rows(has, segments)
    return PackedRoutes(rows=np.ascontiguousarray(local), has_route=np.ascontiguousarray(local_has))
