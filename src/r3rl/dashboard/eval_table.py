"""The R3-on vs R3-off table of the claim R3 makes: the mismatch goes down and accuracy does not suffer.

One row per figure, one column per run: the mean log-prob mismatch over steps (with and without replay), what replay
removes from it (the paired figure, ± its standard error clustered by prompt), then every
eval set's avg@k and pass@k at the run's first and last eval point (baseline and end of training).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from r3rl import metrics as M
from r3rl.tracking.offline_reader import OfflineRun
from r3rl.tracking.summary import fmt_cell, lagged_steps, replay_removes, summarize

_ACCURACY = re.compile(r"eval/.+/(avg|pass)@\d+")


def _point(run: OfflineRun, key: str, last: bool) -> str:
    steps, values = run.series(key)
    if not steps:
        return ""
    i = -1 if last else 0
    v = values[i]
    return f"{'nan' if v is None or math.isnan(v) else f'{v:.3f}'} (step {steps[i]})"


def mismatch_and_eval(runs: Sequence[OfflineRun]) -> list[tuple[str, list[str]]]:
    """(figure, one cell per run) rows: the mismatch, what replay removes (paired), and the eval points."""
    accuracy = sorted({k for r in runs for k in r.metric_keys() if _ACCURACY.fullmatch(k)})
    rows = []
    for key in (M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY):
        stats = [summarize(r.history, keys=(key,)) for r in runs]
        if any(key in s for s in stats):
            rows.append((f"{key} (mean over steps)", [fmt_cell(s[key], "mean") if key in s else "" for s in stats]))
    removed = [replay_removes(r.history) for r in runs]
    if any(removed):
        # one step off-policy it also holds the policy lag (r3rl.tracking.summary.lagged_steps): no clean R3 figure
        rows.append(("replay removes, paired (± se clustered by prompt)",
                     [f"{x[0]:.4g} ± {x[1]:.2g}" + (" (mixed with policy lag)" if lagged_steps(r.history) else "")
                      if x else "" for x, r in zip(removed, runs)]))
    for key in accuracy:
        rows.append((f"{key} first", [_point(r, key, last=False) for r in runs]))
        rows.append((f"{key} last", [_point(r, key, last=True) for r in runs]))
    return rows
