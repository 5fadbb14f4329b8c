"""The comparison panels, defined once for the W&B report and for the local plots."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from r3rl import metrics as M
from r3rl.tracking.summary import lagged_steps

LAG_NOTE = " (max_staleness >= 1: mixed with policy lag)"


@dataclass(frozen=True)
class Panel:
    title: str
    x: str  # the step axis of the panel's metrics
    keys: tuple[str, ...] = ()  # metrics drawn when present
    pattern: str | None = None  # or a family of metrics (one per layer, one per stage)
    y_label: str = ""
    # one step off-policy the replayed routes are the older weights' choices in the newer weights: the figures then
    # hold the policy lag too (said in the title only where a compared run trained on older samples)
    lag_mixed: bool = False

    def title_for(self, runs: Sequence) -> str:
        """The title, with the policy-lag note where it applies to one of ``runs``."""
        lagged = self.lag_mixed and any(lagged_steps(r.history) for r in runs)
        return self.title + (LAG_NOTE if lagged else "")

    def has_data(self, runs: Sequence) -> bool:
        return any(self.select(r.metric_keys()) for r in runs)

    def select(self, available: Iterable[str]) -> list[str]:
        """The panel's metrics among ``available``, in a stable order (families sorted by name)."""
        names = set(available)
        out = [k for k in self.keys if k in names]
        if self.pattern is not None:
            rx = re.compile(self.pattern)
            out += sorted(k for k in names if rx.fullmatch(k) and k not in out)
        return out


PANELS: tuple[Panel, ...] = (
    # only the fresh samples' figure (train/logprob_abs_diff_fresh) is then the engine's mismatch alone
    Panel("Log-prob |trainer - rollout|: with vs without R3 replay",
          M.STEP_AXES["train"], keys=(M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY, M.LOGPROB_ABS_DIFF_FRESH),
          y_label="mean |log-prob diff| (band: ±1 stderr)", lag_mixed=True),
    Panel("Routing flip rate per layer", M.STEP_AXES["r3"], keys=(M.ROUTING_FLIP_RATE,),
          pattern=r"r3/routing_flip_rate/layer_\d+", y_label="share of tokens", lag_mixed=True),
    # multi-turn episodes (env=calculator, reflect): replay must shrink turn 2's mismatch as much as turn 1's
    Panel("Log-prob |trainer - rollout| per turn of multi-turn episodes: with vs without R3 replay",
          M.STEP_AXES["train"], pattern=r"train/logprob_abs_diff(_no_replay)?/turn_\d+",
          y_label="mean |log-prob diff| over the turn's policy tokens"),
    Panel("Token mult prob error (NeMo-RL)", M.STEP_AXES["train"], keys=(M.TOKEN_MULT_PROB_ERROR,),
          y_label="mean exp(|log-prob diff|)"),
    Panel("Rollout correction: IS weights pi_old / pi_rollout", M.STEP_AXES["rollout_corr"],
          keys=(M.ROLLOUT_IS_MEAN, M.ROLLOUT_IS_ESS), y_label="mean weight, effective sample size"),
    Panel("Rollout correction: dropped and extreme tokens", M.STEP_AXES["rollout_corr"],
          keys=(M.ROLLOUT_RS_MASKED_FRACTION, M.ROLLOUT_IS_FRACTION_HIGH, M.ROLLOUT_IS_FRACTION_LOW,
                M.EXTREME_TOKEN_FRACTION), y_label="share of tokens"),
    Panel("Eval accuracy (held-out sets): avg@k and pass@k", M.STEP_AXES["eval"],
          pattern=r"eval/.+/(avg|pass)@\d+", y_label="share correct"),
    Panel("Reward", M.STEP_AXES["rollout"], keys=(M.REWARD_MEAN,), y_label="mean reward"),
    Panel("Perf: time per stage", M.STEP_AXES["perf"], keys=(M.PERF_STEP_TIME,), pattern=r"perf/.+_time_s",
          y_label="seconds"),
)

# An SFT run (recipes/sft.py): its loss and gradient norm, the same eval panel as GRPO's, and the time per stage.
SFT_PANELS: tuple[Panel, ...] = (
    Panel("SFT loss: mean NLL of the response tokens", M.STEP_AXES["sft"], keys=(M.SFT_LOSS,), y_label="nats/token"),
    Panel("SFT gradient norm", M.STEP_AXES["sft"], keys=(M.SFT_GRAD_NORM,), y_label="global norm"),
    Panel("Eval accuracy (held-out sets): avg@k and pass@k", M.STEP_AXES["eval"],
          pattern=r"eval/.+/(avg|pass)@\d+", y_label="share correct"),
    Panel("Perf: time per stage", M.STEP_AXES["perf"], keys=(M.PERF_STEP_TIME,), pattern=r"perf/.+_time_s",
          y_label="seconds"),
)
