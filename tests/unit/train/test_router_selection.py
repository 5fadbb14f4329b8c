"""What a sigmoid router with an expert-score correction bias and group-limited top-k selects, three ways that must
agree: transformers' GLM-4.5 / DeepSeek-V3 router (what the checkpoint's engine computes), Megatron's routing
function (what the trainer computes), and r3rl's ``selection_scores`` (what the route probe ranks by)."""

from __future__ import annotations

import types

import pytest
import torch

from r3rl.train.replay import rounding_reach, selection_scores

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



def test_rounding_reach_counts_the_logits_and_the_router_inputs_rounding(case):
    """The doctor's flip bound counts rows whose margin the engine's rounding can close. Checked by rounding for
    real: with the router's inputs h rounded to bfloat16 (as a float32 gate fed a bf16 engine's hidden states sees
    them) and the two logits nudged apart by u|x| (the k-th down, the (k+1)-th up), every row whose pick of the two
    experts swaps is within the reach, and a sigmoid router's reach (its scores move by the slope s (1 - s) of the
    logits' move) is below that of a router ranked by its logits. Fails if the reach left out the input's rounding
    (GLM-4.5's float32 gate would flip rows it never counts, and a sound engine would fail the doctor), took u of
    the biased scores, or lost the sigmoid's slope."""
    _, bias = case
    torch.manual_seed(5)
    hidden = torch.randn(2048, 32)
    router = probe_router(1, 1, bias)
    router.weight = torch.randn(EXPERTS, 32) * 0.3
    logits = hidden @ router.weight.T
    u, k = 2.0 ** -8, TOPK
    top = torch.topk(selection_scores(logits, router), k + 1, dim=-1)
    reach = rounding_reach(hidden, logits, top, k, router, u)
    margin = (top.values[:, k - 1] - top.values[:, k]).double()
    pair = top.indices[:, k - 1:k + 1]
    rounded = (hidden.bfloat16().float() @ router.weight.T).gather(1, pair).double()
    nudged = rounded + u * rounded.abs() * torch.tensor([-1.0, 1.0], dtype=torch.float64)
    scores = torch.sigmoid(nudged) + bias.double()[pair]
    swapped = scores[:, 0] < scores[:, 1]
    assert swapped.sum() >= 10 and (margin[swapped] < reach[swapped]).all()
    no_input = u * (torch.sigmoid(logits.gather(1, pair).double()) * (1 - torch.sigmoid(logits.gather(1, pair)
                    .double())) * logits.gather(1, pair).double().abs()).sum(-1)
    assert (margin[swapped] >= no_input[swapped]).sum() >= 3  # the input's rounding alone flips some rows
    naive = u * top.values[:, k - 1:k + 1].double().abs().sum(-1)
    assert (margin < naive).sum() > (margin < reach).sum()
    softmax = types.SimpleNamespace(config=types.SimpleNamespace(moe_router_score_function="softmax"),
                                    weight=router.weight)
    plain = torch.topk(logits, k + 1, dim=-1)
    assert (rounding_reach(hidden, logits, plain, k, softmax, u) >= u * plain.values[:, k - 1:k + 1].double()
            .abs().sum(-1)).all()


@pytest.mark.parametrize("engine", ["bf16 gate (Qwen3)", "float32 gate on bf16 inputs (GLM-4.5)"])
def test_rounding_reach_holds_every_flip_of_real_bfloat16_arithmetic(engine):
    """Against an engine computed for real, not the reach's own model: torch's bfloat16 matmul of bf16 hidden states
    and bf16 router weights with a bf16 output (Qwen3's gate), or vLLM's float32 GLM-4.5 gate over bf16 hidden
    states with a sigmoid and a correction bias. Every row whose top-k set differs from the float32 trainer's (about
    0.3-0.8% of 20,000) must lie within the reach, and the reach must not be vacuous (under a tenth of the rows).
    Fails if the reach dropped the input's rounding (flips escape on both engines) or the logit's own rounding
    (flips escape the bf16 gate), which the planted variants below show."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(20000, 64), torch.randn(EXPERTS, 64) * 0.3
    sigmoid = engine.startswith("float32")
    config = types.SimpleNamespace(moe_router_score_function="sigmoid" if sigmoid else "softmax",
                                   moe_router_num_groups=None, moe_router_group_topk=None, moe_router_topk=TOPK)
    router = types.SimpleNamespace(config=config, weight=weight,
                                   expert_bias=torch.randn(EXPERTS) * 0.3 if sigmoid else None)
    logits = hidden @ weight.T
    top = torch.topk(selection_scores(logits, router), TOPK + 1, dim=-1)
    engine_logits = hidden.bfloat16().float() @ weight.T if sigmoid else \
        (hidden.bfloat16() @ weight.bfloat16().T).float()
    picked = torch.topk(selection_scores(engine_logits, router), TOPK, dim=-1).indices
    flipped = (as_sets(picked) != as_sets(top.indices[:, :TOPK])).any(-1)
    margin = (top.values[:, TOPK - 1] - top.values[:, TOPK]).double()
    u = 2.0 ** -8
    reach = rounding_reach(hidden, logits, top, TOPK, router, u)
    assert flipped.sum() >= 50 and not (flipped & (margin >= reach)).any()
    assert (margin < reach).double().mean() < 0.1
    # planted: the reach without the input's rounding, and (for the bf16 gate) without the logit's own
    pair = top.indices[:, TOPK - 1:TOPK + 1]
    x = logits.gather(1, pair).double()
    slope = torch.sigmoid(x) * (1 - torch.sigmoid(x)) if sigmoid else 1.0
    assert (flipped & (margin >= u * (slope * x.abs()).sum(-1))).any()
    if not sigmoid:
        spread = torch.sqrt(hidden.square() @ weight.square().T).gather(1, pair).double()
        assert (flipped & (margin >= u * spread.sum(-1))).any()


def test_the_drift_pass_measures_a_group_limited_router_on_its_ungrouped_scores(case):
    """DeepSeek-V3's group-limited top-k: where the perturbed pass chose other groups, the unperturbed pass's pair
    sits in a masked group (-inf). Its move is read on the ungrouped scores, and the flip is counted. Fails if the
    mean move went NaN or infinite (what the masked scores gave: the tiny DeepSeek-V3's doctor printed NaN), or if
    the flip or the row's reach went uncounted."""
    from r3rl.train.replay import DriftReference, RouteProbe

    logits, bias = case
    router = probe_router(GROUPS, GROUP_TOPK, bias)
    scores = selection_scores(logits, router)
    top = torch.topk(scores, TOPK + 1, dim=-1)
    own, margins = top.indices[:, :TOPK], top.values[:, TOPK - 1].double() - top.values[:, TOPK].double()
    reach = torch.full_like(margins, 1e-6)
    ref = DriftReference()
    probe = types.SimpleNamespace(drift=ref)
    acc = {name: torch.zeros(1, dtype=torch.float64 if name == "drift_over_reach" else torch.int64)
           for name in ("drift_reachable", "drift_flips", "drift_over_reach")}
    response = torch.ones(len(margins), dtype=torch.bool)
    RouteProbe._drift(probe, acc, 0, top, own, margins, reach, response, None)
    ref.keeping = False
    moved = logits.clone()
    moved[0, own[0]] -= 50.0  # row 0's chosen experts collapse: other groups win it
    moved_scores = selection_scores(moved, router)
    moved_top = torch.topk(moved_scores, TOPK + 1, dim=-1)
    assert torch.isinf(moved_scores.gather(1, top.indices[:1, TOPK - 1:TOPK + 1])).any()  # the grouped pair is masked
    RouteProbe._drift(probe, acc, 0, moved_top, moved_top.indices[:, :TOPK], margins, reach, response,
                      selection_scores(moved, router, grouped=False))
    assert torch.isfinite(acc["drift_over_reach"]).all() and acc["drift_over_reach"].item() > 0
    assert acc["drift_flips"].item() == 1 and acc["drift_reachable"].item() >= 1
