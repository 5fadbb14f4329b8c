"""One row per run of the stabilisers a run used and what they did: replay (none, R2, R3, soft), rollout correction,
loss (GRPO, GSPO), router frozen or not, optimizer mini-batches per rollout batch; then the in-turn mismatch
(replayed and unreplayed), the later mini-batches' mismatch against the rollout, the IS-ratio spread, the clip
fraction, gradient-norm spikes, the held-out gain with its clustered standard error, and the step time as a ratio
to the first run's. ``bench/stability_grid.py`` prints it; ``python -m r3rl.dashboard --runs ...`` shows it."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from r3rl import metrics as M
from r3rl.eval.records import paired_gain, prompt_changes, record_path
from r3rl.tracking.offline_reader import OfflineRun
from r3rl.tracking.summary import summarize

# a step whose largest gradient norm exceeds this multiple of the run's median step norm is a spike
SPIKE_FACTOR = 3.0
_AVG = re.compile(r"eval/(.+)/avg@\d+")


@dataclass(frozen=True)
class GridRow:
    label: str
    replay: str  # none | r2 | r3 | soft <ratio>
    correction: str
    loss: str
    frozen: bool
    mini_batches: float
    seed: int  # rollout.sampling.seed: another seed is another training trajectory
    mismatch: float  # train/logprob_abs_diff, mean over steps: pi_old (replayed where the run replays) vs rollout
    unreplayed: float  # the same batch without replay (R3 and soft), else the mismatch itself
    later: float  # train/later_minibatch_logprob_abs_diff (NaN with one mini-batch)
    is_std: float
    clip_frac: float
    spikes: int
    grad_norm_max: float
    replace_rate: float  # soft replay only
    gain: float  # held-out avg@k, last eval point minus first
    gain_se: float
    step_time: float  # seconds per step, mean
    # per eval prompt (index order), its avg@k change and its problem: what pairs two runs' gains
    # (r3rl.dashboard.stabiliser_verdicts); empty without the run's eval records
    prompt_gains: tuple[float, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def setup(self) -> str:
        parts = [self.replay, self.loss]
        if self.correction != "none":
            parts.append(self.correction)
        if self.frozen:
            parts.append("frozen router")
        return ", ".join(parts)


def _mean(run: OfflineRun, key: str) -> float:
    return summarize(run.history, keys=(key,)).get(key, {}).get("mean", math.nan)


def held_out_gain(run: OfflineRun) -> tuple[float, float, tuple[float, ...], tuple[str, ...]]:
    """The first eval set's avg@k at the last eval point minus the first, ± the standard error of the mean per-prompt
    change clustered by problem, and the per-prompt changes with their problems (the run folder's eval records); the
    two points' errors combined and no per-prompt changes without the records."""
    key = next((k for k in sorted(run.metric_keys()) if _AVG.fullmatch(k)), None)
    if key is None:
        return math.nan, math.nan, (), ()
    steps, values = run.series(key)
    if len(steps) < 2:
        return math.nan, math.nan, (), ()
    folder = Path(run.config.get("run", {}).get("output_dir", "")) / "eval"
    name = _AVG.fullmatch(key).group(1)
    if record_path(folder, name, steps[0]).is_file() and record_path(folder, name, steps[-1]).is_file():
        gain, se, _ = paired_gain(folder, name, steps[0], steps[-1])
        changes, problems = prompt_changes(folder, name, steps[0], steps[-1])
        return gain, se, tuple(changes), tuple(problems)
    _, errors = run.series(key + "_stderr")
    se = math.hypot(errors[0], errors[-1]) if len(errors) >= 2 else math.nan
    return values[-1] - values[0], se, (), ()


def grid_row(run: OfflineRun, label: str | None = None) -> GridRow:
    cfg = run.config
    replay = run.replay or "?"  # the run's replay:<mode> tag (soft replay is tagged r3)
    if cfg.get("replay", {}).get("name") == "soft":
        replay = f"soft {cfg['replay'].get('soft_ratio')}"
    alg = cfg.get("algorithm", {})
    batch = alg.get("rollout_batch_size", math.nan) * alg.get("n_samples_per_prompt", math.nan)
    norms = [v for v in run.series(M.GRAD_NORM)[1] if v is not None and not math.isnan(v)]
    peaks = [v for v in run.series("train/grad_norm_max")[1] if v is not None and not math.isnan(v)]
    median = statistics.median(norms) if norms else math.nan
    mismatch = _mean(run, M.LOGPROB_ABS_DIFF)
    unreplayed = _mean(run, M.LOGPROB_ABS_DIFF_NO_REPLAY)
    gain, se, prompt_gains, problems = held_out_gain(run)
    return GridRow(
        label=label or run.name, replay=replay, correction=cfg.get("correction", {}).get("name", "?"),
        loss=alg.get("loss", "grpo"), frozen=bool(cfg.get("trainer", {}).get("freeze_router", False)),
        mini_batches=batch / alg.get("global_batch_size", math.nan),
        seed=int(cfg.get("rollout", {}).get("sampling", {}).get("seed", -1)),
        mismatch=mismatch, unreplayed=mismatch if math.isnan(unreplayed) else unreplayed,
        later=_mean(run, "train/later_minibatch_logprob_abs_diff"), is_std=_mean(run, M.ROLLOUT_IS_STD),
        clip_frac=_mean(run, "train/clip_frac"), spikes=sum(p > SPIKE_FACTOR * median for p in peaks),
        grad_norm_max=max(peaks, default=math.nan), replace_rate=_mean(run, "train/router_replay_replace_rate"),
        gain=gain, gain_se=se, step_time=_mean(run, M.PERF_STEP_TIME), prompt_gains=prompt_gains,
        problems=problems)


def grid_rows(runs: Sequence[OfflineRun], labels: Sequence[str] | None = None) -> list[GridRow]:
    return [grid_row(r, labels[i] if labels else None) for i, r in enumerate(runs)]


COLUMNS = ("run", "setup", "mini-batches", "seed", "mismatch", "unreplayed", "later mini-batches", "IS std", "clip frac",
           "grad spikes (max)", "replace rate", "held-out gain ± se", "step time")


def cells(rows: Sequence[GridRow]) -> list[list[str]]:
    """Each row's cells under ``COLUMNS`` (step time as a ratio to the first row's)."""
    base = rows[0].step_time if rows else math.nan

    def f(v: float, spec: str) -> str:
        return "-" if v is None or math.isnan(v) else format(v, spec)

    return [[r.label, r.setup, f(r.mini_batches, "g"), str(r.seed), f(r.mismatch, ".2e"), f(r.unreplayed, ".2e"),
             f(r.later, ".2e"), f(r.is_std, ".4f"), f(r.clip_frac, ".4f"), f"{r.spikes} ({f(r.grad_norm_max, '.3g')})",
             "-" if math.isnan(r.replace_rate) else f"{r.replace_rate * 100:.2g}%",
             f"{f(r.gain, '+.3f')} ± {f(r.gain_se, '.3f')}", f(r.step_time / base, ".2f")]
            for r in rows]


def render_table(rows: Sequence[GridRow]) -> str:
    """A Markdown table, one row per run."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c) + " |" for c in cells(rows)]
    return "\n".join(lines)
