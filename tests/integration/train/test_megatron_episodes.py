"""Multi-turn episodes in the real trainer (tiny Qwen3-MoE, CPU): observation tokens sit in the response with loss
mask 0 and get no gradient, whatever advantage or old log-prob they carry."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl.train.grpo import group_advantages

REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_observation_tokens_get_no_gradient(policy):
    """Every sample's middle third of the response is an observation (loss mask 0, as ``r3rl.env.stitch`` writes
    it). Giving those tokens huge advantages and moved old log-probs changes nothing: not the loss, not its token
    count, not one gradient. Fails if the GRPO loss read the advantage or ratio of a masked token, or counted it in
    the denominator (an episode's observations would then be trained on as if the policy wrote them)."""
    samples = build_samples(len(REWARDS), seed=7)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=7))
    episodes = []
    for s in samples:
        third = s.response_length // 3
        mask = np.ones(s.response_length, np.float32)
        mask[third:2 * third] = 0.0
        episodes.append(dataclasses.replace(s, loss_mask=mask))
    adv = group_advantages(REWARDS, [s.group for s in episodes], normalize_std=True)
    base_adv = [np.full(s.response_length, a, dtype=np.float32) for s, a in zip(episodes, adv)]
    old = policy.logprobs(episodes, replay=True).logprobs
    base = policy.gradients(episodes, base_adv, replay=True, old_logprobs=old)
    wild_adv, wild_old = [], []
    for s, a, o in zip(episodes, base_adv, old):
        obs = s.loss_mask == 0
        wild_adv.append(np.where(obs, 1e4, a).astype(np.float32))
        wild_old.append(np.where(obs, o - 3.0, o).astype(np.float32))
    wild = policy.gradients(episodes, wild_adv, replay=True, old_logprobs=wild_old)
    assert wild["loss_tokens"] == base["loss_tokens"] == sum(float(s.loss_mask.sum()) for s in episodes)
    assert wild["loss"] == base["loss"]
    for name, g in base["grads"].items():
        assert torch.equal(wild["grads"][name], g), name
    assert any(float(g.abs().sum()) > 0 for g in base["grads"].values())
