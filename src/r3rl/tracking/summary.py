"""The table printed at the end of a run: the key metrics over the steps logged.

A figure with a standard error (``metrics.stderr_of``: clustered by prompt, by problem for eval) shows it next to
it: per step for first and last, and for the mean over steps the standard error of that mean (steps are independent
batches: sqrt(sum of squared per-step errors) / steps).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from r3rl import metrics as M

KEY_METRICS: tuple[str, ...] = (
    M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY, M.LOGPROB_ABS_DIFF_PAIRED_DELTA, M.LOGPROB_ABS_DIFF_FRESH,
    M.TOKEN_MULT_PROB_ERROR, M.K3_KL, M.ROUTING_FLIP_RATE, M.ROUTER_MARGIN_SMALL_SHARE, M.EXPERT_LOAD_MAX_VIO,
    M.REPLAY_MISMATCH_ROWS, M.REWARD_MEAN, M.GENERATION_ROUNDS, M.STALENESS_MEAN, M.RESPONSE_LENGTH_MEAN, M.LOSS,
    M.GRAD_NORM, M.PERF_STEP_TIME, M.PERF_TOKENS_PER_S, M.SFT_LOSS, M.SFT_GRAD_NORM, M.SFT_TOKENS_PER_S,
)
REPLAY_RATIO = "logprob_abs_diff replay / no replay"
# multi-turn runs: the episode counters, and the mismatch of each turn with and without replay
EPISODE_METRICS: tuple[str, ...] = (M.TURNS_MEAN, M.TOOL_CALLS_MEAN, M.TOOL_ERRORS, M.CONTEXT_TRUNCATED,
                                    M.EPISODES_MASKED)
_TURN_KEY = re.compile(r"train/logprob_abs_diff(_no_replay)?/turn_\d+")
# the eval figures of every set a run logged (eval/<set>/avg@k, pass@k, truncated_share), after the key metrics
_EVAL_KEY = re.compile(r"eval/.+/((avg|pass)@\d+|truncated_share)")


def key_metrics(history: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """``KEY_METRICS``, the episode figures of a multi-turn run (per turn: replayed, then unreplayed) and the eval
    figures present in ``history``."""
    present = {k for row in history for k in row}
    turns = sorted((k for k in present if _TURN_KEY.fullmatch(k)),
                   key=lambda k: (int(k.rsplit("_", 1)[1]), "no_replay" in k))
    evals = sorted(k for k in present if _EVAL_KEY.fullmatch(k))
    return (*KEY_METRICS, *(k for k in EPISODE_METRICS if k in present), *turns, *evals)


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


def fmt_cell(stats: Mapping[str, float], col: str) -> str:
    """One cell of the table: the value, with `` ± stderr`` when the figure has one."""
    se = stats.get(f"{col}_stderr")
    return _fmt(stats[col]) if se is None else f"{_fmt(stats[col])} ± {_fmt(se)}"


def summarize(history: Sequence[Mapping[str, Any]],
              keys: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Per key metric present in ``history``: steps, first, last, mean, min, max (NaN steps left out of the stats),
    and for a figure with a standard error ``first_stderr``, ``last_stderr`` and ``mean_stderr``."""
    out: dict[str, dict[str, float]] = {}
    for key in key_metrics(history) if keys is None else keys:
        rows = [row for row in history if key in row]
        values = [float(row[key]) for row in rows]
        finite = [v for v in values if not math.isnan(v)]
        if not values:
            continue
        out[key] = {
            "steps": len(values), "first": values[0], "last": values[-1],
            "mean": sum(finite) / len(finite) if finite else math.nan,
            "min": min(finite) if finite else math.nan, "max": max(finite) if finite else math.nan,
        }
        se_key = M.stderr_of(key)
        if se_key is not None and all(se_key in row for row in rows):
            errors = [float(row[se_key]) for row in rows]
            kept = [e for v, e in zip(values, errors) if not math.isnan(v)]
            out[key].update(first_stderr=errors[0], last_stderr=errors[-1],
                            mean_stderr=math.sqrt(sum(e * e for e in kept)) / len(kept) if kept else math.nan)
    if M.LOGPROB_ABS_DIFF in out and M.LOGPROB_ABS_DIFF_NO_REPLAY in out:
        ratios = [row[M.LOGPROB_ABS_DIFF] / row[M.LOGPROB_ABS_DIFF_NO_REPLAY] for row in history
                  if row.get(M.LOGPROB_ABS_DIFF_NO_REPLAY) and M.LOGPROB_ABS_DIFF in row]
        ratios = [r for r in ratios if not math.isnan(r)]
        if ratios:
            out[REPLAY_RATIO] = {"steps": len(ratios), "first": ratios[0], "last": ratios[-1],
                                 "mean": sum(ratios) / len(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def replay_removes(history: Sequence[Mapping[str, Any]]) -> tuple[float, float, int] | None:
    """What R3's replay removes from the per-sample mismatch: minus the mean over steps of
    ``train/logprob_abs_diff_paired_delta`` (replayed - unreplayed, per sample, on the same batch), its standard error
    (each step's clustered by prompt, steps independent) and the steps it covers; None for a run without the paired
    pass (R3 off, R2)."""
    key = M.LOGPROB_ABS_DIFF_PAIRED_DELTA
    s = summarize(history, keys=(key,)).get(key)
    if s is None or math.isnan(s["mean"]) or "mean_stderr" not in s:
        return None
    return -s["mean"], s["mean_stderr"], int(s["steps"])


def lagged_steps(history: Sequence[Mapping[str, Any]]) -> int:
    """Steps that trained on samples older than the trainer's weights (``algorithm.max_staleness >= 1``). Their
    mismatch figures, the paired delta and the flip rate mix two things: the engine's mismatch and the policy lag
    (the replayed routes are the older weights' choices, put into the newer weights)."""
    return sum(1 for row in history if row.get(M.STALENESS_MEAN, 0.0) > 0)


MIXED_NOTE = ("mixes engine mismatch with policy lag (samples of older weights): not a clean measure of R3; "
              f"{M.LOGPROB_ABS_DIFF_FRESH} is the engine's mismatch alone, where logged")


def replay_removes_text(history: Sequence[Mapping[str, Any]]) -> str | None:
    """``replay removes X ± se of |log-prob diff| per sample (...)``, the headline of an R3 run; None without one.
    Said to be mixed when any step trained on samples of older weights."""
    found = replay_removes(history)
    if found is None:
        return None
    removed, se, steps = found
    z = f", {removed / se:.1f} se" if se > 0 else ""
    lagged = lagged_steps(history)
    mixed = f"; on {lagged} of them it {MIXED_NOTE}" if lagged else ""
    return (f"replay removes {removed:.4g} ± {se:.2g} of |log-prob diff| per sample (paired on the same batch, "
            f"standard error clustered by prompt{z}; {steps} step{'s' if steps != 1 else ''}{mixed})")


def print_summary(history: Sequence[Mapping[str, Any]], console: Console | None = None,
                  title: str = "r3rl run summary") -> Table:
    """Print the key metrics of ``history`` (rows of one step each, as ``WandbLogger.history`` or ``read_run``
    give them) as a rich table, and return the table."""
    stats = summarize(history)
    trained = sum(1 for row in history if any(k in row for k in KEY_METRICS))  # not the eval baseline (step 0)
    table = Table(title=f"{title} ({trained} steps)")
    table.add_column("metric", style="bold")
    for col in ("steps", "first", "last", "mean", "min", "max"):
        table.add_column(col, justify="right")
    for key, s in stats.items():
        table.add_row(key, str(int(s["steps"])), *(fmt_cell(s, c) for c in ("first", "last", "mean", "min", "max")))
    if not stats:
        table.add_row("(no key metric logged)", "", "", "", "", "", "")
    console = console or Console()
    console.print(table)
    if (headline := replay_removes_text(history)) is not None:
        console.print(headline)
    elif lagged := lagged_steps(history):
        console.print(f"train/logprob_abs_diff* and r3/routing_flip_rate on {lagged} steps: {MIXED_NOTE}")
    return table
