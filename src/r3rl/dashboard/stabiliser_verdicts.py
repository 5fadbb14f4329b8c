"""The stabiliser grid's verdicts: each claim of docs/stabilisers.md read off the grid's runs
(``r3rl.dashboard.stabilisers.GridRow``), with the difference it rests on and a word that says what the data allow.

How a difference between two setups is measured (``gap``):
- only on the rollout seeds both ran: a seed is a training trajectory, and a gap against an arm that ran another
  seed would be partly that seed's;
- per seed, paired by eval prompt: every run of the grid starts from one warm start and one "before" evaluation, so
  the difference of two gains is the per-prompt difference of the two runs' changes, and its standard error is that
  of the mean per-prompt difference clustered by problem (not the two gains' errors combined as if independent);
- over several shared seeds, the mean of the per-seed gaps, with the larger of their combined errors and their
  spread between seeds (one seed cannot show the spread between trajectories; the docs say so).

The words (``EQUIVALENCE_MARGIN`` is stated wherever they are printed):
- a claim that two setups do alike is "supported" only when the whole interval d +- 2 se lies within +- the margin,
  "not supported" when the whole interval lies beyond it (either way), and "not measurable" otherwise;
- a claim that one setup is ahead is "supported" when it is ahead by more than 2 se, "not supported" when even the
  top of its interval (d + 2 se) is below the margin, and "not measurable" otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from r3rl import metrics as M

# held-out avg@4: a difference smaller than this is one a user would not act on (a third of what 16 steps of the
# grid gain from the warm start, about +0.12 to +0.18)
EQUIVALENCE_MARGIN = 0.05


@dataclass(frozen=True)
class Gap:
    diff: float  # held-out gain of a minus b
    se: float
    seeds: tuple[int, ...]  # the rollout seeds both ran


def _rows(rows: Sequence, label: str, mini_batches: float) -> list:
    return [r for r in rows if r.label == label and r.mini_batches == mini_batches]


def arm(rows: Sequence, label: str, mini_batches: float):
    """The one run of ``label`` at ``mini_batches`` on the first seed (the row a claim quotes figures from)."""
    found = _rows(rows, label, mini_batches)
    if not found:
        raise KeyError(f"the grid has no run {label!r} at {mini_batches:g} mini-batches")
    return min(found, key=lambda r: r.seed)


def _seed_gap(a, b) -> tuple[float, float]:
    """One seed: the mean per-prompt difference of the two runs' gains, clustered by problem; without per-prompt
    records, the two gains' difference with their errors combined (no pairing possible)."""
    if a.prompt_gains and b.prompt_gains:
        if a.problems != b.problems:
            raise ValueError(f"runs {a.label!r} and {b.label!r} (seed {a.seed}) were evaluated on other prompts: "
                             "their gains cannot be paired")
        return M.mean_and_stderr(np.subtract(a.prompt_gains, b.prompt_gains), a.problems)
    return a.gain - b.gain, math.hypot(a.gain_se, b.gain_se)


def gap(rows: Sequence, a: tuple[str, float], b: tuple[str, float]) -> Gap:
    """Held-out gain of arm ``a`` minus arm ``b`` ((label, mini-batches) each), on the seeds both ran."""
    runs_a = {r.seed: r for r in _rows(rows, *a)}
    runs_b = {r.seed: r for r in _rows(rows, *b)}
    seeds = tuple(sorted(set(runs_a) & set(runs_b)))
    if not seeds:
        raise ValueError(f"arms {a} and {b} share no rollout seed (seeds {sorted(runs_a)} and {sorted(runs_b)}): "
                         "a difference between them would be partly the seeds'")
    per_seed = [_seed_gap(runs_a[s], runs_b[s]) for s in seeds]
    diffs = [d for d, _ in per_seed]
    mean = sum(diffs) / len(diffs)
    within = math.sqrt(sum(se ** 2 for _, se in per_seed)) / len(per_seed)
    if len(per_seed) < 2:
        return Gap(mean, within, seeds)
    between = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    return Gap(mean, max(within, between), seeds)


def alike(g: Gap, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The word for a claim that the two arms of ``g`` do alike (an equivalence test: both ends of the interval)."""
    if abs(g.diff) + 2 * g.se <= margin:
        return "supported"
    if abs(g.diff) - 2 * g.se > margin:
        return "not supported"
    return "not measurable"


def ahead(g: Gap, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The word for a claim that the first arm of ``g`` is ahead of the second."""
    if g.diff > 2 * g.se:
        return "supported"
    if g.diff + 2 * g.se < margin:
        return "not supported"
    return "not measurable"


def _fmt(g: Gap) -> str:
    seeds = "seed" if len(g.seeds) == 1 else "seeds"
    return f"{g.diff:+.3f} +- {g.se:.3f} ({seeds} {', '.join(map(str, g.seeds))})"


def verdicts(rows: Sequence, margin: float = EQUIVALENCE_MARGIN) -> list[str]:
    """One line per claim: the difference it rests on and supported / not supported / not measurable."""
    out = []
    r3 = {mb: arm(rows, "R3", mb) for mb in (1, 2, 4)}
    r2 = {mb: arm(rows, "R2", mb) for mb in (2, 4)}
    g = gap(rows, ("R3", 1), ("none", 1))
    out.append(f"Qwen: on-policy (1 mini-batch, TIS on) needs neither R2 nor R3. R3 leaves {r3[1].mismatch:.2e} of "
               f"{r3[1].unreplayed:.2e} mismatch; R3 - none held-out gain {_fmt(g)}: {alike(g, margin)}")
    g = gap(rows, ("R3", 2), ("R2", 2))
    out.append(f"Qwen: R2 suffices at 2 mini-batches. Later-mini-batch mismatch R3/R2 {r3[2].later / r2[2].later:.2f}; "
               f"R3 - R2 held-out gain {_fmt(g)}: {alike(g, margin)}")
    g, g0 = gap(rows, ("R3", 4), ("R2", 4)), gap(rows, ("R3", 4), ("none", 4))
    words = {ahead(g, margin), ahead(g0, margin)}
    word = "supported" if "supported" in words else "not supported" if words == {"not supported"} else \
        "not measurable"
    out.append(f"Qwen: R3 pays from 4 mini-batches on. Later-mini-batch mismatch R3/R2 {r3[4].later / r2[4].later:.2f}; "
               f"R3 - R2 held-out gain {_fmt(g)}, R3 - none {_fmt(g0)}: {word}")
    for other in ("GSPO", "TIS"):
        g = gap(rows, ("R3", 4), (other, 4))
        out.append(f"R3 paper: R3 ahead of {other}. R3 - {other} held-out gain at 4 mini-batches {_fmt(g)}: "
                   f"{ahead(g, margin)}")
    soft = arm(rows, "soft 0.5", 4)
    g = gap(rows, ("soft 0.5", 4), ("R3", 4))
    out.append(f"prime-rl #2703: soft replay at ratio 0.5 does as R3 does. It replaces {soft.replace_rate:.2g} of "
               f"replayed experts; mismatch {soft.mismatch:.2e} against R3's {r3[4].mismatch:.2e} and "
               f"{soft.unreplayed:.2e} unreplayed; soft - R3 held-out gain {_fmt(g)}: {alike(g, margin)}")
    frozen, none = arm(rows, "frozen router", 4), arm(rows, "none", 4)
    g = gap(rows, ("frozen router", 4), ("none", 4))
    out.append(f"folk remedy: a frozen router costs nothing. Mismatch {frozen.mismatch:.2e} (later mini-batches "
               f"{frozen.later:.2e}) against {none.mismatch:.2e} ({none.later:.2e}) with the router training; "
               f"none - frozen held-out gain {-g.diff:+.3f} +- {g.se:.3f}: {alike(Gap(-g.diff, g.se, g.seeds), margin)}")
    return out
