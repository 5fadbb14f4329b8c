"""The PEFT adapter folder (``r3rl.train.peft_adapter``) loaded by peft itself onto transformers' model of each tiny
family: merged, it must equal the base weights plus ``(alpha / r) B A`` of every Megatron linear, mapped to HF
names as the weight export maps them."""

from __future__ import annotations

import pytest
import torch

from r3rl.config import compose
from r3rl.models.layers import hf_moe_layers
from r3rl.models.tiny_moe import ensure_checkpoint
from r3rl.train import peft_adapter
from r3rl.train.convert import HFCheckpoint, HFLayout, ParamRef, full_from_hf, full_to_hf

RANK, ALPHA = 4, 8.0


def megatron_refs(model, hf_config: dict) -> list[ParamRef]:
    """Every linear LoRA can adapt in ``model``: attention, routed experts, shared experts, dense MLPs."""
    moe = set(hf_moe_layers(hf_config))
    refs = []
    for layer in range(model.num_layers):
        if model.kv_lora_rank is not None:
            query = ("q_down", "q_up") if model.q_lora_rank else ("q_full",)
            refs += [ParamRef(k, layer) for k in (*query, "kv_down", "kv_up", "proj")]
        else:
            refs += [ParamRef("qkv", layer), ParamRef("proj", layer)]
        if layer not in moe:
            refs += [ParamRef("dense_fc1", layer), ParamRef("dense_fc2", layer)]
            continue
        refs += [ParamRef(fc, layer, e) for e in range(model.num_experts) for fc in ("fc1", "fc2")]
        if model.num_shared_experts:
            refs += [ParamRef("shared_fc1", layer), ParamRef("shared_fc2", layer)]
    return refs


@pytest.mark.parametrize("family", ["tiny_moe", "tiny_glm4_moe", "tiny_deepseek_v3"])
def test_peft_loads_the_adapter_folder_as_the_merged_weights(tmp_path, family):
    """Random adapters on every adaptable linear, written as a PEFT folder, loaded by ``PeftModel.from_pretrained``
    and merged: every HF weight equals the base plus its share of ``(alpha / r) B A`` within float32 rounding, and no
    router, norm or embedding moves. Fails if the 3-D expert pair were packed otherwise than PEFT reads it (B's
    columns expert-major instead of rank-major: planted below), if gate_up_proj's and down_proj's pairs swapped
    keys, if the qkv or [gate; up] B rows were split otherwise than the weights are, or if a module name were not
    transformers'."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    cfg = compose(["parallelism=cpu", f"model={family}"])
    folder = ensure_checkpoint(cfg.model)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    layout, ckpt = HFLayout.of(cfg.model), HFCheckpoint(folder)
    gen = torch.Generator().manual_seed(0)
    pairs, expected = [], {}
    for ref in megatron_refs(cfg.model, base.config.to_dict()):
        w = full_from_hf(ref, ckpt.get, layout).float()
        a = torch.randn(RANK, w.shape[1], generator=gen) * 0.1
        b = torch.randn(w.shape[0], RANK, generator=gen) * 0.1
        pairs.append(peft_adapter.AdapterPair(ref, a, b))
        expected.update(full_to_hf(ref, w + (ALPHA / RANK) * b @ a, layout))
    tensors = peft_adapter.peft_tensors(pairs, layout, cfg.model.num_experts)
    config = peft_adapter.peft_config(tensors, RANK, ALPHA, str(folder))
    out = peft_adapter.write_folder(tensors, config, tmp_path / "adapter", {"step": 0})

    want = transformers_names(expected)
    merged = peft.PeftModel.from_pretrained(base, out).merge_and_unload().state_dict()
    moved = {k for k in merged if not torch.equal(merged[k], before[k])}
    assert moved == set(want), sorted(moved ^ set(want))[:6]
    for name in moved:
        torch.testing.assert_close(merged[name], want[name], atol=1e-5, rtol=1e-5, msg=name)

    # the planted fault: B's columns expert-major. PEFT then gives expert e another expert's factors
    e = cfg.model.num_experts
    wrong = {k: (v.reshape(v.shape[0], e, RANK).transpose(1, 2).reshape(v.shape[0], -1)
                 if k.endswith("experts.lora_B.weight") else v) for k, v in tensors.items()}
    bad = peft_adapter.write_folder(wrong, config, tmp_path / "wrong", {})
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    merged_bad = peft.PeftModel.from_pretrained(fresh, bad).merge_and_unload().state_dict()
    down = next(k for k in want if k.endswith("experts.down_proj"))
    assert not torch.allclose(merged_bad[down], want[down], atol=1e-3)


def transformers_names(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert HF tensors of ``expected`` stacked into transformers 5's 3-D expert parameters."""
    out, experts = {}, {}
    for name, t in expected.items():
        stem, _, rest = name.partition(".experts.")
        if not rest or not rest.split(".")[0].isdigit():
            out[name] = t
            continue
        e, proj = rest.split(".")[:2]
        experts.setdefault((stem, proj), {})[int(e)] = t
    for stem in {s for s, _ in experts}:
        n = len(experts[(stem, "down_proj")])
        out[f"{stem}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[(stem, "gate_proj")][i], experts[(stem, "up_proj")][i]]) for i in range(n)])
        out[f"{stem}.experts.down_proj"] = torch.stack([experts[(stem, "down_proj")][i] for i in range(n)])
    return out
