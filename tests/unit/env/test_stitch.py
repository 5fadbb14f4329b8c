"""The stitching rule on routes whose values say which row they are: an episode's turns, each returning the rows
from ``route_start(held)`` on, stitch back into exactly the ``T - 1`` rows of the whole episode, every row on its
token; observations carry loss mask 0 and no log-prob; bookkeeping that does not add up names the sample and turn."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from r3rl.env.stitch import (EpisodeStats, Recomputed, StitchError, TurnRecord, episode_sample, held_rows_from,
                             recomputed_rows, route_start, shift_turn_rows)
from r3rl.metrics import episode_metrics, per_turn_mismatch
from r3rl.sample import Sample, SampleStatus

L, K = 3, 2


def truth(rows: int) -> np.ndarray:
    """Row r routes to experts (r % 200, 200 + r % 50) in layer 0 and shifted ids after: every row distinct."""
    r = np.arange(rows)[:, None]
    return np.stack([np.concatenate([(r + l) % 200, 200 + (r + l) % 50], axis=1) for l in range(L)],
                    axis=1).astype(np.uint8)


def episode(prompt_len=5, responses=(4, 3, 6), observations=(2, 5), version=3):
    """The turns of an episode whose token i is 1000 + i, each turn's routes sliced from ``truth`` by the rule."""
    total = prompt_len + sum(responses) + sum(observations)
    tokens = np.arange(1000, 1000 + total, dtype=np.int32)
    routes = truth(total - 1)
    turns, held, context = [], 0, prompt_len
    for n, r in enumerate(responses):
        start = route_start(held)
        end = context + r - 1  # rows of the context and response, the last token never forwarded
        s = Sample(index=7, group=2, request_id=f"req-t{n + 1}", prompt_ids=tokens[:context],
                   response_ids=tokens[context:context + r], rollout_logprobs=np.full(r, -0.5 - n, np.float32),
                   loss_mask=np.ones(r, np.float32), finish_reason="stop", status=SampleStatus.COMPLETED,
                   routed_experts=routes[start:end], weight_version=version)
        o = observations[n] if n < len(observations) else 0
        turns.append(TurnRecord(context_len=context, routes_from=start, sample=s,
                                observation_ids=tokens[context + r:context + r + o]))
        held, context = end, context + r + o
    return turns, tokens, routes


def stats(turns=3, masked=""):
    return EpisodeStats(turns=turns, tool_calls=2, tool_errors=1, observation_tokens=7, context_truncated=False,
                        route_rows_received=10, route_rows_full=30, masked=masked)


def test_turns_stitch_into_every_row_of_the_episode_on_its_token():
    """Fails if a turn's slice started at len(context) instead of len(context) - 1 (the previous turn's last token
    would lose its row: verifiers #2616) or rows were appended in the wrong place."""
    turns, tokens, routes = episode()
    s = episode_sample(turns, index=7, group=2, label="9", reward=None, stats=stats())
    np.testing.assert_array_equal(s.tokens, tokens)
    np.testing.assert_array_equal(s.routed_experts, routes)
    assert s.routed_experts.shape[0] == s.num_tokens - 1
    # each turn after the first asked for one row before its new prompt part: the previous turn's last token
    assert [t.routes_from for t in turns] == [0, 5 + 4 - 1, 5 + 4 + 2 + 3 - 1]


def test_observations_are_in_the_response_with_mask_zero_and_turns_marked():
    """Fails if observation tokens were trainable (loss mask 1), carried a log-prob, or were counted as a turn's."""
    turns, _, _ = episode()
    s = episode_sample(turns, index=7, group=2, label="9", reward=None, stats=stats())
    want_turn = np.array([1] * 4 + [0] * 2 + [2] * 3 + [0] * 5 + [3] * 6)
    np.testing.assert_array_equal(s.extra["turn_of_token"], want_turn)
    np.testing.assert_array_equal(s.loss_mask, (want_turn > 0).astype(np.float32))
    assert np.all(s.rollout_logprobs[want_turn == 0] == 0.0)
    np.testing.assert_array_equal(s.extra["token_versions"], np.where(want_turn > 0, 3, -1))
    np.testing.assert_array_equal(s.extra["answer_ids"], turns[-1].sample.response_ids)
    assert s.weight_version == 3 and s.status is SampleStatus.COMPLETED


def test_bookkeeping_that_does_not_add_up_names_sample_and_turn():
    """Fails if a turn whose routes start elsewhere than the held rows, or a context that skips tokens, were
    stitched silently (every later row would sit on the wrong token)."""
    turns, _, _ = episode()
    turns[1].routes_from += 1
    with pytest.raises(StitchError, match=r"sample 7, turn 2 \(request req-t2\): routes start at row 9, but the "
                                          r"episode holds 8 rows"):
        episode_sample(turns, index=7, group=2, label=None, reward=None, stats=stats())
    turns, _, _ = episode()
    turns[2].context_len += 1
    with pytest.raises(StitchError, match="sample 7, turn 3"):
        episode_sample(turns, index=7, group=2, label=None, reward=None, stats=stats())


def test_a_masked_episode_trains_on_nothing():
    """Fails if an episode whose turn failed twice kept a trainable token."""
    turns, _, _ = episode(responses=(4, 3), observations=(2,))
    s = episode_sample(turns, index=7, group=2, label=None, reward=None, stats=stats(2, masked="aborted"))
    assert s.status is SampleStatus.ABORTED and not s.loss_mask.any()


def test_the_wrong_rule_moves_only_later_turns_rows_by_one():
    """The deliberate fault the bench and the integration test measure: fails if it touched turn 1's rows (the
    measurement would then blame turn 1) or did not move every later row."""
    turns, _, routes = episode()
    s = episode_sample(turns, index=7, group=2, label=None, reward=None, stats=stats())
    wrong = shift_turn_rows(s.routed_experts, s.extra["turn_of_token"], len(s.prompt_ids))
    first = 5 + 4 - 1
    np.testing.assert_array_equal(wrong[:first + 1], routes[:first + 1])
    np.testing.assert_array_equal(wrong[first + 1:], routes[first:-1])


def test_per_turn_mismatch_and_episode_counters():
    """Fails if observation tokens entered a turn's mismatch, or a turn's figure mixed in another turn's tokens."""
    turns, _, _ = episode()
    s = episode_sample(turns, index=7, group=2, label=None, reward=None, stats=stats())
    trainer = s.rollout_logprobs + np.where(s.extra["turn_of_token"] == 2, 0.3, 0.1).astype(np.float32)
    trainer[s.extra["turn_of_token"] == 0] = 50.0  # an observation's value must never count
    got = per_turn_mismatch([trainer], [s.rollout_logprobs], [s.loss_mask], [s.extra["turn_of_token"]])
    assert got.keys() == {"train/logprob_abs_diff/turn_1", "train/logprob_abs_diff/turn_2",
                          "train/logprob_abs_diff/turn_3"}
    assert got["train/logprob_abs_diff/turn_2"] == pytest.approx(0.3, abs=1e-6)
    assert got["train/logprob_abs_diff/turn_1"] == pytest.approx(0.1, abs=1e-6)
    m = episode_metrics([stats(3), stats(1)], route_row_bytes=6)
    assert m["rollout/turns_mean"] == 2.0 and m["rollout/tool_errors"] == 2.0
    assert m["rollout/route_bytes_per_episode"] == 60.0 and m["rollout/route_bytes_per_episode_full"] == 180.0


def test_recomputed_rows_are_counted_from_the_cache_hits_and_compared_where_sent_again():
    """A turn asked from row ``route_start(H, overlap)`` and the engine served ``cached`` prompt tokens from its
    prefix cache: held rows ``cached .. H-1`` were recomputed, the ones at or after the start compared. Fails if the
    returned rows were read one off (the row of position p taken for p-1), if the top-k order counted as a change,
    if rows the cache served were counted, if an episode without the engine's figure entered the step's sums, or if
    the held rows from a start were joined from the wrong turns or one row off."""
    turns, _, routes = episode()
    for start in (0, 3, 8, 9, 14, 20):  # the turns' rows begin at 0 and 8, the two hold 13: inside, at and past
        np.testing.assert_array_equal(held_rows_from(turns[:2], start), routes[start:5 + 4 + 2 + 3 - 1])
    held = truth(40)
    assert route_start(40, 16) == 24 and route_start(10, 16) == 0 and route_start(40) == 40
    returned = truth(45)[24:].copy()  # the turn sent rows 24..44 back: 24..39 are held ones again
    returned[:, 1] = returned[:, 1, ::-1]  # another top-k order in layer 1: the same routing
    assert recomputed_rows(held[24:], returned, start=24, cached_tokens=32) == Recomputed(rows=8, checked=8, changed=0)
    returned[36 - 24, 2, 0] = 99  # position 36's experts changed in the recomputation
    returned[30 - 24, 0, 0] = 99  # position 30 came from the cache: its row is the held one whatever came back
    assert recomputed_rows(held[24:], returned, start=24, cached_tokens=32) == Recomputed(rows=8, checked=8, changed=1)
    # recomputation from row 16 on, before the rows sent again: 8 recomputed rows were not compared
    assert recomputed_rows(held[24:], returned, start=24, cached_tokens=16) == \
        Recomputed(rows=24, checked=16, changed=2)
    # nothing sent again (overlap 0): counted, never compared
    assert recomputed_rows(held[40:], truth(45)[40:], start=40, cached_tokens=32) == Recomputed(rows=8)
    m = episode_metrics([replace(stats(), recomputed=Recomputed(8, 8, 1)), replace(stats(), recomputed=None),
                         replace(stats(), recomputed=Recomputed(4, 2, 0))])
    assert (m["r3/recomputed_rows"], m["r3/recomputed_rows_checked"], m["r3/recomputed_rows_experts_changed"]) == \
        (12.0, 10.0, 1.0)
    assert "r3/recomputed_rows" not in episode_metrics([stats()])


def test_an_episode_under_two_weight_versions_is_refused():
    """Fails if an episode whose turns came from two weight versions (a sync while episodes ran) were stitched: its
    tokens would carry one version label while two policies wrote them."""
    turns, _, _ = episode()
    turns[2].sample.weight_version = 4
    with pytest.raises(StitchError, match=r"sample 7: its turns were generated by weight versions \[3, 3, 4\]"):
        episode_sample(turns, index=7, group=2, label=None, reward=None, stats=stats())
