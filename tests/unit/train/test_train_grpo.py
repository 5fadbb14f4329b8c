"""GRPO advantages and the clipped policy loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rl.train.grpo import group_advantages, per_token_advantages, policy_loss, sequence_mean_weights
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


def verl_gspo_token_losses(logprobs, old, adv, mask, low, high):
    """verl's ``compute_policy_loss_gspo`` (trainer/ppo/core_algos.py) as its source reads, on right-padded
    ``[B, T]`` rows, before its aggregation: the per-token loss matrix."""
    seq_lengths = mask.sum(dim=-1).clamp(min=1)
    seq_kl = ((logprobs - old) * mask).sum(dim=-1) / seq_lengths
    log_ratio = torch.clamp(logprobs - logprobs.detach() + seq_kl.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))


def test_gspo_clips_the_sequence_ratio_as_verl_does_in_padded_and_packed_rows():
    """GSPO (``sequences`` given): the per-token loss sum and its gradient equal verl's definition on padded rows, and
    the same samples packed end to end in one row give the same. Hand-computed: a sequence whose tokens' log-ratios
    are +0.3 and -0.1 has ratio exp(0.1) for both tokens, clipped to 1.0004 under a positive advantage. Fails if the
    ratio were taken per token (GRPO's), over all tokens of a packed row, over masked tokens, or with a gradient
    through the sequence mean."""
    torch.manual_seed(0)
    old = torch.randn(3, 5, dtype=torch.float64)
    lp = (old + 0.05 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64).expand(3, 5).contiguous()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    ids = torch.arange(3, dtype=torch.float64)[:, None].expand(3, 5)
    ours = policy_loss(lp, old, adv, mask, clip_low=3e-4, clip_high=4e-4, sequences=ids, num_sequences=3)
    theirs = (verl_gspo_token_losses(lp, old, adv, mask, 3e-4, 4e-4) * mask).sum()
    (g_ours,) = torch.autograd.grad(ours.loss, lp)
    (g_theirs,) = torch.autograd.grad(theirs, lp)
    assert torch.allclose(ours.loss, theirs) and torch.allclose(g_ours, g_theirs)
    assert not torch.allclose(ours.loss, policy_loss(lp, old, adv, mask, clip_low=3e-4, clip_high=4e-4).loss)

    packed = lambda x: x.reshape(1, 15)  # noqa: E731 - the three rows end to end, as a packed micro batch
    lp_packed = lp.detach().clone().reshape(1, 15).requires_grad_(True)
    again = policy_loss(lp_packed, packed(old), packed(adv), packed(mask), clip_low=3e-4, clip_high=4e-4,
                        sequences=packed(ids), num_sequences=3)
    (g_packed,) = torch.autograd.grad(again.loss, lp_packed)
    assert torch.allclose(again.loss, ours.loss) and torch.allclose(g_packed.reshape(3, 5), g_ours)

    two = torch.tensor([[0.3, -0.1]], dtype=torch.float64)  # log pi - log pi_old per token
    hand = policy_loss(two.clone().requires_grad_(True), torch.zeros_like(two), torch.ones_like(two),
                       torch.ones_like(two), clip_low=3e-4, clip_high=4e-4, sequences=torch.zeros_like(two),
                       num_sequences=1)
    assert torch.allclose(hand.loss, torch.tensor(-2 * 1.0004, dtype=torch.float64))
    assert float(hand.clipped) == 2.0


def test_gspo_at_ratio_1_has_grpos_per_token_gradient():
    """On-policy (log pi = log pi_old) every sequence ratio is exactly 1, so GSPO-token's per-token gradient is
    GRPO's, -A grad log pi per token (docs/r3.md). Fails if the sequence mean carried a gradient (each token would
    get the mean of its sequence's gradients) or GSPO's clip acted at ratio 1."""
    torch.manual_seed(1)
    lp = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.5], [-0.7]], dtype=torch.float64).expand(2, 4).contiguous()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    ids = torch.arange(2, dtype=torch.float64)[:, None].expand(2, 4)
    gspo = policy_loss(lp, lp.detach(), adv, mask, clip_low=3e-4, clip_high=4e-4, sequences=ids, num_sequences=2)
    grpo = policy_loss(lp, lp.detach(), adv, mask, clip_low=0.2, clip_high=0.28)
    (g_gspo,), (g_grpo,) = torch.autograd.grad(gspo.loss, lp), torch.autograd.grad(grpo.loss, lp)
    assert torch.equal(g_gspo, g_grpo) and torch.allclose(g_grpo, -adv * mask)
    assert float(gspo.clipped) == 0.0


def test_gspo_weights_average_each_sequence_then_the_sequences_of_each_mini_batch():
    """``sequence_mean_weights``: mini-batch 1 holds sequences of 1 and 3 loss tokens (T 4, S 2: weights 2 and 2/3),
    mini-batch 2 one of 2 tokens and one with none (T 2, S 1: weight 1, and 0 where nothing counts). Weighted and
    divided by T, a loss of 1 per token of sequence 0 and 0 elsewhere is 1/2, the sequence mean of token means
    (the token mean would give 1/4). Fails if the mean were over tokens (every weight 1), over the whole rollout
    batch instead of each mini-batch, or counted a sequence with no loss token."""
    masks = [np.array([1.0, 0.0]), np.array([1.0, 1.0, 1.0]), np.array([1.0, 1.0]), np.zeros(2)]
    w = sequence_mean_weights(masks, 2)
    assert [x.tolist() for x in w] == [[2.0, 2.0], pytest.approx([2 / 3] * 3), [1.0, 1.0], [0.0, 0.0]]
    loss = [np.array([1.0, 0.0]), np.zeros(3)]
    assert sum(float((l * m * x).sum()) for l, m, x in zip(loss, masks, w)) / 4 == pytest.approx(0.5)


def test_gspos_kl_term_is_the_same_sequence_mean_as_its_policy_term():
    """GSPO with ``algorithm.use_kl_loss``: the k3 KL of a short and a long sequence, each weighted as the policy term
    (``loss_weights``, GSPO's ``sequence_mean_weights``), so the KL in the loss is the mean over sequences of each
    one's token mean, as verl's KL loss takes the policy loss's ``loss_agg_mode``. Here the short sequence's one token
    has KL k and the long one's three tokens none: the sequence mean is k/2, the token mean k/4. Fails if the KL
    stayed a token mean while the policy term was a sequence mean (issue 70: the weights multiplied only the policy
    term)."""
    lp = torch.zeros(1, 4)
    old = lp.clone()
    ref = torch.tensor([[0.5, 0.0, 0.0, 0.0]])  # KL only on the short sequence's token
    mask, ids = torch.ones(1, 4), torch.tensor([[0, 1, 1, 1]])
    weights = torch.from_numpy(np.concatenate(sequence_mean_weights([np.ones(1), np.ones(3)], 2)))[None]
    terms = policy_loss(lp, old, torch.zeros(1, 4), mask, clip_low=0.2, clip_high=0.2, ref_logprobs=ref, kl_coef=1.0,
                        sequences=ids, num_sequences=2, loss_weights=weights)
    k = float(torch.exp(torch.tensor(0.5)) - 0.5 - 1.0)
    assert float(terms.kl) / float(terms.tokens) == pytest.approx(k / 2)
    assert float(terms.loss) / float(terms.tokens) == pytest.approx(k / 2)  # no advantage: the loss is the KL
