"""One rank of a context-parallel group: Megatron's own token slicing (``get_batch_on_this_cp_rank``) next to
r3rl's ``TokenLayout`` on the same micro batch, tokens and routes.

Usage: python megatron_cp_worker.py OUT_DIR CP   (every rank writes OUT_DIR/rank<r>.pkl)
"""

from __future__ import annotations

import inspect
import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")

BATCH, SEQ_LEN, LAYERS, TOPK, EXPERTS = 2, 24, 3, 2, 8


def main() -> None:
    import numpy as np
    import torch

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from r3rl.train.layout import TokenLayout
    from r3rl.train.routes import pack_routes

    out_dir, cp = sys.argv[1], int(sys.argv[2])
    torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel(context_parallel_size=cp)
    rank = ps.get_context_parallel_rank()
    try:
        token_id = torch.arange(BATCH * SEQ_LEN).view(BATCH, SEQ_LEN)  # a unique id per (sample, position)
        # each token's routes are a function of its id: wherever a route lands, it says which token it belongs to
        ids = token_id.numpy()
        dense = np.stack([(ids + layer) % EXPERTS for layer in range(LAYERS)], axis=-1)[..., None]
        dense = np.concatenate([dense, (dense + 1) % EXPERTS], axis=-1).astype(np.uint8)  # [B, S, L, K]
        lengths = [SEQ_LEN - 3, SEQ_LEN]  # one sample shorter: its last rows are filler
        routes = [dense[b, :n] for b, n in enumerate(lengths)]
        batch = {"tokens": token_id.clone(), "routes": torch.from_numpy(dense.astype(np.int64))}
        if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
            # Megatron-core 0.19: one entry point for padded and packed batches (cu_seqlens None: padded)
            theirs = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False)
        else:
            theirs = get_batch_on_this_cp_rank(batch)
        layout = TokenLayout(cp_size=cp, cp_rank=rank)
        packed = pack_routes(routes, SEQ_LEN, layout, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
        result = {"rank": rank, "megatron_tokens": theirs["tokens"].numpy(),
                  "megatron_routes": theirs["routes"].numpy(), "r3rl_tokens": layout.local_tokens(ids),
                  "r3rl_rows": packed.rows, "has_route": packed.has_route,
                  "router_tokens": layout.router_rows(ids), "lengths": lengths}
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
