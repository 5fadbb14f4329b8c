"""What a sigmoid router with an expert-score correction bias and group-limited top-k selects, three ways that must
agree: transformers' GLM-4.5 / DeepSeek-V3 router (what the checkpoint's engine computes), Megatron's routing
function (what the trainer computes), and r3rl's ``selection_scores`` (what the route probe ranks by)."""

from __future__ import annotations

import types

import pytest
import torch

from r3rl.train.replay import selection_scores

EXPERTS, TOPK, GROUPS, GROUP_TOPK = 16, 4, 4, 2


def hf_router(groups: int, group_topk: int, bias: torch.Tensor):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=EXPERTS, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK, n_group=groups,
                           topk_group=group_topk, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(EXPERTS))  # the router's logits are its inputs: fed the test's logits
        router.e_score_correction_bias.copy_(bias)
    return router


def megatron_topk(logits: torch.Tensor, bias: torch.Tensor, groups: int | None, group_topk: int | None):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs, routing_map = topk_routing_with_score_function(
        logits, TOPK, use_pre_softmax=False, num_groups=groups, group_topk=group_topk, scaling_factor=2.5,
        score_function="sigmoid", expert_bias=bias)
    return routing_map, probs


def probe_router(groups: int, group_topk: int, bias: torch.Tensor):
    config = types.SimpleNamespace(moe_router_score_function="sigmoid", moe_router_num_groups=groups,
                                   moe_router_group_topk=group_topk, moe_router_topk=TOPK)
    return types.SimpleNamespace(config=config, expert_bias=bias)


@pytest.fixture
def case():
    torch.manual_seed(3)
    logits = torch.randn(256, EXPERTS) * 2
    bias = torch.randn(EXPERTS) * 0.3
    return logits, bias


def as_sets(indices: torch.Tensor) -> torch.Tensor:
    return torch.zeros(indices.shape[0], EXPERTS, dtype=torch.bool).scatter(1, indices, True)


def test_megatron_and_the_probe_select_as_transformers_with_groups_and_bias(case):
    """Megatron (moe_router_num_groups / group_topk, expert bias) and the probe pick transformers' experts and
    Megatron's weights equal transformers' (bias-free sigmoid scores, renormalised, x 2.5); fails if either ignored
    the group limit or the bias, or took the weights from the biased scores."""
    logits, bias = case
    hf_logits, hf_weights, hf_idx = hf_router(GROUPS, GROUP_TOPK, bias)(logits)
    assert torch.equal(hf_logits, logits)
    routing_map, probs = megatron_topk(logits, bias, GROUPS, GROUP_TOPK)
    assert torch.equal(routing_map, as_sets(hf_idx))
    assert torch.allclose(probs.gather(1, hf_idx), hf_weights, atol=1e-6)
    own = torch.topk(selection_scores(logits, probe_router(GROUPS, GROUP_TOPK, bias)), TOPK, dim=-1).indices
    assert torch.equal(as_sets(own), as_sets(hf_idx))


def test_group_limits_ignored_or_bias_dropped_route_otherwise(case):
    """The controls: without the group limit, or without the bias, the selection differs from transformers' on
    some tokens (so the agreement above is not a coincidence of the draw)."""
    logits, bias = case
    hf_idx = hf_router(GROUPS, GROUP_TOPK, bias)(logits)[2]
    no_groups, _ = megatron_topk(logits, bias, None, None)
    no_bias, _ = megatron_topk(logits, None, GROUPS, GROUP_TOPK)
    assert not torch.equal(no_groups, as_sets(hf_idx)) and not torch.equal(no_bias, as_sets(hf_idx))
    probe_no_groups = torch.topk(selection_scores(logits, probe_router(1, 1, bias)), TOPK, dim=-1).indices
    assert not torch.equal(as_sets(probe_no_groups), as_sets(hf_idx))
