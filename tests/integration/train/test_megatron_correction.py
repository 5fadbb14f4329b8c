"""The rollout correction in the real trainer (tiny Qwen3-MoE, CPU): the weights and masks reach the loss as the
hand-computed formula says, either rejected-token option divides by its own token count, a step whose every token
is rejected is skipped, and the training-pass replay check reports a route replayed on the wrong row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl.train.correction import Correction, correct
from r3rl.train.grpo import group_advantages

REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def batch(seed: int):
    samples = build_samples(len(REWARDS), seed)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=seed))
    adv = group_advantages(REWARDS, [s.group for s in samples], normalize_std=True)
    return samples, [np.full(s.response_length, a, dtype=np.float32) for s, a in zip(samples, adv)]


def hand_loss(adv, weights, masks) -> float:
    """The policy loss at ratio pi / pi_old = 1 (the first forward on pi_old's weights and routes): the token mean
    over the loss mask of -A * w."""
    num = sum(float((-a * w * m).sum()) for a, w, m in zip(adv, weights, masks))
    return num / sum(float(m.sum()) for m in masks)


def test_correction_weights_change_the_update_and_the_loss_is_the_hand_computed_one(policy):
    """With IcePop's weights the loss equals the hand-computed token mean of -A * w over the loss mask (rejected
    tokens at weight 0): over all valid tokens under ``zero_weight``, over the kept ones under ``drop_from_count``;
    the gradient differs from the uncorrected one.

    Fails if the trainer drops ``is_weights`` on the way to the loss (the loss is then the unweighted mean), if
    ``correct`` leaves a rejected token's ratio as its weight, or if ``zero_weight`` / ``drop_from_count`` divide by
    the other option's count."""
    samples, adv = batch(seed=41)
    old = policy.logprobs(samples, replay=True).logprobs
    rng = np.random.default_rng(41)
    rollout = [o + rng.normal(0, 0.6, o.shape).astype(np.float32) for o in old]
    masks = [s.loss_mask for s in samples]
    plain = policy.gradients(samples, adv, replay=True, old_logprobs=old)
    assert plain["loss"] == pytest.approx(hand_loss(adv, [np.ones_like(m) for m in masks], masks), rel=1e-4)

    for option, denominator in (("zero_weight", masks), ("drop_from_count", None)):
        fix = correct(Correction("icepop", ratio_low=0.5, ratio_high=2.0, rejected_tokens=option), old, rollout,
                      masks)
        rejected = sum(int(((k == 0) & (m > 0)).sum()) for k, m in zip(fix.kept, masks))
        assert rejected >= 3, "the noise must make IcePop reject some tokens"
        assert all((w[(k == 0) & (m > 0)] == 0).all() for w, k, m in zip(fix.weights, fix.kept, masks))
        out = policy.gradients(samples, adv, replay=True, old_logprobs=old, is_weights=fix.weights,
                               loss_masks=fix.loss_masks)
        count = denominator if denominator is not None else fix.kept
        assert out["loss_tokens"] == sum(float(m.sum()) for m in count), option
        assert out["loss"] == pytest.approx(hand_loss(adv, fix.weights, count), rel=1e-4), option
        assert any(not torch.equal(out["grads"][n], plain["grads"][n]) for n in plain["grads"]), option
        if option == "zero_weight":
            zero_weight_grads = out["grads"]
    # same weights, more tokens in the count: the zero_weight gradient is the drop_from_count one scaled by
    # kept / valid tokens
    scale = sum(float(k.sum()) for k in fix.kept) / sum(float(m.sum()) for m in masks)
    for n, g in out["grads"].items():
        assert torch.allclose(zero_weight_grads[n], g * scale, rtol=1e-4, atol=1e-9), n


def test_a_step_whose_every_token_is_rejected_is_skipped(new_trainer):
    """After one real step (Adam has momentum), an optimizer step whose every token is rejected (all weights 0, or
    all masks 0) leaves every weight bit for bit as it was, counts as skipped and rejected, and warns; a batch with
    one rejected and one kept global batch skips only the first.

    Fails if the trainer steps the optimizer on the zero gradient (Adam's momentum moves the weights) or no longer
    reports the step in ``rejected_steps`` / ``skipped_steps``."""
    trainer = new_trainer("trainer.micro_batch_size=4", "trainer.lr=1e-3")
    samples, adv = batch(seed=42)
    gbs = trainer.cfg.algorithm.global_batch_size
    assert len(samples) % gbs == 0
    steps = len(samples) // gbs
    first = trainer.train_step(samples, adv, replay=True)
    assert first["skipped_steps"] == 0 and first["rejected_steps"] == 0 and first["grad_norm"] > 0
    start = {n: p.detach().clone() for n, p in trainer.bare.named_parameters()}
    zeros = [np.zeros(s.response_length, dtype=np.float32) for s in samples]
    for kw in ({"is_weights": zeros}, {"loss_masks": zeros}):
        with pytest.warns(RuntimeWarning, match="rejected every token"):
            out = trainer.train_step(samples, adv, replay=True, **kw)
        assert out["rejected_steps"] == steps and out["skipped_steps"] == steps, kw
        assert out["loss_tokens"] == 0 and out["loss"] == 0 and out["grad_norm"] == 0
        changed = [n for n, p in trainer.bare.named_parameters() if not torch.equal(p, start[n])]
        assert not changed, (kw, changed)
    if steps > 1:  # only the global batch without a token in the loss is skipped
        ones = [np.ones(s.response_length, dtype=np.float32) for s in samples]
        part = zeros[:gbs] + ones[gbs:]
        with pytest.warns(RuntimeWarning, match="rejected every token"):
            out = trainer.train_step(samples, adv, replay=True, is_weights=part)
        assert out["rejected_steps"] == steps - 1 and out["skipped_steps"] == steps - 1
        assert any(not torch.equal(p, start[n]) for n, p in trainer.bare.named_parameters())


def test_training_pass_check_reports_a_route_replayed_on_the_wrong_row(new_trainer, monkeypatch):
    """A packing bug injected into the training forwards (no real packing has one to trigger): the first sample of
    each micro batch replays its routes one token late. The check of the training pass (what the recipe logs as
    ``train/replay_mismatch_rows`` and, under R2, ``r2/replay_mismatch_rows``) reports the shifted rows.

    Fails if ``train_step`` stops probing its training forwards (``RouteProbe`` in ``_accumulate``) or compares the
    routing map with the packed targets rather than with the samples' own routes."""
    import r3rl.train.batch as batch_lib

    trainer = new_trainer("trainer.micro_batch_size=4", "trainer.lr=1e-4")
    samples, adv = batch(seed=43)
    old = trainer.logprobs(samples, replay=True).logprobs
    clean = trainer.train_step(samples, adv, replay=True, old_logprobs=old)
    assert clean["replay_mismatch_rows"] == 0 and clean["replayed_rows"] > 0
    real = batch_lib.pack_routes

    def shifted(routes, *args, **kwargs):
        routes = [np.array(r) for r in routes]
        routes[0] = np.concatenate([routes[0][:1], routes[0][:-1]])
        return real(routes, *args, **kwargs)

    monkeypatch.setattr(batch_lib, "pack_routes", shifted)
    faulty = trainer.train_step(samples, adv, replay=True, old_logprobs=old)
    micro_batches = -(-len(samples) // trainer.cfg.trainer.micro_batch_size)
    assert faulty["replay_mismatch_rows"] >= micro_batches * trainer.cfg.model.num_layers
