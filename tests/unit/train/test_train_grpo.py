"""GRPO advantages and the clipped policy loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rl.train.grpo import group_advantages, per_token_advantages, policy_loss
from r3rl.train.optim import lr_at


def test_group_advantages_centre_and_scale_within_groups():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 2.0, 8.0])
    groups = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups, normalize_std=True)
    for g in (0, 2):
        members = adv[groups == g]
        assert abs(members.mean()) < 1e-6 and abs(members.std(ddof=1) - 1.0) < 1e-4
    assert np.all(adv[groups == 1] == 0.0)  # equal rewards: no signal
    raw = group_advantages(rewards, groups, normalize_std=False)
    assert np.allclose(raw[groups == 2], [-3.0, 3.0])
    assert adv.dtype == np.float32


def test_group_advantages_reject_bad_input():
    with pytest.raises(ValueError):
        group_advantages([1.0, float("nan")], [0, 0], True)
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0], [0], True)


def test_per_token_advantages_broadcast_scalars_and_check_lengths():
    out = per_token_advantages(np.array([0.5, -1.0]), [3, 2])
    assert [a.tolist() for a in out] == [[0.5] * 3, [-1.0] * 2]
    with pytest.raises(ValueError, match="sample 1"):
        per_token_advantages([np.zeros(3), np.zeros(3)], [3, 2])


def test_policy_loss_is_a_masked_token_sum_and_clips_asymmetrically():
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # ratios 1.5 (clipped at 1.28 for A>0), 0.9, 1.5 (A<0: unclipped side is worse -> kept)
    logp = torch.log(torch.tensor([[1.5, 0.9, 1.5, 3.0]])).requires_grad_(True)
    terms = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    expected = -(1.28 * 1.0) - 0.9 * 1.0 + 1.5 * 1.0
    assert abs(float(terms.loss.detach()) - expected) < 1e-5
    assert float(terms.tokens) == 3.0 and float(terms.clipped) == 1.0
    terms.loss.backward()
    grad = logp.grad[0]
    assert grad[0] == 0.0  # clipped token: no gradient
    assert grad[3] == 0.0  # masked token
    assert grad[1] != 0.0 and grad[2] != 0.0


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.tensor([[-1.0, -2.0]])
    zeros = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    same = policy_loss(logp, logp, zeros, mask, clip_low=0.2, clip_high=0.2, ref_logprobs=logp, kl_coef=0.1)
    assert float(same.kl) == 0.0
    away = policy_loss(logp, logp, zeros, mask, clip_low=0.2, clip_high=0.2, ref_logprobs=logp - 0.5, kl_coef=0.1)
    assert float(away.kl) > 0 and abs(float(away.loss) - 0.1 * float(away.kl)) < 1e-6


def test_cosine_learning_rate():
    assert lr_at(0, 10, 1.0, 0.1) == 1.0
    assert abs(lr_at(10, 10, 1.0, 0.1) - 0.1) < 1e-12
    assert lr_at(3, 10, 1.0, 0.1) > lr_at(4, 10, 1.0, 0.1)
    assert lr_at(20, 10, 1.0, 0.1) == lr_at(10, 10, 1.0, 0.1)
