"""GRPO steps on a fixed batch, checkpoint resume, and export of trained weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_helpers import HFReference, build_samples, random_routes, with_routes
from r3rl import metrics as M
from r3rl.train.grpo import group_advantages


def fixed_batch(seed: int = 5):
    samples = build_samples(8, seed)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=seed))
    advantages = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    assert np.abs(advantages).sum() > 0
    return samples, advantages


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.bare.named_parameters()}


def moved_toward_the_advantage(samples, adv, before, after) -> float:
    """sum_i A_i x (mean log-prob change of response i over its loss tokens): > 0 when the policy made responses
    with positive advantage more likely and those with negative advantage less likely, which is what the policy
    gradient is for. A loss with its sign flipped also lowers its own value, but moves this the other way."""
    return float(sum(a * float(((np.asarray(y) - np.asarray(x)) * s.loss_mask).sum() / s.loss_mask.sum())
                     for s, a, x, y in zip(samples, adv, before, after)))


def test_grpo_steps_raise_the_likelihood_of_advantaged_responses(new_trainer):
    """Four PPO epochs on one rollout batch. Fails if the policy loss's sign flips (the responses with negative
    advantage would gain probability), if advantages never reach the loss (nothing moves), if the ratio is not
    taken against pi_old (the first epoch, where the policy is pi_old, would clip tokens), or if the optimizer does
    not step."""
    # small enough that 4 steps stay inside the clip range (clipped tokens carry no gradient, the loss would plateau)
    trainer = new_trainer("trainer.micro_batch_size=2", "trainer.lr=3e-5")
    samples, adv = fixed_batch()
    old = trainer.logprobs(samples, replay=True).logprobs  # pi_old of this rollout batch, kept for all epochs
    steps = []
    for _ in range(4):
        m = trainer.train_step(samples, adv, replay=True, old_logprobs=old)
        assert m["optimizer_steps"] == 1 and m["skipped_steps"] == 0 and np.isfinite(m["grad_norm"])
        steps.append(m)
    after = trainer.logprobs(samples, replay=True).logprobs
    assert moved_toward_the_advantage(samples, adv, old, after) > 0
    losses = [m["loss"] for m in steps]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert steps[0]["clip_frac"] == 0.0  # ratio exactly 1 against pi_old before the first update
    assert steps[-1]["step"] == 4


def test_gspo_moves_toward_the_advantage_and_clips_whole_sequences(new_trainer):
    """``algorithm.loss=gspo``: two epochs on one rollout batch, the second with one sample's advantage only (sample
    j, whose sequence ratio the first epoch took past 1 + 0.05 while some of its tokens' own ratios stayed under it:
    per-token clipping would clip some of j's tokens, not all). The clipped tokens are then exactly j's, all of
    them. Fails if GSPO's loss never reached the trainer, if its sign were flipped, if its own clip range were not
    used (GRPO's 0.2 would leave nothing clipped after one small step), or if the ratio clipped were each token's."""
    trainer = new_trainer("trainer.micro_batch_size=2", "trainer.lr=3e-5", "algorithm.loss=gspo",
                          "algorithm.gspo_clip_eps_low=0.05", "algorithm.gspo_clip_eps_high=0.05")
    samples, adv = fixed_batch()
    old = trainer.logprobs(samples, replay=True).logprobs
    first = trainer.train_step(samples, adv, replay=True, old_logprobs=old)
    assert first["clip_frac"] == 0.0  # every sequence's ratio is exactly 1 before the first update
    now = trainer.logprobs(samples, replay=True).logprobs
    assert moved_toward_the_advantage(samples, adv, old, now) > 0
    bound = np.log1p(0.05)
    log_ratios = [(np.asarray(y) - np.asarray(x))[s.loss_mask > 0] for s, x, y in zip(samples, old, now)]
    # advantaged sequences past the bound whose tokens straddle it: where GSPO and per-token clipping part ways
    over = [i for i, r in enumerate(log_ratios) if adv[i] > 0 and r.mean() > bound and (r <= bound).any()]
    assert over, "the first epoch took no advantaged sequence past GSPO's bound with tokens under it"
    j = max(over, key=lambda i: len(log_ratios[i]))
    only = np.zeros_like(adv)
    only[j] = adv[j]
    second = trainer.train_step(samples, only, replay=True, old_logprobs=old)
    tokens = sum(int(s.loss_mask.sum()) for s in samples)
    assert second["clip_frac"] * tokens == pytest.approx(len(log_ratios[j]), abs=1e-3)


def test_gspo_averages_each_sequence_then_the_sequences(new_trainer):
    """GSPO's aggregation in Megatron: at ratio 1 (pi_old = the current weights) its gradient is GRPO's with each
    token weighted 1/|sequence| (times the mini-batch's tokens over sequences, ``sequence_mean_weights``): the mean
    over each sequence's tokens, then over sequences, as verl's ``seq-mean-token-mean`` and the GSPO paper. Fails if
    GSPO took the token mean (its gradient would equal the unweighted GRPO one, which the unequal response lengths
    here make differ)."""
    from r3rl.train.grpo import sequence_mean_weights

    samples, adv = fixed_batch(seed=9)
    assert len({int(s.loss_mask.sum()) for s in samples}) > 1
    gspo, grpo = new_trainer("algorithm.loss=gspo"), new_trainer()
    old = grpo.logprobs(samples, replay=True).logprobs
    weights = sequence_mean_weights([s.loss_mask for s in samples], len(samples))
    got = gspo.gradients(samples, adv, replay=True, old_logprobs=old)["grads"]
    weighted = grpo.gradients(samples, adv, replay=True, old_logprobs=old, is_weights=weights)["grads"]
    plain = grpo.gradients(samples, adv, replay=True, old_logprobs=old)["grads"]
    for name, g in got.items():
        assert torch.allclose(g, weighted[name], rtol=1e-4, atol=1e-7), name
    assert any(not torch.allclose(g, plain[name], rtol=1e-3, atol=1e-6) for name, g in got.items())


def test_pi_old_from_the_training_forward_is_the_separate_pass_bit_for_bit(new_trainer):
    """``train_on_policy`` (the default GRPO step) against a no-grad pi_old pass and ``train_step`` on it, from the
    same weights. Fails if its pi_old were read after the update, on other routes (live instead of replayed) or off
    the wrong tokens (the log-probs would differ), if the loss took anything but those log-probs detached (the
    updated weights would differ, or nothing would move), or if the training forwards' replay check were lost."""
    samples, adv = fixed_batch(seed=8)
    separate = new_trainer("trainer.micro_batch_size=4")
    pi_old = separate.logprobs(samples, replay=True)
    expected = separate.train_step(samples, adv, replay=True, old_logprobs=pi_old.logprobs)
    folded = new_trainer("trainer.micro_batch_size=4")
    before = params(folded)
    got, metrics = folded.train_on_policy(samples, adv, replay=True)
    assert len(got.logprobs) == len(samples)
    for i, (a, b) in enumerate(zip(got.logprobs, pi_old.logprobs)):
        assert np.array_equal(a, b), f"sample {i}: pi_old differs from the no-grad pass"
    assert got.replay_mismatch_rows == 0 and got.replayed_routes_match is True
    assert metrics == expected  # every metric: loss, ratio (exactly 1), clip fraction, grad norm, lr, step
    assert any(not torch.equal(p, before[n]) for n, p in params(folded).items())
    for name, value in params(folded).items():
        assert torch.equal(value, params(separate)[name]), name
    with pytest.raises(ValueError, match="algorithm.global_batch_size=4"):
        new_trainer("algorithm.global_batch_size=4").train_on_policy(samples, adv, replay=True)


def test_resume_reproduces_the_next_step_exactly(new_trainer, tmp_path):
    first = new_trainer("algorithm.global_batch_size=4")
    samples, adv = fixed_batch(seed=6)
    first.train_step(samples, adv, replay=True)  # two optimizer steps (8 samples, global batch 4)
    saved = first.save_checkpoint(tmp_path / "ckpt", extra={"rollout_step": 1, "note": "after one call"})
    assert (saved / "COMPLETE").is_file()
    expected = first.train_step(samples, adv, replay=True)
    expected_params = params(first)

    second = new_trainer("algorithm.global_batch_size=4")
    assert any(not torch.equal(p, expected_params[n]) for n, p in params(second).items())
    extra = second.load_checkpoint(saved)
    assert extra == {"rollout_step": 1, "note": "after one call"}
    got = second.train_step(samples, adv, replay=True)
    assert got == expected  # every metric, including lr and the optimizer step count
    for name, value in params(second).items():
        assert torch.equal(value, expected_params[name]), name


def test_exported_trained_weights_load_in_transformers(new_trainer, tmp_path):
    trainer = new_trainer("trainer.lr=1e-3")
    samples, adv = fixed_batch(seed=7)
    before = trainer.logprobs(samples, replay=False).logprobs
    trainer.train_step(samples, adv, replay=True)
    after = trainer.logprobs(samples, replay=False).logprobs
    assert max(np.abs(a - b).max() for a, b in zip(before, after)) > 1e-4  # the step moved the policy
    hf = HFReference(trainer.export_hf(tmp_path / "hf"), topk=2)
    for sample, mine in zip(samples, after):
        theirs, _ = hf.run(sample)
        assert np.abs(theirs - mine).max() < 1e-5


def test_bfloat16_training_on_cpu_keeps_float32_master_weights(new_trainer):
    trainer = new_trainer("trainer.params_dtype=bfloat16", "trainer.micro_batch_size=4", "trainer.lr=3e-4")
    assert trainer.bare.output_layer.weight.dtype == torch.bfloat16
    inner = trainer.optimizer.inner
    assert all(m.dtype == torch.float32 for m in inner.masters)
    assert all((m is not p) == (p.dtype == torch.bfloat16) for m, p in zip(inner.masters, inner.params))
    samples, adv = fixed_batch(seed=8)
    old = trainer.logprobs(samples, replay=True).logprobs
    losses = [trainer.train_step(samples, adv, replay=True, old_logprobs=old)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses
    assert moved_toward_the_advantage(samples, adv, old, trainer.logprobs(samples, replay=True).logprobs) > 0
    # the bf16 weights are the rounded float32 masters
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(inner.params, inner.masters))


def test_a_frozen_router_stays_bit_for_bit_while_everything_else_trains(new_trainer):
    """``trainer.freeze_router=true``: fails if a router weight moved by one bit over two steps, if the optimizer
    kept state for a router (it would step it once unfrozen and its checkpoint would carry dead state), or if the
    rest of the model stopped training with it."""
    trainer = new_trainer("trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.freeze_router=true")
    samples, adv = fixed_batch()
    before = params(trainer)
    for _ in range(2):
        trainer.train_step(samples, adv, replay=True)
    after = params(trainer)
    routers = [n for n in before if n.endswith("router.weight")]
    assert len(routers) == 4
    assert all(torch.equal(before[n], after[n]) for n in routers)
    others = [n for n in before if n not in routers]
    assert all(not torch.equal(before[n], after[n]) for n in others if "embedding" not in n and "norm" not in n)
    held = {id(p) for p in trainer.optimizer.inner.params}  # the CPU profile's AdamW over main_grad
    assert held and not held & {id(p) for r in trainer.routers for p in r.parameters()}


def _own_route_share_missed(samples, own_routes) -> float:
    """The share of the rollout's (row, layer, slot) experts outside the trainer's own top-k set for that row."""
    missed = total = 0
    for s, own in zip(samples, own_routes):
        rollout = np.asarray(s.routed_experts, dtype=np.int64)
        inside = (rollout[..., :, None] == np.asarray(own, dtype=np.int64)[..., None, :]).any(-1)
        missed += int((~inside).sum())
        total += inside.size
    return missed / total


def test_soft_replay_routes_the_filtered_experts_in_every_forward(new_trainer):
    """``replay=soft``. At ratio 1 the filter keeps only replayed experts the trainer picks itself: the replayed
    log-probs equal the unreplayed ones and the replace rate equals the share of rollout experts outside the
    trainer's own top-k (from Megatron's RECORD, independent of the filter). At 0.5 some replayed experts stay:
    log-probs differ from both. The probe's routing-map check recomputes the filter from the live logits and finds
    0 mismatched rows in the training forwards. Fails if the soft ``RouterReplay`` were not installed (log-probs of
    plain R3, rate 0), if the filter ran on logits instead of probabilities, or if the rate counted other slots."""
    samples, adv = fixed_batch()
    for ratio in (1.0, 0.5):
        trainer = new_trainer("trainer.micro_batch_size=2", "trainer.lr=1e-4", "replay=soft",
                              f"replay.soft_ratio={ratio}")
        soft = trainer.logprobs(samples, replay=True)
        live = trainer.logprobs(samples, replay=False).logprobs
        own = trainer.record_routes(samples)
        gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(soft.logprobs, live))
        out = trainer.train_step(samples, adv, replay=True)
        assert soft.replay_mismatch_rows == 0 and out["replay_mismatch_rows"] == 0 and out["replayed_rows"] > 0
        missed = _own_route_share_missed(samples, own)
        if ratio == 1.0:
            assert gap < 1e-5
            assert out["router_replay_replace_rate"] == pytest.approx(missed, abs=1e-9)
        else:
            assert gap > 1e-3
            assert 0 < out["router_replay_replace_rate"] < missed
        trainer.shutdown()


def test_later_mini_batches_report_their_drift_from_the_rollout(new_trainer):
    """Two optimizer steps per rollout batch: the second's forwards run on weights the first moved, so their
    |log-prob - rollout log-prob| is logged. Fails if the first mini-batch were counted (its forward is pi_old's
    own, before any update: the figure would not depend on the lr) or if one step per batch logged it, or if the
    rollout log-probs were not subtracted (they are far from 0 here), or if tokens were pooled across samples instead
    of slime's per-sample mean that train/logprob_abs_diff takes (the samples' lengths differ)."""
    samples, adv = fixed_batch()
    rng = np.random.default_rng(2)
    for s in samples:
        s.rollout_logprobs = rng.normal(-2.0, 1.0, s.response_length).astype(np.float32)
    rollout = [s.rollout_logprobs for s in samples]
    drift = {}
    for lr in (1e-6, 1e-3):
        trainer = new_trainer("trainer.micro_batch_size=2", f"trainer.lr={lr}", "algorithm.global_batch_size=4")
        out = trainer.train_step(samples, adv, replay=True)
        assert out["optimizer_steps"] == 2
        drift[lr] = out["later_minibatch_logprob_abs_diff"]
        # the same figure from the second half's log-probs (its weights are those after step 1: not recomputable
        # here, so the bound is that of the untouched weights when the lr is tiny)
        if lr == 1e-6:
            before = trainer.logprobs(samples[4:], replay=True).logprobs
            expect = M.logprob_abs_diff(before, rollout[4:], [s.loss_mask for s in samples[4:]])
            assert drift[lr] == pytest.approx(expect, rel=1e-2)
        trainer.shutdown()
    assert drift[1e-3] > drift[1e-6]
    one = new_trainer("trainer.micro_batch_size=2").train_step(samples, adv, replay=True)
    assert "later_minibatch_logprob_abs_diff" not in one
