"""DAPO's dynamic sampling and overlong shaping (``r3rl.train.dapo``) on hand-made batches."""

from __future__ import annotations

import numpy as np
import pytest

from r3rl.sample import Sample, SampleStatus
from r3rl.train.dapo import fill_with_mixed_groups, mixed_groups, overlong_penalty


def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer():
    """max_tokens 16, buffer 4: no penalty up to 12 tokens, -0.25 per token after, -1 at 16 (times the factor).
    Fails if the ramp starts at max_tokens instead of max_tokens - buffer, or if the sign or the factor is lost."""
    lengths = [8, 12, 13, 14, 16]
    np.testing.assert_allclose(overlong_penalty(lengths, 16, 4), [0, 0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 16, 4, penalty_factor=0.5), [0, 0, -0.125, -0.25, -0.5])
    np.testing.assert_allclose(overlong_penalty(lengths, 16, 0), 0.0)


def test_mixed_groups_judges_the_raw_outcome():
    """Group 0 all wrong, group 1 mixed, group 2 all right: only group 1 is kept. Fails if all-right groups are kept
    (they have zero advantage too) or if a group is judged by a shaped reward that differs within it."""
    correct = [0, 0, 1, 0, 1, 1]
    assert mixed_groups(correct, [0, 0, 1, 1, 2, 2]) == {1}


def sample(group: int, index: int, tag: str) -> Sample:
    return Sample(index=index, group=group, request_id=tag, prompt_ids=np.zeros(2, np.int32),
                  response_ids=np.zeros(3, np.int32), rollout_logprobs=np.zeros(3, np.float32),
                  loss_mask=np.ones(3, np.float32), finish_reason="stop", status=SampleStatus.COMPLETED)


def rounds_of(outcomes: list[list[list[int]]]):
    """next_round(r) returning round r's groups, each sample's raw outcome in ``extra['ok']``."""
    def next_round(r: int) -> list[Sample]:
        out = []
        for g, group in enumerate(outcomes[r]):
            for ok in group:
                s = sample(g, len(out), f"r{r}g{g}i{len(out)}")
                s.extra["ok"] = ok
                out.append(s)
        return out
    return next_round


def test_dynamic_sampling_keeps_generating_until_the_batch_holds_mixed_groups_only():
    """Two groups wanted; round 0 gives one mixed group, round 1 two more: the batch is round 0's mixed group and the
    first of round 1, renumbered 0..1, after 2 rounds and 2 dropped groups. Fails if a uniform group slips in, if
    generation stops after the first round, or if group ids of different rounds collide (advantages would then be
    normalised across two prompts)."""
    rounds = [[[0, 0], [0, 1]], [[1, 1], [1, 0], [0, 1]]]
    filled = fill_with_mixed_groups(rounds_of(rounds), lambda s: s.extra["ok"], groups_wanted=2, max_rounds=5)
    assert (filled.rounds, filled.filtered_groups, filled.padded_groups) == (2, 2, 0)
    assert [s.request_id for s in filled.samples] == ["r0g1i2", "r0g1i3", "r1g1i2", "r1g1i3"]
    assert [s.group for s in filled.samples] == [0, 0, 1, 1] and [s.index for s in filled.samples] == [0, 1, 2, 3]


def test_dynamic_sampling_pads_with_the_last_dropped_groups_when_rounds_run_out():
    """Nothing mixed in 3 rounds of 2 groups: the batch is the last 2 dropped groups (zero advantage), padded 2,
    filtered 6. Fails if the step comes back short (the global batch would no longer divide it) or runs a 4th round."""
    rounds = [[[0, 0], [1, 1]]] * 3
    calls = []

    def next_round(r: int) -> list[Sample]:
        calls.append(r)
        return rounds_of(rounds)(r)

    filled = fill_with_mixed_groups(next_round, lambda s: s.extra["ok"], groups_wanted=2, max_rounds=3)
    assert calls == [0, 1, 2]
    assert (filled.rounds, filled.filtered_groups, filled.padded_groups) == (3, 6, 2)
    assert [s.request_id for s in filled.samples] == ["r2g0i0", "r2g0i1", "r2g1i2", "r2g1i3"]


@pytest.mark.parametrize("wanted", [1, 3])
def test_dynamic_sampling_batch_size_is_exact(wanted):
    """The batch holds exactly ``wanted`` groups whatever a round brings (extra mixed groups are left out). Fails if
    the surplus of the last round is kept."""
    rounds = [[[0, 1], [1, 0], [0, 1], [1, 0]]]
    filled = fill_with_mixed_groups(rounds_of(rounds), lambda s: s.extra["ok"], groups_wanted=wanted, max_rounds=1)
    assert len({s.group for s in filled.samples}) == wanted and len(filled.samples) == 2 * wanted
