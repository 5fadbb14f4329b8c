"""Packed micro batches (trainer.packing): the row layout, routes and per-token inputs on their tokens, context-parallel
slicing per segment, filler routes, the packing plan and the attention's segment groups (pure numpy, no Megatron)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rl.sample import Sample, SampleStatus
from r3rl.train.batch import (RouteShape, build_micro_batch, packed_segments, plan_packed_micro_batches,
                              plan_token_micro_batches)
from r3rl.train.layout import TokenLayout
from r3rl.train.routes import pack_routes
from r3rl.train.te_fallback import segment_groups

L, K, E = 3, 2, 8


def sample(i: int, prompt: int, response: int) -> Sample:
    # token ids that name (sample, position): 100 * (i + 1) + position
    ids = (100 * (i + 1) + np.arange(prompt + response)).astype(np.int32)
    return Sample(index=i, group=0, request_id=f"r{i}", prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                  rollout_logprobs=np.zeros(response, np.float32), loss_mask=np.ones(response, np.float32),
                  finish_reason="stop", status=SampleStatus.COMPLETED, reward=1.0)


def token_routes(s: Sample) -> np.ndarray:
    """Routes that name their token: row t holds (token id % E, (token id + 1) % E) in every layer."""
    t = s.tokens[:-1].astype(np.int64)
    return np.stack([np.stack([t % E, (t + 1) % E], -1)] * L, axis=1).astype(np.uint8)


SAMPLES = [sample(0, 5, 4), sample(1, 3, 2), sample(2, 7, 6)]
_rng = np.random.default_rng(3)
RANDOM = [sample(i, int(_rng.integers(1, 20)), int(_rng.integers(1, 30))) for i in range(7)]


@pytest.mark.parametrize("samples", [SAMPLES, RANDOM], ids=["fixed", "random"])
@pytest.mark.parametrize("cp, sp, total", [(1, 1, None), (1, 1, 30 * 8), (2, 1, None), (2, 1, 40 * 8), (2, 2, None),
                                           (1, 2, None), (1, 4, None), (2, 4, 64 * 8)])
def test_every_token_label_input_and_route_lands_on_its_own_position(cp, sp, total, samples):
    """Per rank, each packed position holds its sample's token, label, per-token input and route, sliced per segment
    as Megatron slices a THD row (zigzag per segment). Fails if a segment starts one position off (a sample boundary
    off by one), if routes are packed one row off their tokens, or if the context-parallel split of a packed row
    zigzags the whole row instead of each segment."""
    base = TokenLayout(cp_size=cp, sp_size=sp)
    advantages = [np.arange(s.response_length, dtype=np.float32) + 10 * i for i, s in enumerate(samples)]
    routes = [token_routes(s) for s in samples]
    seen = []
    for cp_rank in range(cp):
        for sp_rank in range(sp):
            layout = TokenLayout(cp_size=cp, cp_rank=cp_rank, sp_size=sp, sp_rank=sp_rank)
            mb = build_micro_batch(samples, list(range(len(samples))), layout, torch.device("cpu"), per_token={"adv": advantages},
                                   routes=routes, route_shape=RouteShape(L, K, E), seq_len=total, packed=True)
            segments = mb.segments
            assert all(n % base.align == 0 for n in np.diff(segments))
            assert mb.seq_len == segments[-1] == (total or segments[-1])
            # by hand: the positions this CP rank holds, per segment r-th and (2cp-1-r)-th chunk
            held = []
            for start, end in zip(segments[:-1], segments[1:]):
                if cp == 1:
                    held.extend(range(start, end))
                    continue
                chunk = (end - start) // (2 * cp)
                for c in (cp_rank, 2 * cp - 1 - cp_rank):
                    held.extend(range(start + c * chunk, start + (c + 1) * chunk))
            tokens = mb.tokens.numpy()[0]
            labels = mb.labels.numpy()[0]
            adv = mb.per_token["adv"].numpy()[0]
            assert len(tokens) == len(held)
            for local, position in enumerate(held):
                b = int(np.searchsorted(segments, position, side="right") - 1)
                offset = position - segments[b]
                if b < len(samples) and offset < samples[b].num_tokens - 1:
                    s = samples[b]
                    assert tokens[local] == s.tokens[offset] and labels[local] == s.tokens[offset + 1]
                    start, end = mb.spans[b]
                    expected = advantages[b][offset - start] if start <= offset < end else 0.0
                    assert adv[local] == expected
                else:
                    assert tokens[local] == 0 and labels[local] == 0 and adv[local] == 0.0
            # the router's rows: this rank's sequence-parallel shard of its tokens, in order
            step = len(tokens) // sp
            router_tokens = tokens[sp_rank * step:(sp_rank + 1) * step]
            assert mb.routes.rows.shape[0] == len(router_tokens)
            for row, token in enumerate(router_tokens):
                if mb.routes.has_route[row]:
                    assert mb.routes.rows[row, 0].tolist() == [token % E, (token + 1) % E]
                else:
                    assert token == 0
            seen.extend(np.asarray(held)[sp_rank * step:(sp_rank + 1) * step].tolist())
            # what a rank reads back as a sample's log-probs: its scored positions in the gathered row
            for b, s in enumerate(samples):
                row, start, end = mb.scored(b)
                assert row == 0 and end - start == s.response_length
    assert sorted(seen) == list(range(int(packed_segments([s.num_tokens - 1 for s in samples], base, total)[-1])))


def test_packed_rows_gather_back_in_order_across_context_parallel_ranks():
    """``gather_tokens`` with the segments inverts the per-segment split (what the log-probs read back); fails if it
    scattered by the whole-row zigzag."""
    layout = TokenLayout(cp_size=2)
    segments = np.array([0, 8, 12, 24])
    full = np.arange(24)[None]
    pieces = [TokenLayout(cp_size=2, cp_rank=r).local_tokens(full, segments) for r in range(2)]
    assert pieces[0][0, :4].tolist() == [0, 1, 6, 7] and pieces[0][0, 4:6].tolist() == [8, 11]
    rebuilt = np.zeros_like(full)
    for r, piece in enumerate(pieces):
        rebuilt[:, layout.local_positions(24, segments, r)] = piece
    assert np.array_equal(rebuilt, full)
    with pytest.raises(ValueError, match="segments end at 24"):
        layout.local_positions(26, segments)


def test_padding_rows_get_filler_spread_over_every_expert_and_expert_parallel_rank():
    """Rows past a packed row's samples (alignment padding) carry K distinct ids per layer, and over the padding the
    experts are used evenly, so padding neither drops tokens nor piles onto one expert or EP rank (slime #2308,
    prime-rl #3350: all padding on expert 0). Fails with zero-filled padding rows."""
    layout = TokenLayout()
    routes = [token_routes(s) for s in SAMPLES]
    lengths = [s.num_tokens - 1 for s in SAMPLES]
    total = sum(lengths) + 64
    packed = pack_routes(routes, total, layout, num_layers=L, topk=K, num_experts=E,
                         segments=packed_segments(lengths, layout, total))
    pad = packed.rows[~packed.has_route]
    assert len(pad) == 64
    assert all(len(set(row.tolist())) == K for row in pad.reshape(-1, K))
    for layer in range(L):
        load = np.bincount(pad[:, layer].ravel(), minlength=E)
        assert load.max() - load.min() <= 1, load
        ep_ranks = load.reshape(2, E // 2).sum(axis=1)  # experts 0-3 on EP rank 0, 4-7 on rank 1
        assert abs(int(ep_ranks[0]) - int(ep_ranks[1])) <= 1


LENGTHS = {0: 30, 1: 5, 2: 12, 3: 7, 4: 29, 5: 6, 6: 11, 7: 8, 8: 3}


@pytest.mark.parametrize("budget", [None, 40])
def test_packing_plan_covers_each_sample_once_within_the_budget(budget):
    """Every sample in exactly one row, no row over the budget (unless one sample alone), every rank as many rows;
    equal shapes give row k one total on every rank. Fails if first-fit overfills a row or drops a sample."""
    plans = [plan_packed_micro_batches(LENGTHS, list(LENGTHS), r, 2, lambda n: n, max_tokens=budget,
                                       micro_batch_size=2, equal_shapes=True, uniform=False) for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    seen = [i for plan in plans for slots, _ in plan for i in slots if i is not None]
    assert sorted(seen) == list(LENGTHS)
    for plan in plans:
        for slots, total in plan:
            used = sum(LENGTHS[i] for i in slots if i is not None)
            assert total >= used
            if budget is not None and len(slots) > 1:
                assert used <= budget
    assert [t for _, t in plans[0]] == [t for _, t in plans[1]]
    uniform = plan_packed_micro_batches(LENGTHS, list(LENGTHS), 0, 2, lambda n: n, max_tokens=budget,
                                        micro_batch_size=2, equal_shapes=False, uniform=True)
    assert len({t for _, t in uniform}) == 1


def test_packed_rows_run_fewer_forwards_and_tokens_than_padded_ones():
    """At one token budget, packing fills rows where padding pads to each micro batch's longest: fewer forwards and
    fewer tokens (what bench/packing.py times). Fails if the packing plan fell back to one sample per row."""
    lengths = {i: n for i, n in enumerate([200, 40, 35, 30, 28, 25, 20, 18, 16, 12, 10, 9])}
    padded = plan_token_micro_batches(lengths, list(lengths), 0, 1, 256, lambda n: n, equal_shapes=False)
    packed = plan_packed_micro_batches(lengths, list(lengths), 0, 1, lambda n: n, max_tokens=256,
                                       micro_batch_size=1, equal_shapes=False, uniform=False)
    padded_tokens = sum(len(s) * max(lengths[i] for i in s) for s, _ in padded)
    assert len(packed) < len(padded) and sum(lengths.values()) < padded_tokens
    assert len(packed) == 2


def test_attention_segment_groups_cover_every_position_once():
    """The packed attention's groups hold every position of the row once as a real entry, each column within one
    segment and in order, and no group pads a segment to more than 1/0.95 of its length. Fails if a column crossed
    into the next segment (a token attending past its sample's boundary)."""
    cu = (0, 40, 45, 75, 76, 104, 300)
    real_positions = []
    for index, real in segment_groups(cu):
        for column in range(index.shape[1]):
            kept = index[real[:, column], column]
            start = kept[0]
            end = cu[cu.index(int(start)) + 1]
            assert kept.tolist() == list(range(start, end))
            assert (end - start) * 100 >= 95 * len(index)
            real_positions.extend(kept.tolist())
    assert sorted(real_positions) == list(range(300))
