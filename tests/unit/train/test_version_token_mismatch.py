"""The mismatch split by the weight version that generated each token (``r3rl.train.staleness
.version_token_mismatch``), for runs that train on samples of older weights."""

from __future__ import annotations

import numpy as np
import pytest

from r3rl import metrics as M
from r3rl.sample import Sample, SampleStatus
from r3rl.train.logprob_pass import LogprobResult
from r3rl.train.staleness import version_token_mismatch


def sample(index: int, spans: list[tuple[str, int, int]]) -> Sample:
    s = Sample(index=index, group=0, request_id=f"r{index}", prompt_ids=np.arange(3, dtype=np.int32),
               response_ids=np.arange(4, dtype=np.int32), rollout_logprobs=np.zeros(4, dtype=np.float32),
               loss_mask=np.ones(4, dtype=np.float32), finish_reason="stop", status=SampleStatus.COMPLETED,
               weight_version=int(spans[0][0]))
    # as every in-flight request's sample: sent under the version it started on
    s.extra.update(weight_versions=[{"version": v, "start": a, "end": b} for v, a, b in spans],
                   sent_version=int(spans[0][0]))
    return s


def test_tokens_are_split_by_the_version_that_generated_them():
    """Sample 0 spans an in-flight update (version 4 for tokens 0-1, then 5), sample 1 is all version 5; the
    trainer is at version 5. With |trainer - rollout| 1 on version-4 tokens and 0.1 on version-5 ones (0.2
    unreplayed), the older tokens read 1.0 and the current ones 0.1 (0.2 unreplayed). Fails if a sample is split
    by its oldest version only or capped by the version its request was sent under (sample 0's current tokens
    would count as older) or the two passes are swapped."""
    samples = [sample(0, [("4", 0, 2), ("5", 2, 4)]), sample(1, [("5", 0, 4)])]
    gap = [np.array([1.0, 1.0, 0.1, 0.1]), np.full(4, 0.1)]
    replayed = LogprobResult([g.astype(np.float32) for g in gap], np.zeros(2), True, 0)
    unreplayed = LogprobResult([np.where(g < 1, 0.2, 1.0).astype(np.float32) for g in gap], np.zeros(2), None, 0)
    got = version_token_mismatch(samples, 5, replayed, unreplayed)
    assert got[M.LOGPROB_ABS_DIFF_VERSION_TOKENS.format(which="older")] == pytest.approx(1.0)
    assert got[M.LOGPROB_ABS_DIFF_VERSION_TOKENS.format(which="current")] == pytest.approx(0.1)
    assert got[M.LOGPROB_ABS_DIFF_NO_REPLAY_VERSION_TOKENS.format(which="current")] == pytest.approx(0.2)
    # without the paired pass, only the replayed figures; without older tokens, no older figure
    one = LogprobResult([gap[1].astype(np.float32)], np.zeros(2), True, 0)
    fresh = version_token_mismatch(samples[1:], 5, one, None)
    assert set(fresh) == {M.LOGPROB_ABS_DIFF_VERSION_TOKENS.format(which="current")}
