"""TransformerConfig settings come from plan.megatron_config; replay safety checks happen before any model exists."""

from __future__ import annotations

import pytest
import torch

from r3rl.plan import megatron_config
from r3rl.train.model import model_settings


def test_settings_follow_the_plan(tiny_cfg):
    s = model_settings(tiny_cfg)
    plan = megatron_config(tiny_cfg, "float32")
    for key in ("num_layers", "hidden_size", "num_query_groups", "num_moe_experts", "moe_router_topk",
                "qk_layernorm", "normalization", "moe_router_pre_softmax", "moe_enable_routing_replay"):
        assert s.transformer[key] == plan[key], key
    assert s.transformer["activation_func"] is torch.nn.functional.silu
    assert s.rotary_base == tiny_cfg.model.rope_theta and s.untie_embeddings
    assert s.dtype == torch.float32 and s.transformer["calculate_per_token_loss"]


def test_reference_settings_never_replay(tiny_cfg):
    assert model_settings(tiny_cfg).transformer["moe_enable_routing_replay"] is True
    assert model_settings(tiny_cfg, replay=False).transformer["moe_enable_routing_replay"] is False


def test_replay_refuses_the_fused_router(compose_cfg):
    cfg = compose_cfg("model=tiny_moe", "parallelism=cpu", "+trainer.transformer_overrides.moe_router_fusion=true")
    with pytest.raises(ValueError, match="P7"):
        model_settings(cfg)
    model_settings(cfg, replay=False)  # a model that never replays may use it


def test_replay_refuses_token_dropping(compose_cfg):
    cfg = compose_cfg("model=tiny_moe", "parallelism=cpu",
                      "+trainer.transformer_overrides.moe_expert_capacity_factor=1.0")
    with pytest.raises(ValueError, match="capacity"):
        model_settings(cfg)
