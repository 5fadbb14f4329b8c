"""Routes under context parallelism: each CP rank's routes are sliced exactly as Megatron slices that rank's tokens
(``megatron.core.utils.get_batch_on_this_cp_rank``, the load-balanced zigzag), in real CP groups of two and four
gloo processes. Only the slicing: the attention itself is GPU-only (TransformerEngine)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from test_megatron_expert_parallel import finish, launch

WORKER = Path(__file__).with_name("megatron_cp_worker.py")


@pytest.mark.parametrize("cp", [2, 4])
def test_routes_are_sliced_as_megatron_slices_each_cp_ranks_tokens(cp, tmp_path, torchrun_rendezvous):
    """Fails if ``TokenLayout`` orders a CP rank's chunks otherwise than Megatron (e.g. plain contiguous chunks, or
    the second chunk first), or if ``pack_routes`` lets a route leave its token: every router row must carry the
    routes Megatron's slicing puts on that token, and only filler where the sample has ended."""
    procs = launch(cp, [str(tmp_path), str(cp)], tmp_path, torchrun_rendezvous(cp), worker=WORKER)
    finish(procs, tmp_path, timeout=300)
    seen = []
    for rank in range(cp):
        r = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert np.array_equal(r["r3rl_tokens"], r["megatron_tokens"]), rank
        # Megatron's [B, S_cp, L, K] in the routers' s-major row order, against r3rl's packed rows
        theirs = np.swapaxes(r["megatron_routes"], 0, 1).reshape(-1, *r["megatron_routes"].shape[2:])
        tokens = r["router_tokens"]
        seq_len = r["megatron_tokens"].size // len(r["lengths"]) * cp
        ended = np.array([t % seq_len >= r["lengths"][t // seq_len] for t in tokens])
        assert np.array_equal(~ended, r["has_route"]), rank
        assert np.array_equal(r["r3rl_rows"][~ended], theirs[~ended].astype(r["r3rl_rows"].dtype)), rank
        seen.extend(tokens.tolist())
    assert sorted(seen) == list(range(len(seen)))  # every token on exactly one rank


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4])
def test_packed_rows_are_split_as_transformer_engine_splits_them(cp):
    """A packed row's per-segment zigzag (``TokenLayout.local_positions`` with segments) against TransformerEngine's
    ``thd_get_partitioned_indices``, which Megatron's THD batch slicing (0.16 ``get_thd_batch_on_this_cp_rank``,
    0.19 ``get_batch_on_this_cp_rank``) calls for cp > 1. Fails if r3rl zigzagged the whole row, or a segment's
    chunks in another order. Needs TE's CUDA extension (GPU machines with TE; not the one-GPU check)."""
    import torch

    tex = pytest.importorskip("transformer_engine_torch")
    if not torch.cuda.is_available():
        pytest.skip("TransformerEngine's partition kernel runs on a GPU")
    from r3rl.train.layout import TokenLayout

    segments = np.array([0, 8 * cp, 12 * cp, 28 * cp, 30 * cp])
    cu = torch.as_tensor(segments, dtype=torch.int32, device="cuda")
    for rank in range(cp):
        theirs = tex.thd_get_partitioned_indices(cu, int(segments[-1]), cp, rank).cpu().numpy()
        ours = TokenLayout(cp_size=cp, cp_rank=rank).local_positions(int(segments[-1]), segments)
        assert np.array_equal(ours, theirs), (rank, ours, theirs)
