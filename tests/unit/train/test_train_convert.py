"""HF <-> Megatron name and layout mapping on full tensors, and tensor-parallel slicing (no Megatron needed)."""

from __future__ import annotations

import pytest
import torch

from r3rl.train.convert import (HFLayout, ParamRef, full_from_hf, full_to_hf, hf_names, parse_name,
                                qkv_from_hf, qkv_to_hf, shard, unshard)

SHAPE = HFLayout(num_heads=4, num_groups=2, head_dim=3)
GLM = HFLayout(num_heads=4, num_groups=2, head_dim=3, shared_experts="shared_experts",
               router_bias="gate.e_score_correction_bias")
HIDDEN = 5


def test_qkv_rows_are_grouped_per_query_group():
    q = torch.arange(4 * 3 * HIDDEN, dtype=torch.float32).reshape(12, HIDDEN)
    k = -torch.arange(2 * 3 * HIDDEN, dtype=torch.float32).reshape(6, HIDDEN) - 1
    v = 1000 + torch.arange(2 * 3 * HIDDEN, dtype=torch.float32).reshape(6, HIDDEN)
    fused = qkv_from_hf(q, k, v, SHAPE)
    # group 0: heads 0-1 of q, then k_0, then v_0; group 1 likewise
    assert torch.equal(fused[0:6], q[0:6]) and torch.equal(fused[6:9], k[0:3]) and torch.equal(fused[9:12], v[0:3])
    assert torch.equal(fused[12:18], q[6:12]) and torch.equal(fused[18:21], k[3:6])
    back = qkv_to_hf(fused, SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_parse_names_of_both_layer_specs():
    layers = {0: 6, 1: 7}
    assert parse_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", layers, 4) == \
        ParamRef("fc1", 7, 7)
    assert parse_name("decoder.layers.0.mlp.experts.linear_fc2.weight2", layers, 0) == ParamRef("fc2", 6, 2)
    assert parse_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", layers, 0) == \
        ParamRef("input_norm", 6)
    assert parse_name("output_layer.weight", layers, 0) == ParamRef("output")
    assert parse_name("decoder.layers.0.mlp.router.expert_bias", layers, 0) == ParamRef("router_bias", 6)
    assert parse_name("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", layers, 0) == ParamRef("pre_mlp_norm", 7)
    with pytest.raises(KeyError, match="local_tokens_per_expert"):
        parse_name("decoder.layers.0.mlp.router.local_tokens_per_expert", layers, 0)


def test_every_kind_round_trips_through_hf_names():
    refs = [ParamRef("embed"), ParamRef("final_norm"), ParamRef("output"), ParamRef("input_norm", 2),
            ParamRef("qkv", 2), ParamRef("qkv_bias", 2), ParamRef("proj", 2), ParamRef("q_norm", 2),
            ParamRef("k_norm", 2), ParamRef("pre_mlp_norm", 2), ParamRef("router", 2), ParamRef("router_bias", 2),
            ParamRef("fc1", 2, 5), ParamRef("fc2", 2, 5), ParamRef("dense_fc1", 0), ParamRef("dense_fc2", 0),
            ParamRef("shared_fc1", 2), ParamRef("shared_fc2", 2)]
    shapes = {("q_proj", "weight"): (12, HIDDEN), ("k_proj", "weight"): (6, HIDDEN), ("v_proj", "weight"): (6, HIDDEN),
              ("q_proj", "bias"): (12,), ("k_proj", "bias"): (6,), ("v_proj", "bias"): (6,),
              ("gate", "e_score_correction_bias"): (8,)}
    store = {}
    for ref in refs:
        for name in hf_names(ref, GLM):
            key = tuple(name.split(".")[-2:])
            store[name] = torch.randn(shapes.get(key, (4, HIDDEN)))
    for ref in refs:
        full = full_from_hf(ref, store.__getitem__, GLM)
        back = full_to_hf(ref, full, GLM)
        assert set(back) == set(hf_names(ref, GLM))
        assert all(torch.equal(back[n], store[n]) for n in back)
    assert hf_names(ParamRef("pre_mlp_norm", 2), SHAPE) == ["model.layers.2.post_attention_layernorm.weight"]
    assert hf_names(ParamRef("router", 2), SHAPE) == ["model.layers.2.mlp.gate.weight"]
    assert hf_names(ParamRef("router_bias", 2), GLM) == ["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert hf_names(ParamRef("shared_fc2", 1), GLM) == ["model.layers.1.mlp.shared_experts.down_proj.weight"]
    assert hf_names(ParamRef("dense_fc1", 0), GLM) == ["model.layers.0.mlp.gate_proj.weight",
                                                       "model.layers.0.mlp.up_proj.weight"]
    # a Qwen3-MoE has neither: a Megatron model built with them is refused, naming the config
    with pytest.raises(KeyError, match="expert_bias"):
        hf_names(ParamRef("router_bias", 2), SHAPE)


def test_qkv_bias_fuses_per_group_like_its_rows():
    """The bias of a fused qkv row is the bias of the HF row it came from; fails if biases were concatenated
    [q; k; v] instead of interleaved per query group (GLM-4.5's attention_bias)."""
    q, k, v = (torch.randn(n, HIDDEN) for n in (12, 6, 6))
    qb, kb, vb = torch.randn(12), torch.randn(6), torch.randn(6)
    fused, fused_bias = qkv_from_hf(q, k, v, SHAPE), qkv_from_hf(qb, kb, vb, SHAPE)
    rows = torch.cat([q, k, v]), torch.cat([qb, kb, vb])
    for i in range(fused.shape[0]):
        j = int(((rows[0] - fused[i]).abs().sum(-1) == 0).nonzero()[0])
        assert fused_bias[i] == rows[1][j]


@pytest.mark.parametrize("kind, dim", [("fc1", 0), ("proj", 1), ("qkv", 0)])
def test_tensor_parallel_shards_reassemble(kind, dim):
    full = torch.randn(8, 6)
    pieces = [shard(full, ParamRef(kind), dim, 2, r) for r in range(2)]
    assert torch.equal(unshard(pieces, ParamRef(kind), dim), full)
    if kind == "fc1":
        # each rank holds the matching halves of gate (rows 0-3) and up (rows 4-7)
        assert torch.equal(pieces[0], torch.cat([full[0:2], full[4:6]]))
    assert torch.equal(shard(full, ParamRef(kind), None, 2, 1), full)


def test_multi_latent_attention_names():
    """DeepSeek-V3's attention maps one to one (no reordering: Megatron's MLA de-interleaves the rope dimensions as
    transformers does), and MLA's q_layernorm is the query latent's norm, not a per-head q_norm."""
    mla = HFLayout(num_heads=4, num_groups=4, head_dim=16, mla=True)
    p = "model.layers.3.self_attn."
    expected = {"q_full": "q_proj.weight", "q_down": "q_a_proj.weight", "q_up": "q_b_proj.weight",
                "q_norm": "q_a_layernorm.weight", "q_latent_norm": "q_a_layernorm.weight",
                "kv_down": "kv_a_proj_with_mqa.weight", "kv_up": "kv_b_proj.weight",
                "kv_latent_norm": "kv_a_layernorm.weight"}
    for kind, name in expected.items():
        ref = ParamRef(kind, 3)
        assert hf_names(ref, mla) == [p + name]
        t = torch.randn(6, HIDDEN)
        assert torch.equal(full_to_hf(ref, full_from_hf(ref, {p + name: t}.__getitem__, mla), mla)[p + name], t)
    layers = {0: 3}
    assert parse_name("decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight", layers, 0) == \
        ParamRef("kv_latent_norm", 3)
    assert parse_name("decoder.layers.0.self_attention.q_layernorm.weight", layers, 0) == ParamRef("q_norm", 3)
    assert hf_names(ParamRef("q_norm", 3), SHAPE) == [p + "q_norm.weight"]  # Qwen3's per-head norm
