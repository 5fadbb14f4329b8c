"""Where each token of a micro batch lives on this rank, as index arithmetic.

A micro batch is a right-padded ``[B, S]`` batch or, packed, one ``[1, T]`` row of samples laid end to end
(``segments``: the padded cu_seqlens, each segment's start and the total). Context parallel (CP) splits a sequence
into ``2 * cp`` chunks and gives rank r chunks r and ``2cp-1-r`` (the load-balanced "zigzag" Megatron expects for
causal attention); a packed row is split so per segment, the segments' pieces kept in order (what Megatron's THD
path and TransformerEngine's ``thd_get_partitioned_indices`` do). Sequence parallel (SP) then shards the router's
``[s, b, h]`` input along s over the tensor-parallel ranks. Everything per token (tokens, positions, labels, masks
and routes) goes through the same index arithmetic, so routes cannot drift from their tokens (pitfall P3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TokenLayout:
    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1  # tensor-parallel size when sequence parallel is on, else 1
    sp_rank: int = 0

    @property
    def align(self) -> int:
        """Packed lengths are multiples of this: 2 chunks per CP rank, and whole SP shards after CP."""
        return (2 * self.cp_size if self.cp_size > 1 else 1) * self.sp_size

    def padded_len(self, longest: int) -> int:
        return -(-longest // self.align) * self.align

    def cp_positions(self, seq_len: int, cp_rank: int | None = None) -> np.ndarray:
        """Full-sequence positions held by a CP rank, in its local order."""
        rank = self.cp_rank if cp_rank is None else cp_rank
        if self.cp_size == 1:
            return np.arange(seq_len)
        if seq_len % (2 * self.cp_size):
            raise ValueError(f"length {seq_len} does not split into {2 * self.cp_size} context-parallel chunks")
        chunk = seq_len // (2 * self.cp_size)
        first = np.arange(rank * chunk, (rank + 1) * chunk)
        second = np.arange((2 * self.cp_size - 1 - rank) * chunk, (2 * self.cp_size - rank) * chunk)
        return np.concatenate([first, second])

    def local_positions(self, seq_len: int, segments: np.ndarray | None = None,
                        cp_rank: int | None = None) -> np.ndarray:
        """Positions along S held by a CP rank, in its local order: the zigzag of the whole sequence, or of every
        segment of a packed row (``segments``: cu_seqlens, each segment's length a multiple of ``align``)."""
        if segments is None:
            return self.cp_positions(seq_len, cp_rank)
        if int(segments[-1]) != seq_len:
            raise ValueError(f"packed segments end at {int(segments[-1])}, the row holds {seq_len} tokens")
        if self.cp_size == 1:
            return np.arange(seq_len)
        return np.concatenate([self.cp_positions(int(end - start), cp_rank) + int(start)
                               for start, end in zip(segments[:-1], segments[1:])])

    def local_tokens(self, x, segments: np.ndarray | None = None):
        """``[B, S, ...]`` -> this CP rank's ``[B, S_cp, ...]`` (numpy array or torch tensor)."""
        if self.cp_size == 1:
            return x
        index = self.local_positions(x.shape[1], segments)
        if isinstance(x, torch.Tensor):
            return x[:, torch.as_tensor(index, device=x.device)]
        return x[:, index]

    def router_rows(self, x: np.ndarray, segments: np.ndarray | None = None) -> np.ndarray:
        """``[B, S, ...]`` -> ``[S_local * B, ...]`` in the order this rank's routers flatten ``[s, b]``."""
        return self.local_router_rows(self.local_tokens(x, segments))

    def local_router_rows(self, local: np.ndarray) -> np.ndarray:
        """This CP rank's ``[B, S_cp, ...]`` (a micro batch's own tensors, already split) -> its routers' rows."""
        seq_first = np.swapaxes(local, 0, 1)
        if self.sp_size > 1:
            s = seq_first.shape[0]
            if s % self.sp_size:
                raise ValueError(f"local length {s} does not split over {self.sp_size} sequence-parallel ranks")
            step = s // self.sp_size
            seq_first = seq_first[self.sp_rank * step:(self.sp_rank + 1) * step]
        return seq_first.reshape(-1, *seq_first.shape[2:])

    def gather_tokens(self, local: torch.Tensor, group=None, segments: np.ndarray | None = None) -> torch.Tensor:
        """Inverse of ``local_tokens`` across the CP group: ``[B, S_cp, ...]`` -> ``[B, S, ...]``. Collective."""
        if self.cp_size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.cp_size)]
        torch.distributed.all_gather(pieces, local.contiguous(), group=group)
        seq_len = local.shape[1] * self.cp_size
        full = local.new_empty((local.shape[0], seq_len, *local.shape[2:]))
        for rank, piece in enumerate(pieces):
            full[:, torch.as_tensor(self.local_positions(seq_len, segments, rank), device=local.device)] = piece
        return full
