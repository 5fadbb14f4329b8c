"""The stabiliser grid's verdicts (``r3rl.dashboard.stabiliser_verdicts``) on synthetic rows: gaps on shared seeds,
paired by prompt, and words that need an equivalence margin met."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3rl.dashboard.stabiliser_verdicts import Gap, ahead, alike, gap, verdicts
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


def test_supported_needs_the_interval_within_the_margin():
    """A claim that two setups do alike: supported only when |d| + 2 se fits the margin; a gap of 0 with a wide
    error is not measurable. A claim that one is ahead: supported above 2 se, not supported when even d + 2 se is
    under the margin. Fails if "supported" were printed for any difference under 2 se (the bench before issue 58)."""
    assert alike(Gap(0.0, 0.01, (1,)), 0.05) == "supported"
    assert alike(Gap(0.0, 0.04, (1,)), 0.05) == "not measurable"  # under 2 se, but the interval is +-0.08
    assert alike(Gap(0.10, 0.02, (1,)), 0.05) == "not supported"
    assert ahead(Gap(0.10, 0.02, (1,)), 0.05) == "supported"
    assert ahead(Gap(-0.02, 0.01, (1,)), 0.05) == "not supported"
    assert ahead(Gap(0.02, 0.02, (1,)), 0.05) == "not measurable"


def grid(r3_gain: float, se_scale: float) -> list[GridRow]:
    """Every arm of the bench's grid on seed 1, and none and R3 at 4 on seed 2; R3 at 4 mini-batches gains
    ``r3_gain`` more than every other arm, per prompt."""
    base = 0.12 + noise(5, 0.3)
    jitter = lambda k: noise(10 + k, se_scale)  # noqa: E731 - per-run per-prompt noise
    arms = [("none", 1), ("R3", 1), ("none", 2), ("R2", 2), ("R3", 2), ("none", 4), ("R2", 4), ("R3", 4),
            ("soft 0.5", 4), ("TIS", 4), ("GSPO", 4), ("frozen router", 4)]
    rows = [row(label, mb, 1, base + jitter(k) + (r3_gain if (label, mb) == ("R3", 4) else 0.0),
                replace_rate=3e-5 if label == "soft 0.5" else math.nan) for k, (label, mb) in enumerate(arms)]
    rows += [row("none", 4, 2, base + jitter(20)), row("R3", 4, 2, base + jitter(21) + r3_gain)]
    return rows


def test_the_verdicts_flip_when_the_data_do():
    """The same grid twice: R3 at 4 mini-batches no better than the rest with little noise (R3 pays: not supported;
    R3 ahead of GSPO and TIS: not supported; on-policy alike: supported), then +0.15 ahead of every arm (R3 pays and
    R3 ahead of GSPO and TIS: supported; soft replay alike R3: not supported). Fails if a verdict did not follow
    the data, or a claim's line lost its figures."""
    quiet = dict(line.split(". ", 1) for line in verdicts(grid(0.0, 0.01)))
    assert quiet["Qwen: on-policy (1 mini-batch, TIS on) needs neither R2 nor R3"].endswith(": supported")
    assert quiet["Qwen: R3 pays from 4 mini-batches on"].endswith(": not supported")
    assert quiet["R3 paper: R3 ahead of GSPO"].endswith(": not supported")
    assert "(seed 1)" in quiet["R3 paper: R3 ahead of GSPO"] and "(seeds 1, 2)" in quiet[
        "Qwen: R3 pays from 4 mini-batches on"]
    loud = dict(line.split(". ", 1) for line in verdicts(grid(0.15, 0.01)))
    assert loud["Qwen: R3 pays from 4 mini-batches on"].endswith(": supported")
    assert loud["R3 paper: R3 ahead of TIS"].endswith(": supported")
    assert loud["prime-rl #2703: soft replay at ratio 0.5 does as R3 does"].endswith(": not supported")
    noisy = dict(line.split(". ", 1) for line in verdicts(grid(0.0, 0.4)))
    assert noisy["Qwen: on-policy (1 mini-batch, TIS on) needs neither R2 nor R3"].endswith(": not measurable")
