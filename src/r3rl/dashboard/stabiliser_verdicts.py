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

The words (``EQUIVALENCE_MARGIN`` and ``MIN_SEEDS`` are stated wherever they are printed), one rule for every
claim: a gap's interval is d +- k se, where k is Student's t at the seeds less one for the normal's two-sided
2-sigma level (k = 2 with many seeds, 4.5 at three), and the interval is read against the margin:
- fewer than ``MIN_SEEDS`` shared seeds: "not measurable", with the count. A seed is a trajectory; with one the
  spread between trajectories is unknown, with two it rests on one degree of freedom;
- a claim that two setups do alike is "supported" when the whole interval lies within +- the margin, "not
  supported" when it lies wholly beyond it (either way), "not measurable" otherwise;
- a claim that one setup is ahead (by a difference a user would act on) is "supported" when the whole interval lies
  above the margin, "not supported" when it lies wholly below, "not measurable" otherwise;
- a claim over several gaps ("R3 pays from 4": ahead of R2 and of no replay) is supported only when each is, not
  supported when any is not, and not measurable otherwise.
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
# shared rollout seeds a verdict needs: with fewer the between-trajectory spread has under two degrees of freedom
MIN_SEEDS = 3
# the normal's one-sided tail beyond 2 sigma: the level every interval is drawn at, whatever the seed count
TWO_SIGMA_TAIL = 0.5 * math.erfc(2 / math.sqrt(2))


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


def half_width(g: Gap) -> float:
    """k se: Student's t at the shared seeds less one for the 2-sigma tail, times the gap's error."""
    return M.t_isf(TWO_SIGMA_TAIL, len(g.seeds) - 1) * g.se


def too_few_seeds(g: Gap) -> str | None:
    n = len(g.seeds)
    if n < MIN_SEEDS:
        return f"not measurable ({n} shared seed{'s' if n != 1 else ''}; a verdict needs {MIN_SEEDS})"
    return None


def alike(g: Gap, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The word for a claim that the two arms of ``g`` do alike (an equivalence test: both ends of the interval)."""
    if (few := too_few_seeds(g)) is not None:
        return few
    if abs(g.diff) + half_width(g) <= margin:
        return "supported"
    if abs(g.diff) - half_width(g) > margin:
        return "not supported"
    return "not measurable"


def ahead(g: Gap, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The word for a claim that the first arm of ``g`` is ahead of the second by more than the margin."""
    if (few := too_few_seeds(g)) is not None:
        return few
    if g.diff - half_width(g) > margin:
        return "supported"
    if g.diff + half_width(g) < margin:
        return "not supported"
    return "not measurable"


def all_of(words: Sequence[str]) -> str:
    """One word for a claim that needs each of its gaps: supported when all are, not supported when any is not."""
    if all(w == "supported" for w in words):
        return "supported"
    if "not supported" in words:
        return "not supported"
    return next((w for w in words if w.startswith("not measurable (")), "not measurable")


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
    word = all_of([ahead(g, margin), ahead(g0, margin)])
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
