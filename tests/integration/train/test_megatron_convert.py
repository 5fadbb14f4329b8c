"""HF <-> Megatron conversion on the real tiny Qwen3-MoE: exact round trip, and agreement with transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from megatron_helpers import build_samples, with_routes


def read_all(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


def assert_same_tensors(source: dict, exported: dict) -> None:
    """The same tensor names, and every tensor bit for bit in the same dtype."""
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and bool((exported[name] == tensor).all()), name


def test_round_trip_is_exact(policy, tiny_model_dir, tmp_path):
    out = policy.export_hf(tmp_path / "export")
    assert_same_tensors(read_all(tiny_model_dir), read_all(out))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]


def test_logprobs_and_routing_match_transformers_in_float32(policy, hf_reference):
    samples = build_samples(8, 21)
    hf_logprobs, hf_routes = zip(*(hf_reference.run(s) for s in samples))
    own = policy.record_routes(samples)
    for i, (mine, theirs) in enumerate(zip(own, hf_routes)):
        assert mine.shape == theirs.shape == (samples[i].num_tokens - 1, 4, 2)
        # identical top-k sets in every layer for every token
        assert np.array_equal(np.sort(mine, axis=-1), np.sort(theirs, axis=-1)), f"sample {i}"
    live = policy.logprobs(with_routes(samples, list(hf_routes)), replay=False)
    assert max(np.abs(a - b).max() for a, b in zip(live.logprobs, hf_logprobs)) < 1e-5
    assert np.array_equal(live.flip_per_layer, np.zeros(4))
    replayed = policy.logprobs(samples, replay=True)
    assert max(np.abs(a - b).max() for a, b in zip(replayed.logprobs, hf_logprobs)) < 1e-5


def test_model_is_a_qwen3_moe(policy, tiny_cfg):
    m, model = tiny_cfg.model, policy.bare
    config = model.config
    assert config.normalization == "RMSNorm" and config.qk_layernorm and config.gated_linear_unit
    assert config.num_moe_experts == m.num_experts and config.moe_router_topk == m.moe_topk
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert config.moe_enable_routing_replay and not config.moe_router_fusion
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(m.rope_theta ** (-2 / m.head_dim), rel=1e-6)
    # untied: the output layer is its own parameter
    assert model.output_layer.weight.data_ptr() != model.embedding.word_embeddings.weight.data_ptr()
    assert [r.layer_number for r in policy.routers] == list(range(1, m.num_layers + 1))
    assert all(r.router_replay is not None for r in policy.routers)
