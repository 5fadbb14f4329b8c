"""The doctor's drift pass, its arithmetic apart from any model: the emulated rounding (``r3rl.train.drift``) and
the pairing of the two passes' router calls (``r3rl.train.replay.DriftReference``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3rl.train.drift import drift_scale, perturbed, stochastic_round
from r3rl.train.replay import DriftReference

BF16_U = 2.0 ** -8


@given(st.floats(min_value=2.0 ** -100, max_value=2.0 ** 100, width=32), st.booleans())
@settings(max_examples=200, deadline=None)
def test_stochastic_rounding_lands_on_a_neighbour_and_keeps_the_mean(magnitude, negative):
    """Every float32 value rounds to one of the two bfloat16 values around it, and over many draws their mean is the
    value (unbiased: a move below bfloat16's spacing still moves a bfloat16 trainer on average). Fails if the dither
    reached the kept bits (a value two spacings off), if negative values rounded away from their neighbours (the
    sign bit caught in the arithmetic), or if the rounding were to nearest (the mean of 1 + 3/1024 would be 1)."""
    value = -magnitude if negative else magnitude  # a normal float32, exactly
    x = torch.full((4000,), value, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    y = stochastic_round(x, torch.bfloat16, g).float()
    spacing = abs(value) * BF16_U * 4  # more than one bfloat16 spacing around the value, less than two
    assert ((y - value).abs() <= spacing).all()
    assert len(set(y.tolist())) <= 2 and math.copysign(1, y[0].item()) == math.copysign(1, value)
    assert y.double().mean().item() - value == pytest.approx(0, abs=abs(value) * BF16_U / 10)


def test_rounding_to_nearest_would_not_move_a_value_between_two_bfloat16_values():
    """The control of the test above: 1 + 3/1024 rounds to 1 at nearest, so a deterministic rounding leaves a
    bfloat16 trainer unmoved; the stochastic one lands on 1 + 1/128 about 3/8 of the time."""
    x = torch.full((20000,), 1 + 3 / 1024, dtype=torch.float32)
    assert set(x.bfloat16().float().tolist()) == {1.0}
    up = (stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(1)).float() > 1).float().mean().item()
    assert up == pytest.approx(3 / 8, abs=0.02)


def test_the_perturbation_stays_within_the_engines_relative_rounding_and_is_not_zero():
    """In float32, each element moves by at most u |x| and by about u / sqrt(3) |x| in spread (uniform); a bfloat16
    tensor moves by one spacing or none. Fails if the noise were absolute instead of relative, drawn at another u,
    or lost in a bfloat16 tensor (the perturbation would read 0 there)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50_000) * 100
    rel = (perturbed(x, BF16_U, g) - x) / x.abs()
    assert rel.abs().max().item() <= BF16_U * (1 + 1e-6)
    assert rel.std().item() == pytest.approx(BF16_U / math.sqrt(3), rel=0.05)
    b = x.bfloat16()
    moved = perturbed(b, BF16_U, g)
    assert moved.dtype == torch.bfloat16 and 0.2 < (moved != b).float().mean().item() < 0.6
    with pytest.raises(ValueError, match="float16"):
        perturbed(x.half(), BF16_U, g)


def test_the_engines_distance_adds_the_trainers_rounding_in_quadrature():
    """A float32 trainer beside a bfloat16 engine: the engine is as far as its own rounding; a bfloat16 trainer:
    sqrt(2) further. Fails if the trainer's own rounding were ignored on GPUs or counted on the CPU profile."""
    assert drift_scale(2.0 ** -24, BF16_U) == pytest.approx(1.0)
    assert drift_scale(BF16_U, BF16_U) == pytest.approx(math.sqrt(2))


def test_the_perturbed_pass_must_call_the_same_routers_on_the_same_rows():
    """The two passes are paired router call by router call. Fails if a call with another row count (another micro
    batch) were paired silently, or a call beyond the kept ones read stale rows."""
    ref = DriftReference()
    ref.kept.append((torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, 1, dtype=torch.long), torch.zeros(5),
                     torch.zeros(5)))
    ref.keeping = False
    with pytest.raises(RuntimeError, match="router call 0 saw 4 rows, the unperturbed pass 5"):
        ref.next(4)
    ref = DriftReference(kept=ref.kept, keeping=False)
    assert len(ref.next(5)[2]) == 5
    with pytest.raises(RuntimeError, match="more routers"):
        ref.next(5)
