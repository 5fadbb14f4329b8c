"""HF <-> Megatron name and layout mapping on full tensors, and tensor-parallel slicing (no Megatron needed)."""

from __future__ import annotations

import pytest
import torch

from r3rl.train.convert import (AttentionShape, ParamRef, full_from_hf, full_to_hf, hf_names, parse_name,
                                qkv_from_hf, qkv_to_hf, shard, unshard)

SHAPE = AttentionShape(num_heads=4, num_groups=2, head_dim=3)
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
    with pytest.raises(KeyError, match="expert_bias"):
        parse_name("decoder.layers.0.mlp.router.expert_bias", layers, 0)


def test_every_kind_round_trips_through_hf_names():
    refs = [ParamRef("embed"), ParamRef("final_norm"), ParamRef("output"), ParamRef("input_norm", 2),
            ParamRef("qkv", 2), ParamRef("proj", 2), ParamRef("q_norm", 2), ParamRef("k_norm", 2),
            ParamRef("pre_mlp_norm", 2), ParamRef("router", 2), ParamRef("fc1", 2, 5), ParamRef("fc2", 2, 5)]
    shapes = {"q_proj": (12, HIDDEN), "k_proj": (6, HIDDEN), "v_proj": (6, HIDDEN)}
    store = {}
    for ref in refs:
        for name in hf_names(ref):
            key = name.split(".")[-2]
            store[name] = torch.randn(shapes.get(key, (4, HIDDEN)))
    for ref in refs:
        full = full_from_hf(ref, store.__getitem__, SHAPE)
        back = full_to_hf(ref, full, SHAPE)
        assert set(back) == set(hf_names(ref))
        assert all(torch.equal(back[n], store[n]) for n in back)
    assert hf_names(ParamRef("pre_mlp_norm", 2)) == ["model.layers.2.post_attention_layernorm.weight"]
    assert hf_names(ParamRef("router", 2)) == ["model.layers.2.mlp.gate.weight"]


@pytest.mark.parametrize("kind, dim", [("fc1", 0), ("proj", 1), ("qkv", 0)])
def test_tensor_parallel_shards_reassemble(kind, dim):
    full = torch.randn(8, 6)
    pieces = [shard(full, ParamRef(kind), dim, 2, r) for r in range(2)]
    assert torch.equal(unshard(pieces, ParamRef(kind), dim), full)
    if kind == "fc1":
        # each rank holds the matching halves of gate (rows 0-3) and up (rows 4-7)
        assert torch.equal(pieces[0], torch.cat([full[0:2], full[4:6]]))
    assert torch.equal(shard(full, ParamRef(kind), None, 2, 1), full)
