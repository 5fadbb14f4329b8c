"""R2 (the trainer's own routes, recorded in the old-log-prob pass, replayed in training) and several optimizer steps
per rollout batch with replay and rollout correction, on the real tiny Qwen3-MoE (Megatron-core on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl.train.correction import Correction, correct
from r3rl.train.grpo import group_advantages


def test_r2_records_the_routes_of_the_old_logprob_pass_and_replays_them_bitwise(policy):
    samples = build_samples(8, 11)  # varied lengths: micro batches of 4 carry padding
    plain = policy.logprobs(samples, replay=False)
    own = policy.logprobs(samples, replay=False, record=True)
    m = policy.cfg.model
    # recording changes nothing of the pass itself
    assert all(np.array_equal(a, b) for a, b in zip(plain.logprobs, own.logprobs))
    routes = own.recorded_routes
    assert [r.shape for r in routes] == [(s.num_tokens - 1, m.num_layers, m.moe_topk) for s in samples]
    assert all(r.dtype == np.uint8 for r in routes)
    # the recorded sets are exactly the router's own top-k on every (token, layer): flip rate 0 against them
    with_routes(samples, routes)
    live = policy.logprobs(samples, replay=False)
    assert np.array_equal(live.flip_per_layer, np.zeros(m.num_layers))
    # replayed, Megatron's routing map equals the recorded routes on every row of every layer
    replayed = policy.logprobs(samples, replay=True)
    assert replayed.replayed_routes_match is True and replayed.replay_mismatch_rows == 0
    # equal lengths (no padding rows): replaying the recorded routes reproduces the recording pass bit for bit
    even = build_samples(4, 12, lengths=(7, 6))
    rec = policy.logprobs(even, replay=False, record=True)
    again = policy.logprobs(with_routes(even, rec.recorded_routes), replay=True)
    assert all(np.array_equal(a, b) for a, b in zip(rec.logprobs, again.logprobs))


def test_recording_is_refused_under_replay(policy):
    samples = build_samples(2, 13)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=13))
    with pytest.raises(ValueError, match="unreplayed"):
        policy.logprobs(samples, replay=True, record=True)


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.bare.named_parameters()}


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_half_batch_steps_keep_routes_old_logprobs_and_corrections_with_their_samples(new_trainer, mode):
    """global_batch_size = half the samples: two optimizer steps per call. The same updates made as two calls on the
    two halves, each with its own share of routes, pi_old and correction, give bitwise the same weights."""
    samples = build_samples(8, 21)
    adv = group_advantages([float(i % 3) for i in range(8)], [s.group for s in samples], normalize_std=True)
    whole = new_trainer("algorithm.global_batch_size=4", "trainer.lr=1e-3")
    if mode == "r3":  # the engine's routes
        routes = random_routes(samples, 4, 2, 8, seed=21)
        old = whole.logprobs(with_routes(samples, routes), replay=True).logprobs
    else:  # the trainer's own, recorded in the old-log-prob pass
        rec = whole.logprobs(samples, replay=False, record=True)
        routes, old = rec.recorded_routes, rec.logprobs
        with_routes(samples, routes)
    rng = np.random.default_rng(21)
    rollout = [o + rng.normal(0, 0.6, o.shape).astype(np.float32) for o in old]
    fix = correct(Correction("icepop", ratio_low=0.5, ratio_high=2.0), old, rollout, [s.loss_mask for s in samples])
    assert 0 < fix.metrics["rollout_corr/rollout_rs_masked_fraction"] < 1

    out = whole.train_step(samples, adv, replay=True, old_logprobs=old, is_weights=fix.weights,
                           loss_masks=fix.loss_masks)
    assert out["optimizer_steps"] == 2 and out["skipped_steps"] == 0
    # every training forward of both optimizer steps used the given routes on every (token, layer)
    assert out["replay_mismatch_rows"] == 0
    assert out["replayed_rows"] == sum(s.num_tokens - 1 for s in samples) * 4
    assert out["loss_tokens"] == sum(float(m.sum()) for m in fix.loss_masks)

    halves = new_trainer("algorithm.global_batch_size=4", "trainer.lr=1e-3")
    for part in (slice(0, 4), slice(4, 8)):
        got = halves.train_step(samples[part], adv[part], replay=True, old_logprobs=old[part],
                                is_weights=fix.weights[part], loss_masks=fix.loss_masks[part])
        assert got["replay_mismatch_rows"] == 0
    expected = params(whole)
    for name, value in params(halves).items():
        assert torch.equal(value, expected[name]), name
    # weights handed to the wrong samples are refused, naming them
    order = [4, 5, 6, 7, 0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"is_weights of samples \[.*one value per response token"):
        halves.train_step(samples, adv, replay=True, old_logprobs=old,
                          is_weights=[fix.weights[i] for i in order], loss_masks=fix.loss_masks)
