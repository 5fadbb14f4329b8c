"""The inverse of the packing (``replay.row_origins``) undoes it on every layout: each router row maps back to the
(sample, token) whose route the packing put there, and only rows without a rollout route map to nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rl.sample import Sample, SampleStatus
from r3rl.train.batch import RouteShape, build_micro_batch
from r3rl.train.layout import TokenLayout
from r3rl.train.replay import row_origins

SHAPE = RouteShape(num_layers=3, topk=2, num_experts=8)


def samples_with_routes(lengths, seed=0):
    rng = np.random.default_rng(seed)
    samples, routes = [], []
    for i, (p, r) in enumerate(lengths):
        samples.append(Sample(index=i, group=0, request_id=f"r{i}", prompt_ids=np.arange(1, p + 1, dtype=np.int32),
                              response_ids=np.arange(1, r + 1, dtype=np.int32),
                              rollout_logprobs=np.zeros(r, np.float32), loss_mask=np.ones(r, np.float32),
                              finish_reason="length", status=SampleStatus.TRUNCATED))
        routes.append(np.argsort(rng.random((p + r - 1, SHAPE.num_layers, SHAPE.num_experts)), axis=-1)[
            ..., :SHAPE.topk].astype(np.uint8))
    return samples, routes


@pytest.mark.parametrize("layout", [TokenLayout(), TokenLayout(cp_size=2, cp_rank=1),
                                    TokenLayout(sp_size=2, sp_rank=1),
                                    TokenLayout(cp_size=2, cp_rank=0, sp_size=2, sp_rank=1)], ids=str)
def test_row_origins_invert_the_packing(layout):
    samples, routes = samples_with_routes([(5, 4), (3, 2), (6, 7)])
    indices = [2, 0, 1]  # slots need not follow sample order
    mb = build_micro_batch(samples, indices, layout, torch.device("cpu"), routes=[routes[i] for i in indices],
                           route_shape=SHAPE)
    slot, pos = row_origins(mb, layout, [len(routes[i]) for i in indices])
    assert len(slot) == len(mb.routes.rows)
    held = slot >= 0
    # rows mapped back hold exactly that sample's route at that token; the rest are the packing's filler rows
    assert np.array_equal(held, mb.routes.has_route)
    for row in np.flatnonzero(held):
        assert np.array_equal(mb.routes.rows[row], routes[indices[slot[row]]][pos[row]])
    # and every route row of every sample held on this rank appears once
    pairs = {(int(s), int(p)) for s, p in zip(slot[held], pos[held])}
    assert len(pairs) == int(held.sum())

