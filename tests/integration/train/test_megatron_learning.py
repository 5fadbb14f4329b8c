"""Training trains: one GRPO step moves the policy the way the advantages say, tokens left out of the loss (loss mask
or correction weight 0) get no gradient, and the advantages are what drives the update. Real Megatron trainer on the
tiny Qwen3-MoE, with replayed routes (so log-probs move only with the weights, never with a routing flip)."""

from __future__ import annotations

import numpy as np
import torch

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl.train.correction import Correction, correct
from r3rl.train.grpo import group_advantages

# two responses up and two down in each group of four: every group carries signal, both signs are present
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def learning_batch(seed: int):
    """8 samples of varied lengths (every third with its last token out of the loss), random routes, advantages."""
    samples = build_samples(len(REWARDS), seed)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=seed))
    for s, r in zip(samples, REWARDS):
        s.reward = r
    advantages = group_advantages(REWARDS, [s.group for s in samples], normalize_std=True)
    assert (advantages > 0).sum() == 4 and (advantages < 0).sum() == 4
    return samples, advantages


def response_means(logprobs, masks) -> np.ndarray:
    """Per sample: the mean log-prob of its response tokens in the loss."""
    return np.array([float((lp * m).sum() / m.sum()) for lp, m in zip(logprobs, masks)])


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.bare.named_parameters()}


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names of the parameters that differ between ``a`` and ``b`` (bit for bit)."""
    return [n for n in a if not torch.equal(a[n], b[n])]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    changed = moved(a, b)
    assert not changed, f"{len(changed)} of {len(a)} parameters differ: {changed}"


def assert_differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    changed = moved(a, b)
    assert changed, "every parameter is bit for bit the same"


def test_one_grpo_step_raises_positive_and_lowers_negative_advantage_responses(new_trainer):
    """Fails if the policy loss's sign is flipped (``unclipped = advantages * ratio`` in ``grpo.policy_loss``, with or
    without the clipped term), or if the advantages reach the loss as constants, unsigned (``abs``) or handed to the
    wrong samples (shifted by one): the step then lowers the log-probs of some rewarded responses or raises those of
    the others."""
    trainer = new_trainer("trainer.micro_batch_size=4", "trainer.lr=1e-4")
    samples, adv = learning_batch(seed=31)
    masks = [s.loss_mask for s in samples]
    before = trainer.logprobs(samples, replay=True).logprobs
    m = trainer.train_step(samples, adv, replay=True, old_logprobs=before)
    assert m["optimizer_steps"] == 1 and m["skipped_steps"] == 0 and m["replay_mismatch_rows"] == 0
    after = trainer.logprobs(samples, replay=True).logprobs
    gain = response_means(after, masks) - response_means(before, masks)
    up, down = gain[adv > 0].mean(), gain[adv < 0].mean()
    assert up > 0 > down, (gain, adv)


def test_tokens_with_zero_loss_mask_or_zero_correction_weight_get_no_gradient(new_trainer, tmp_path):
    """Every update starts from the same checkpoint; what a token out of the loss carries (its advantage, pi_old, its
    rollout log-prob and so its correction weight) must leave the updated weights bit for bit as they are, while
    changing one token in the loss changes them.

    Fails if ``grpo.policy_loss`` drops ``* mask`` from the loss or ``* is_weights`` from the per-token terms, if the
    trainer drops ``is_weights`` on the way to the loss, or uses ``Sample.loss_mask`` where ``train_step`` was given
    the correction's ``loss_masks`` (or ignores ``Sample.loss_mask``); the controls fail if the correction weights or
    the advantages never reach the loss."""
    trainer = new_trainer("trainer.micro_batch_size=4", "trainer.lr=1e-4")
    start = trainer.save_checkpoint(tmp_path / "start")
    samples, adv = learning_batch(seed=32)
    old = trainer.logprobs(samples, replay=True).logprobs
    rng = np.random.default_rng(32)
    tok_adv = [np.float32(a) + rng.uniform(-0.5, 0.5, s.response_length).astype(np.float32)
               for s, a in zip(samples, adv)]

    def update(advantages, old_logprobs, **kw) -> dict[str, torch.Tensor]:
        trainer.load_checkpoint(start)
        m = trainer.train_step(samples, advantages, replay=True, old_logprobs=old_logprobs, **kw)
        assert m["skipped_steps"] == 0 and m["grad_norm"] > 0
        return params(trainer)

    def perturbed(values, where, scale):
        """``values`` with the entries at ``where`` (one bool array per sample) moved by up to ``scale``."""
        return [np.where(w, v + rng.uniform(-scale, scale, v.shape).astype(np.float32), v).astype(np.float32)
                for v, w in zip(values, where)]

    def one_token(where):
        """A mask over the responses with a single token, the first one of ``where``."""
        i = next(i for i, w in enumerate(where) if w.any())
        out = [np.zeros(len(w), dtype=bool) for w in where]
        out[i][np.flatnonzero(where[i])[0]] = True
        return out

    # 1. Sample.loss_mask (what train_step uses without a correction): samples 2 and 5 leave their last token out
    left_out = [s.loss_mask == 0 for s in samples]
    assert sum(int(w.sum()) for w in left_out) == 2
    base = update(tok_adv, old)
    assert_same(update(perturbed(tok_adv, left_out, 3.0), perturbed(old, left_out, 1.0)), base)
    kept = [s.loss_mask > 0 for s in samples]
    assert_differs(update(perturbed(tok_adv, one_token(kept), 3.0), old), base)

    # 2. the rollout correction's weights and masks, given to train_step: a whole response and single tokens masked,
    # other tokens with weight 0, the rest weighted in [0.5, 1.5]
    weights = [rng.uniform(0.5, 1.5, s.response_length).astype(np.float32) for s in samples]
    masks = [s.loss_mask.copy() for s in samples]
    masks[1][:] = 0.0
    masks[4][1] = 0.0
    masks[7][0] = 0.0
    weights[0][0] = weights[3][2] = weights[6][1] = 0.0
    weights[5][:2] = 0.0
    out = [(m == 0) | (w == 0) for m, w in zip(masks, weights)]
    assert all(s.loss_mask[~o].all() for s, o in zip(samples, out)) and sum(int(o.sum()) for o in out) > 10
    base = update(tok_adv, old, is_weights=weights, loss_masks=masks)
    assert_same(update(perturbed(tok_adv, out, 3.0), perturbed(old, out, 1.0), is_weights=weights,
                       loss_masks=masks), base)
    # masked tokens may carry any weight; weight-0 tokens stay in the loss mask and the token count
    reweighted = [np.where(m == 0, np.float32(2.0), w) for m, w in zip(masks, weights)]
    assert_same(update(tok_adv, old, is_weights=reweighted, loss_masks=masks), base)
    # controls: one token in the loss (mask 1, weight > 0) with another advantage, or another weight, moves the update
    inside = [~o for o in out]
    assert_differs(update(perturbed(tok_adv, one_token(inside), 3.0), old, is_weights=weights, loss_masks=masks),
                   base)
    assert_differs(update(tok_adv, old, is_weights=perturbed(weights, one_token(inside), 0.4), loss_masks=masks),
                   base)
    # the same tokens, taken out by the loss mask given to train_step, did count under Sample.loss_mask
    assert_differs(update(tok_adv, old, is_weights=weights), base)

    # 3. end to end through correct(): IcePop rejects the tokens whose pi_old / pi_rollout leaves [0.5, 2] (weight 0);
    # moving their rollout log-probs further out changes their ratios but not the update, moving a kept one does
    rollout = [o + rng.normal(0, 0.6, o.shape).astype(np.float32) for o in old]
    icepop = Correction("icepop", ratio_low=0.5, ratio_high=2.0)

    def corrected_update(rollout_lps):
        fix = correct(icepop, old, rollout_lps, [s.loss_mask for s in samples])
        return update(tok_adv, old, is_weights=fix.weights, loss_masks=fix.loss_masks), fix

    base, fix = corrected_update(rollout)
    # rejected: weight 0, kept in the loss mask (correction.rejected_tokens=zero_weight, the default)
    rejected = [(k == 0) & (s.loss_mask > 0) for k, s in zip(fix.kept, samples)]
    assert all(np.array_equal(m, s.loss_mask) for m, s in zip(fix.loss_masks, samples))
    assert sum(int(r.sum()) for r in rejected) >= 3
    further = [np.where(r, lp + np.sign(lp - o) * rng.uniform(0.1, 2.0, lp.shape), lp).astype(np.float32)
               for lp, o, r in zip(rollout, old, rejected)]
    after, fix2 = corrected_update(further)
    assert all(np.array_equal(a, b) for a, b in zip(fix.kept, fix2.kept))
    # their ratios moved, their weights stay exactly 0
    assert any(not np.array_equal(a[r], b[r]) for a, b, r in zip(rollout, further, rejected))
    assert all((w[r] == 0).all() for w, r in zip(fix2.weights, rejected))
    assert_same(after, base)
    accepted = one_token([k > 0 for k in fix.kept])
    nudged = [np.where(a, lp + np.float32(0.05), lp).astype(np.float32) for lp, a in zip(rollout, accepted)]
    after, fix3 = corrected_update(nudged)
    assert all(np.array_equal(a, b) for a, b in zip(fix.kept, fix3.kept))
    assert_differs(after, base)


def test_the_update_is_driven_by_the_advantages(new_trainer, policy):
    """Zero advantages leave every weight bit for bit where it was (weight decay is off); nonzero ones move every
    parameter tensor; the gradient is linear in the advantages (negated or doubled advantages give exactly the
    negated or doubled gradient).

    Fails if the advantages never reach the loss (e.g. ``per_token_advantages`` or ``policy_loss`` using ones or
    zeros in their place), if a term independent of the advantages enters the policy loss or its gradient (an
    entropy bonus, an auxiliary loss with the KL off), or if the trainer steps the weights without a gradient."""
    trainer = new_trainer("trainer.micro_batch_size=4", "trainer.lr=1e-4")
    assert trainer.cfg.trainer.weight_decay == 0.0 and not trainer.cfg.algorithm.use_kl_loss
    samples, adv = learning_batch(seed=33)
    start = params(trainer)
    old = trainer.logprobs(samples, replay=True).logprobs
    m = trainer.train_step(samples, np.zeros_like(adv), replay=True, old_logprobs=old)
    assert m["grad_norm"] == 0.0 and m["loss"] == 0.0 and m["skipped_steps"] == 0
    assert_same(params(trainer), start)
    m = trainer.train_step(samples, adv, replay=True, old_logprobs=old)
    assert m["grad_norm"] > 0
    after = params(trainer)
    assert all(not torch.equal(after[n], start[n]) for n in start), \
        [n for n in start if torch.equal(after[n], start[n])]

    # the gradient itself, on the shared trainer that never steps
    old = policy.logprobs(samples, replay=True).logprobs

    def grads(a):
        return policy.gradients(samples, a, replay=True, old_logprobs=old)["grads"]

    g = grads(adv)
    assert all(torch.count_nonzero(v) == 0 for v in grads(np.zeros_like(adv)).values())
    assert all(torch.count_nonzero(v) > 0 for v in g.values())
    for factor in (-1.0, 2.0):
        scaled = grads(adv * np.float32(factor))
        assert all(torch.equal(scaled[n], g[n] * factor) for n in g), factor
