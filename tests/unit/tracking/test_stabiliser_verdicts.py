"""The stabiliser grid's verdicts (``r3rl.dashboard.stabiliser_verdicts``) on synthetic rows: gaps on shared seeds,
paired by prompt, and words that need an equivalence margin met."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3rl import metrics as M
from r3rl.dashboard.stabiliser_verdicts import TWO_SIGMA_TAIL, Gap, ahead, alike, all_of, gap, verdicts
from r3rl.dashboard.stabilisers import GridRow

PROBLEMS = tuple(f"p{i // 2}" for i in range(40))  # 20 problems, two restatements each


def row(label: str, mb: float, seed: int, gains, **figures) -> GridRow:
    gains = tuple(float(g) for g in gains)
    base = dict(replay="none", correction="none", loss="grpo", frozen=False, mismatch=1e-3, unreplayed=1.2e-3,
                later=5e-3, is_std=0.01, clip_frac=0.0, spikes=0, grad_norm_max=0.3, replace_rate=math.nan,
                step_time=1.0)
    base.update(figures)
    return GridRow(label=label, mini_batches=mb, seed=seed, gain=float(np.mean(gains)), gain_se=0.03,
                   prompt_gains=gains, problems=PROBLEMS, **base)


def noise(seed: int, scale: float = 0.2) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, len(PROBLEMS))


def test_a_seed_effect_is_not_a_method_effect():
    """Seed 2 gains +0.06 more than seed 1 for every arm; R3 and none ran both seeds, GSPO only seed 1, and the three
    do alike on seed 1. R3 - GSPO must read ~0 (seed 1 only), not the +0.03 a pooling of R3's two seeds against
    GSPO's one would give. Fails if a gap pooled each arm over its own seeds (the bench before issue 58)."""
    shared = noise(1)
    rows = [row("R3", 4, 1, 0.12 + shared), row("R3", 4, 2, 0.18 + shared),
            row("none", 4, 1, 0.12 + shared), row("none", 4, 2, 0.18 + shared),
            row("GSPO", 4, 1, 0.12 + shared)]
    g = gap(rows, ("R3", 4), ("GSPO", 4))
    assert g.seeds == (1,) and g.diff == pytest.approx(0.0, abs=1e-12)
    both = gap(rows, ("R3", 4), ("none", 4))
    assert both.seeds == (1, 2) and both.diff == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="share no rollout seed"):
        gap([row("R3", 4, 2, shared), row("GSPO", 4, 1, shared)], ("R3", 4), ("GSPO", 4))


def test_the_gap_is_paired_by_prompt_and_clustered_by_problem():
    """Two runs from one shared "before": their per-prompt gains share a large prompt effect (which prompts the
    warm start already solved) and differ by +0.03 plus a little per problem. The paired error is that of the
    per-prompt differences clustered by problem, far below hypot of the two runs' own errors. Fails if the error
    combined the runs' errors as if independent (the bench before issue 58), or clustered by prompt (two
    restatements of one problem would count twice)."""
    prompt_effect = noise(3, 0.4)
    small = np.repeat(np.random.default_rng(4).normal(0.0, 0.02, 20), 2)  # one value per problem
    a, b = row("R3", 2, 1, 0.15 + prompt_effect + small), row("R2", 2, 1, 0.12 + prompt_effect)
    g = gap([a, b], ("R3", 2), ("R2", 2))
    diffs = 0.03 + small
    per_problem = diffs.reshape(20, 2).mean(axis=1)
    assert g.diff == pytest.approx(diffs.mean())
    assert g.se == pytest.approx(per_problem.std(ddof=1) / math.sqrt(20), rel=1e-6)
    assert g.se < 0.25 * math.hypot(a.gain_se, b.gain_se)


SEEDS3 = (1, 2, 3)


def test_supported_needs_the_interval_within_the_margin():
    """A claim that two setups do alike: supported only when |d| + k se fits the margin; a gap of 0 with a wide
    error is not measurable. A claim that one is ahead: supported only when d - k se clears the margin, not
    supported when d + k se is under it. Fails if "supported" were printed for any difference under 2 se (the
    bench before issue 58)."""
    k = M.t_isf(TWO_SIGMA_TAIL, 2)
    assert alike(Gap(0.0, 0.01, SEEDS3), 0.05) == "supported"
    assert alike(Gap(0.0, 0.04, SEEDS3), 0.05) == "not measurable"  # under 2 se, but the interval is +-0.18
    assert alike(Gap(0.10, 0.01, SEEDS3), 0.05) == "not supported"
    assert ahead(Gap(0.10, 0.01, SEEDS3), 0.05) == "supported"
    assert ahead(Gap(-0.02, 0.01, SEEDS3), 0.05) == "not supported"
    assert ahead(Gap(0.02, 0.02, SEEDS3), 0.05) == "not measurable"
    assert 4.4 < k < 4.6  # Student's t at 2 degrees of freedom for the normal's 2-sigma tail


def test_ahead_is_read_against_the_margin_like_alike():
    """Ahead by 0.03 +- 0.005 over 5 seeds is a real difference but under the margin a user would act on: "not
    supported" (its whole interval lies below 0.05), where the old rule (d > 2 se) said "supported" and ignored the
    margin (issue 70, item 7). Fails if ahead() went back to d > 2 se."""
    g = Gap(0.03, 0.005, (1, 2, 3, 4, 5))
    assert g.diff > 2 * g.se
    assert ahead(g, 0.05) == "not supported"
    assert ahead(Gap(0.08, 0.005, (1, 2, 3, 4, 5)), 0.05) == "supported"


def test_a_verdict_needs_three_seeds_and_t_width_intervals():
    """One seed cannot show the spread between trajectories, two give it one degree of freedom: both read "not
    measurable" with the count, even where a 2-se interval fits the margin. With three seeds the interval is
    Student's t wide (4.5 se), so 0 +- 0.015 is not measurable where 2 se would have said supported. Fails if a
    verdict were given on one or two seeds (the grid before issue 70, item 8) or the width stayed 2 se."""
    for seeds in ((1,), (1, 2)):
        word = alike(Gap(0.0, 0.001, seeds), 0.05)
        assert word.startswith("not measurable (") and f"{len(seeds)} shared seed" in word, word
        assert ahead(Gap(0.5, 0.001, seeds), 0.05).startswith("not measurable (")
    assert alike(Gap(0.0, 0.015, SEEDS3), 0.05) == "not measurable"
    assert alike(Gap(0.0, 0.015, tuple(range(40))), 0.05) == "supported"


def test_a_claim_over_two_gaps_needs_both():
    """"R3 pays from 4" needs R3 ahead of R2 and of no replay: one supported and one not measurable is not
    measurable, one not supported makes it not supported. Fails if the claim ORed its two tests (issue 70, item 7)."""
    assert all_of(["supported", "not measurable"]) == "not measurable"
    assert all_of(["supported", "not supported"]) == "not supported"
    assert all_of(["supported", "supported"]) == "supported"
    assert all_of(["supported", "not measurable (1 shared seed; a verdict needs 3)"]).startswith("not measurable (")


def grid(r3_gain: float, se_scale: float, seeds=SEEDS3) -> list[GridRow]:
    """Every arm of the bench's grid on each seed; R3 at 4 mini-batches gains ``r3_gain`` more than every other
    arm, per prompt; each seed moves every arm alike (a trajectory), each run has its own per-prompt noise."""
    base = 0.12 + noise(5, 0.3)
    arms = [("none", 1), ("R3", 1), ("none", 2), ("R2", 2), ("R3", 2), ("none", 4), ("R2", 4), ("R3", 4),
            ("soft 0.5", 4), ("TIS", 4), ("GSPO", 4), ("frozen router", 4)]
    rows = []
    for s in seeds:
        for k, (label, mb) in enumerate(arms):
            gains = base + 0.02 * s + noise(100 * s + k, se_scale) + (r3_gain if (label, mb) == ("R3", 4) else 0.0)
            rows.append(row(label, mb, s, gains, replace_rate=3e-5 if label == "soft 0.5" else math.nan))
    return rows


def test_the_verdicts_flip_when_the_data_do():
    """The same grid twice: R3 at 4 mini-batches no better than the rest with little noise (R3 pays: not supported;
    R3 ahead of GSPO and TIS: not supported; on-policy alike: supported), then +0.15 ahead of every arm (R3 pays and
    R3 ahead of GSPO and TIS: supported; soft replay alike R3: not supported); on one seed every claim is not
    measurable. Fails if a verdict did not follow the data, or a claim's line lost its figures."""
    quiet = dict(line.split(". ", 1) for line in verdicts(grid(0.0, 0.01)))
    assert quiet["Qwen: on-policy (1 mini-batch, TIS on) needs neither R2 nor R3"].endswith(": supported")
    assert quiet["Qwen: R3 pays from 4 mini-batches on"].endswith(": not supported")
    assert quiet["R3 paper: R3 ahead of GSPO"].endswith(": not supported")
    assert "(seeds 1, 2, 3)" in quiet["R3 paper: R3 ahead of GSPO"]
    loud = dict(line.split(". ", 1) for line in verdicts(grid(0.15, 0.01)))
    assert loud["Qwen: R3 pays from 4 mini-batches on"].endswith(": supported")
    assert loud["R3 paper: R3 ahead of TIS"].endswith(": supported")
    assert loud["prime-rl #2703: soft replay at ratio 0.5 does as R3 does"].endswith(": not supported")
    noisy = dict(line.split(". ", 1) for line in verdicts(grid(0.0, 0.4)))
    assert noisy["Qwen: on-policy (1 mini-batch, TIS on) needs neither R2 nor R3"].endswith(": not measurable")
    one = verdicts(grid(0.15, 0.01, seeds=(1,)))
    assert all("not measurable (1 shared seed; a verdict needs 3)" in line for line in one), one


def test_over_seeds_the_error_is_the_larger_of_within_and_between():
    """Per seed the two arms differ by +0.10, -0.10 and 0 with almost no prompt noise: the gap's mean is 0 and its
    error is the seeds' spread (0.1 / sqrt(3) = 0.058), not the tiny per-seed errors combined. Then the seeds agree
    and the prompt noise is large: the error is the per-seed errors combined. Fails if the combination kept only one
    of the two (the seed-combination rule of issue 70)."""
    shared = noise(7, 0.3)
    rows = []
    for seed, d in ((1, 0.10), (2, -0.10), (3, 0.0)):
        rows += [row("R3", 4, seed, 0.12 + shared + d + noise(30 + seed, 1e-4)),
                 row("none", 4, seed, 0.12 + shared + noise(40 + seed, 1e-4))]
    g = gap(rows, ("R3", 4), ("none", 4))
    assert g.seeds == (1, 2, 3) and abs(g.diff) < 1e-3
    assert g.se == pytest.approx(0.1 / math.sqrt(3), rel=0.02)
    loud = [row(label, 4, seed, 0.12 + shared + noise(50 + 2 * seed + (label == "R3"), 0.3))
            for seed in (1, 2, 3) for label in ("R3", "none")]
    per_seed = [M.mean_and_stderr(np.subtract(loud[2 * i].prompt_gains, loud[2 * i + 1].prompt_gains), PROBLEMS)
                for i in range(3)]
    within = math.sqrt(sum(se ** 2 for _, se in per_seed)) / 3
    spread = float(np.std([d for d, _ in per_seed], ddof=1)) / math.sqrt(3)
    assert gap(loud, ("R3", 4), ("none", 4)).se == pytest.approx(max(within, spread))
