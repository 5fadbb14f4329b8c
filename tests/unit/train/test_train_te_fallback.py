"""Without TransformerEngine (or Apex) Megatron still trains, on a GPU as on a CPU: missing kernels are turned off."""

from __future__ import annotations

import math

import pytest
import torch

from r3rl.plan import GPU_SPEED_SETTINGS
from r3rl.train import te_fallback

ALL_ON = dict.fromkeys(GPU_SPEED_SETTINGS, True)


def test_without_te_the_te_kernels_go_and_megatrons_own_stays():
    out, missing = te_fallback.available_kernels(ALL_ON, have_te=False, have_apex_fusion=False)
    assert set(missing) == {"apply_rope_fusion", "moe_permute_fusion", "moe_grouped_gemm",
                            "gradient_accumulation_fusion"}
    assert out["bias_activation_fusion"] is True and not any(out[k] for k in missing)
    with_apex, missing = te_fallback.available_kernels(ALL_ON, have_te=False, have_apex_fusion=True)
    assert with_apex["gradient_accumulation_fusion"] is True and "gradient_accumulation_fusion" not in missing


def test_with_te_and_apex_every_setting_stays():
    out, missing = te_fallback.available_kernels(ALL_ON, have_te=True, have_apex_fusion=True)
    assert out == ALL_ON and missing == []


def test_te_without_apex_turns_gradient_accumulation_fusion_off():
    """TE installed, Apex not (what the gpu profile installs): GPTModel's output layer is Megatron's own
    ColumnParallelLinear, which raises at build without Apex's module. Fails if ``available_kernels`` lets TE stand
    in for Apex again (the model build crashed at ``build_gpt`` on a standard GPU install)."""
    out, missing = te_fallback.available_kernels(ALL_ON, have_te=True, have_apex_fusion=False)
    assert missing == ["gradient_accumulation_fusion"]
    assert out["gradient_accumulation_fusion"] is False
    assert all(out[k] for k in ALL_ON if k != "gradient_accumulation_fusion")


@pytest.mark.parametrize("apex", [False, True], ids=["no_apex", "apex"])
def test_gpu_model_settings_agree_with_megatrons_output_layer_check(compose_cfg, monkeypatch, apex):
    """A GPU layout's TransformerConfig settings with TransformerEngine importable (simulated: this machine has no
    TE) and Apex's module missing or present (simulated through the flag Megatron's ``ColumnParallelLinear``
    checks). The setting must be exactly what that constructor accepts: on without Apex it raises RuntimeError at
    model build, off with Apex loses the fused weight-gradient GEMM. Fails if the decision reads TE's presence
    instead of Megatron's flag."""
    from megatron.core.tensor_parallel import layers

    from r3rl.train.model import model_settings

    monkeypatch.setattr(te_fallback, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", apex)
    cfg = compose_cfg("model=tiny_moe", "parallelism=colocated")
    if apex:
        settings = model_settings(cfg)
    else:
        with pytest.warns(UserWarning, match="without gradient_accumulation_fusion"):
            settings = model_settings(cfg)
    assert settings.transformer["gradient_accumulation_fusion"] is apex
    assert settings.transformer["moe_grouped_gemm"] is True  # TE's kernels stay: TE is (simulated) there


def test_precision_aware_optimizer_needs_te():
    settings = {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}
    out, missing = te_fallback.optimizer_settings(settings, have_te=False)
    assert out["use_precision_aware_optimizer"] is False and missing == ["use_precision_aware_optimizer"]
    assert te_fallback.optimizer_settings(settings, have_te=True)[0] == settings


@pytest.mark.skipif(te_fallback.have_transformer_engine(), reason="checks the install without TransformerEngine")
def test_router_gemm_guard_selects_torch_without_te():
    from megatron.core.transformer.moe import moe_utils

    te_fallback.guard_router_gemm()
    assert moe_utils.te_general_gemm is None
    with pytest.warns(UserWarning, match="apply_rope_fusion"):
        kept = te_fallback.drop_missing_kernels(ALL_ON)
    assert kept["apply_rope_fusion"] is False and kept["bias_activation_fusion"] is True


def reference_attention(query, key, value, mask=None):
    """Softmax attention written out: query head h reads key/value group h // (heads / groups), causal."""
    sq, b, heads, hn = query.shape
    groups = key.shape[2]
    out = torch.empty(sq, b, heads, hn, dtype=query.dtype)
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    for batch in range(b):
        for h in range(heads):
            g = h // (heads // groups)
            scores = query[:, batch, h] @ key[:, batch, g].T / math.sqrt(hn)
            masked = causal if mask is None else mask[min(batch, mask.shape[0] - 1), 0]
            scores = scores.masked_fill(masked, float("-inf"))
            out[:, batch, h] = torch.softmax(scores, dim=-1) @ value[:, batch, g]
    return out.reshape(sq, b, heads * hn)


@pytest.mark.parametrize("explicit_mask", [False, True])
def test_sdpa_attention_is_megatrons_causal_grouped_query_attention(explicit_mask):
    """The attention GPUs without TransformerEngine run (``te_fallback.sdpa_attention``) against softmax attention
    written out. Fails if it computes something else than Megatron's DotProductAttention: keys/values
    repeated per head instead of per query group (``repeat`` for ``repeat_interleave``), no causal mask when
    Megatron passes none, the mask's polarity flipped (Megatron marks masked positions True), or another layout
    than ``[sq, b, heads * hn]`` out."""
    gen = torch.Generator().manual_seed(3)
    sq, b, heads, groups, hn = 7, 2, 4, 2, 8
    query = torch.randn(sq, b, heads, hn, generator=gen)
    key, value = (torch.randn(sq, b, groups, hn, generator=gen) for _ in range(2))
    mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)[None, None] if explicit_mask else None
    got = te_fallback.sdpa_attention(query, key, value, mask, scale=1.0 / math.sqrt(hn))
    assert got.shape == (sq, b, heads * hn)
    torch.testing.assert_close(got, reference_attention(query, key, value, mask), rtol=1e-5, atol=1e-5)
