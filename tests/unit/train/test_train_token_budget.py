"""Micro batches packed by a token budget: each pads to its own longest sample, every rank runs as many forwards."""

from __future__ import annotations

from r3rl.train.batch import plan_token_micro_batches
from r3rl.train.layout import TokenLayout

LENGTHS = {0: 30, 1: 5, 2: 12, 3: 7, 4: 29, 5: 6, 6: 11, 7: 8}


def cost(slots, lengths, pad=lambda n: n):
    return len(slots) * max(pad(lengths[i]) for i in slots if i is not None)


def test_budget_bounds_every_micro_batch_and_covers_each_sample_once():
    for rank in range(2):
        plan = plan_token_micro_batches(LENGTHS, list(LENGTHS), rank, 2, 40, lambda n: n, equal_shapes=False)
        for slots, seq_len in plan:
            assert seq_len is None
            real = [i for i in slots if i is not None]
            assert not real or cost(real, LENGTHS) <= 40 or len(real) == 1
    seen = [i for rank in range(2) for slots, _ in plan_token_micro_batches(LENGTHS, list(LENGTHS), rank, 2, 40,
                                                                           lambda n: n, equal_shapes=False)
            for i in slots if i is not None]
    assert sorted(seen) == list(LENGTHS)


def test_short_samples_share_a_micro_batch_instead_of_padding_to_the_longest():
    plan = plan_token_micro_batches(LENGTHS, list(LENGTHS), 0, 1, 40, lambda n: n, equal_shapes=False)
    padded_tokens = sum(cost([i for i in s if i is not None], LENGTHS) for s, _ in plan)
    # padding every sample to the longest of the batch (what EP > 1 did) costs 8 x 30 = 240 tokens
    assert padded_tokens < 8 * 30 * 0.6, padded_tokens
    assert [len(s) for s, _ in plan] == [1, 1, 3, 3]  # longest first: 30 | 29 | 12 11 8 | 7 6 5


def test_every_rank_runs_the_same_number_of_micro_batches():
    lengths = {0: 40, 1: 40, 2: 40, 3: 3, 4: 3, 5: 3}
    plans = [plan_token_micro_batches(lengths, list(lengths), r, 2, 40, lambda n: n, equal_shapes=False)
             for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 3
    assert plans[1][1:] == [([None], None), ([None], None)]


def test_equal_shapes_align_micro_batch_k_across_ranks():
    layout = TokenLayout(cp_size=2, cp_rank=0)  # lengths padded to multiples of 4
    plans = [plan_token_micro_batches(LENGTHS, list(LENGTHS), r, 2, 64, layout.padded_len, equal_shapes=True)
             for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    for (a, sa), (b, sb) in zip(*plans):
        assert len(a) == len(b) and sa == sb and sa % 4 == 0
        assert all(layout.padded_len(LENGTHS[i]) <= sa for i in a + b if i is not None)
