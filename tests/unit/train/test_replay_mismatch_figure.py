"""The reading of the R3 replay check the step logs (``LogprobResult.replay_mismatch_figure``): a count is logged as it is,
and a check that saw no row is NaN, never a pass."""

from __future__ import annotations

import math

import numpy as np

from r3rl.train.logprob_pass import LogprobResult


def result(mismatches: int, matched: bool | None) -> LogprobResult:
    return LogprobResult([np.zeros(3, np.float32)], np.zeros(4), matched, mismatches)


def figure(r: LogprobResult) -> float:
    return r.replay_mismatch_figure


def test_a_nonzero_count_is_logged_as_it_is():
    """Fails if the figure is the check as a flag (1.0) or as 0 whenever ``replayed_routes_match`` is False."""
    assert figure(result(7, False)) == 7.0


def test_a_pass_is_zero_and_a_check_without_rows_is_nan():
    """``replayed_routes_match`` False with 0 mismatches means some layer saw no replayed row: NaN, so a dashboard
    never reads it as a pass. Fails if it returns the bare count (0.0) there, or NaN for a real pass."""
    assert figure(result(0, True)) == 0.0
    assert math.isnan(figure(result(0, False)))
    assert math.isnan(figure(result(0, None)))
