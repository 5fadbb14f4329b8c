"""Soft replay's filter (``replay=soft``) on router scores worked out by hand, and its Megatron ``RouterReplay``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from r3rl.train.replay import _soft_router_replay, selection_probs, soft_targets

# one row, 6 experts, top-3: the trainer's own top-3 is experts 0, 1, 2 (weakest 0.20)
PROBS = torch.tensor([[0.30, 0.25, 0.20, 0.12, 0.09, 0.04]])


def test_a_replayed_expert_stays_only_above_the_ratio_of_the_weakest_own_score():
    """Replayed 0, 3, 5 at ratio 0.5 (threshold 0.10): 0 (0.30) and 3 (0.12) stay, 5 (0.04) gives its slot to the
    trainer's best expert not kept (1). Fails if the threshold used the strongest own score (0.15: 3 would go), if
    the refill took an expert already kept (0) or the trainer's weakest rather than its best free one, or if the
    kept slots moved."""
    chosen, replaced = soft_targets(PROBS, torch.tensor([[0, 3, 5]]), 0.5)
    assert chosen.tolist() == [[0, 3, 1]]
    assert replaced.tolist() == [[False, False, True]]


def test_two_rejected_slots_take_the_trainers_free_experts_in_its_order():
    """Replayed 4, 2, 5 at ratio 0.5: only 2 stays; the two rejected slots take 0 then 1 (2 is already kept).
    Fails if the j-th rejected slot did not take the j-th free candidate."""
    chosen, replaced = soft_targets(PROBS, torch.tensor([[4, 2, 5]]), 0.5)
    assert chosen.tolist() == [[0, 2, 1]]
    assert replaced.tolist() == [[True, False, True]]


@pytest.mark.parametrize("replayed", [[3, 4, 5], [5, 0, 4], [2, 1, 0]])
def test_ratio_zero_is_r3_and_ratio_one_is_the_trainers_own_routing(replayed):
    """Fails if ratio 0 ever overrode the rollout (soft replay at 0 must be R3) or if ratio 1 left any expert the
    trainer would not pick itself (it must route as unreplayed)."""
    target = torch.tensor([replayed])
    zero, none_replaced = soft_targets(PROBS, target, 0.0)
    assert torch.equal(zero, target) and not none_replaced.any()
    one, _ = soft_targets(PROBS, target, 1.0)
    assert sorted(one[0].tolist()) == [0, 1, 2]


def test_rows_are_filtered_independently_and_experts_never_repeat():
    """Many random rows: every chosen set has K distinct experts, every kept slot holds its replayed expert and
    clears the threshold, every replaced slot's expert is among the trainer's own top-k. Fails on a refill that
    duplicates an expert (Megatron's routing map would then route fewer than K)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(500, 16, generator=gen), dim=-1)
    replayed = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(500)])
    chosen, replaced = soft_targets(probs, replayed, 0.6)
    own = torch.topk(probs, 4).indices
    weakest = torch.topk(probs, 4).values[:, -1:]
    assert all(len(set(r)) == 4 for r in chosen.tolist())
    kept = ~replaced
    assert torch.equal(chosen[kept], replayed[kept])
    assert (probs.gather(1, replayed)[kept] >= 0.6 * weakest.expand(-1, 4)[kept]).all()
    assert (chosen[:, :, None] == own[:, None, :]).any(-1)[replaced].all()
    assert 0 < replaced.float().mean() < 1


def test_logits_are_compared_as_probabilities():
    """Qwen3 routers hand the top-k raw logits (softmax after the top-k); a ratio of logits means nothing (the weakest
    can be negative). Fails if ``selection_probs`` passed logits through for that router."""
    logits = torch.tensor([[2.0, 1.0, -0.5, -1.0]])
    post = SimpleNamespace(moe_router_score_function="softmax", moe_router_pre_softmax=False)
    pre = SimpleNamespace(moe_router_score_function="softmax", moe_router_pre_softmax=True)
    assert torch.allclose(selection_probs(logits, post), torch.softmax(logits, -1))
    assert torch.equal(selection_probs(logits, pre), logits)  # already softmaxed by Megatron there


def test_the_backward_recompute_replays_what_the_forward_routed():
    """Megatron's ``RouterReplay`` with the soft filter: the forward routes the filtered experts with their scores
    and the queue the backward recompute pops holds them too. Fails if the recompute would replay the unfiltered
    rollout route (a backward on other experts than the forward's)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    config = SimpleNamespace(moe_router_score_function="softmax", moe_router_pre_softmax=True)
    replay = _soft_router_replay(0.5, config)
    try:
        replay.set_target_indices(torch.tensor([[0, 3, 5]]))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs, chosen = replay.get_replay_topk(PROBS, 3)
        assert chosen.tolist() == [[0, 3, 1]]
        assert torch.equal(probs, PROBS.gather(1, chosen))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        _, again = replay.get_replay_topk(PROBS, 3)
        assert again.tolist() == [[0, 3, 1]] and replay.replay_backward_list == []
    finally:
        RouterReplay.global_router_replay_instances.remove(replay)


@pytest.mark.parametrize("router, named", [
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "score function sigmoid"),
    (dict(moe_router_enable_expert_bias=True), "expert-score correction bias"),
    (dict(moe_router_num_groups=8, moe_router_group_topk=4), "group-limited top-k (8 groups)"),
])
def test_soft_replay_refuses_routers_it_cannot_filter(router, named):
    """Sigmoid routers with an expert-score bias and group-limited top-k (GLM-4.5, DeepSeek-V3) select on scores
    ``soft_targets`` does not compute. Fails if such a router got the soft filter (it would compare unbiased scores
    over all groups), or the error did not name ``replay=soft`` and the router's feature."""
    from r3rl.train.replay import check_soft_replay_router

    config = SimpleNamespace(**{"moe_router_score_function": "softmax", "moe_router_pre_softmax": False, **router})
    with pytest.raises(ValueError, match=f"replay=soft.*{re.escape(named)}"):
        check_soft_replay_router(config)
    with pytest.raises(ValueError, match="replay=soft"):
        _soft_router_replay(0.5, config)
    check_soft_replay_router(SimpleNamespace(moe_router_score_function="softmax", moe_router_num_groups=None))
