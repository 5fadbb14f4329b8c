"""The figure a newcomer sees first: the held-out score and the train-rollout mismatch of runs with R3 on and off,
side by side (``headline.png``, on the docs' home page and the README). The nine panels stay in ``comparison.png``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from r3rl import metrics as M
from r3rl.dashboard.local import _COLOURS, _REPLAY_STYLES, _short_label, _stderr_band, plt
from r3rl.tracking.offline_reader import OfflineRun

# the per-step mismatch moves by its sampling noise from step to step: a running mean over this many steps shows
# the level each run holds (the per-step figures are drawn faint behind it)
SMOOTHING_STEPS = 5


def held_out_key(run: OfflineRun) -> str | None:
    """The run's first held-out avg@k key (``eval/<set>/avg@k``)."""
    return next((k for k in sorted(run.metric_keys()) if k.startswith("eval/") and "/avg@" in k
                 and not k.endswith("_stderr")), None)


def running_mean(values: Sequence[float], window: int) -> np.ndarray:
    """The mean of each value with the ``window - 1`` before it (fewer at the start)."""
    x = np.asarray(values, dtype=np.float64)
    sums = np.cumsum(np.insert(x, 0, 0.0))
    starts = np.maximum(np.arange(1, len(x) + 1) - window, 0)
    return (sums[1:] - sums[starts]) / (np.arange(1, len(x) + 1) - starts)


def write_headline(runs: Sequence[OfflineRun], path: Path) -> Path:
    """Held-out avg@k (± one standard error, clustered by problem) per eval point, and ``train/logprob_abs_diff``
    per step with its running mean, one colour per run and R3 on solid, off dashed."""
    fig, (score, mismatch) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    try:
        for i, run in enumerate(runs):
            colour, _ = _COLOURS[i % len(_COLOURS)]
            style, label = _REPLAY_STYLES.get(run.replay, ":"), _short_label(run, runs)
            if (key := held_out_key(run)) is not None:
                steps, ys = run.series(key)
                score.plot(steps, ys, style, color=colour, marker="o", label=f"{label} ({key.split('/')[-1]})")
                _stderr_band(score, run, key, steps, ys, colour)
            steps, ys = run.series(M.LOGPROB_ABS_DIFF)
            if steps:
                mismatch.plot(steps, ys, style, color=colour, alpha=0.25, linewidth=0.8)
                mismatch.plot(steps, running_mean(ys, SMOOTHING_STEPS), style, color=colour, linewidth=2,
                              label=f"{label}")
        score.set_title("Held-out score (band: ±1 standard error, clustered by problem)", fontsize=10)
        score.set_xlabel("training step")
        score.set_ylabel("share correct")
        mismatch.set_title(f"Train-rollout mismatch ({SMOOTHING_STEPS}-step running mean; faint: per step)",
                           fontsize=10)
        mismatch.set_xlabel("training step")
        mismatch.set_ylabel("mean |log-prob trainer - rollout|")
        for ax in (score, mismatch):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
