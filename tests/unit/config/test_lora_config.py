"""``trainer.lora`` is checked before launch, and a LoRA run's Megatron settings follow from it."""

from __future__ import annotations

import pytest

from r3rl.config import ConfigError
from r3rl.plan import megatron_config
from r3rl.preflight import compose
from r3rl.train.model import uses_transformer_engine

CPU = "parallelism=cpu"
GPU = "parallelism=colocated"


@pytest.mark.parametrize("overrides, key, words", [
    (["trainer.lora.targets=[attention,router]"], "trainer.lora.targets", "router is never adapted"),
    (["trainer.lora.targets=[attention,atention]"], "trainer.lora.targets", "unknown target(s) ['atention']"),
    (["trainer.lora.targets=[]"], "trainer.lora.targets", "at least one"),
    (["trainer.lora.targets=[experts,experts]"], "trainer.lora.targets", "twice"),
    (["trainer.lora.targets=[shared_experts]"], "trainer.lora.targets", "has no shared experts"),
    (["trainer.lora.targets=[dense_mlp]"], "trainer.lora.targets", "has no dense layers"),
    (["trainer.lora.dropout=0.05"], "trainer.lora.dropout", "not the policy that generated the rollout"),
    (["trainer.lora.alpha=0"], "trainer.lora.alpha", "must be > 0"),
    (["trainer.lora.rank=64"], "trainer.lora.rank", "full-parameter training"),
    (["trainer.lora.expert_adapters=each"], "trainer.lora.expert_adapters", "per_expert"),
    (["trainer.lora.sync=adapter"], "trainer.lora.sync", "moe_align_block_size"),
])
def test_a_bad_lora_setting_is_refused_naming_its_key(overrides, key, words):
    """Fails if any rule were dropped: a router adapter (R3 replays the engine's routes into an unchanged router),
    dropout (the trainer's forward would not be the rollout's policy), a target that adapts nothing on this model,
    a rank as wide as the model, or the adapter-only sync on the CPU engine, which has no MoE LoRA kernel."""
    with pytest.raises(ConfigError) as info:
        compose([CPU, "trainer.lora.rank=8", *overrides])
    assert any(k == key and words in reason for k, reason in info.value.problems), info.value.problems


def test_lora_off_refuses_its_other_settings_and_the_defaults_pass():
    """rank 0 is full-parameter training: another LoRA key beside it would be ignored in silence, so it is refused
    naming the key (issue 69); rank 8 with the defaults (attention and experts, per-expert adapters, merged sync)
    passes. Fails if an unused LoRA key passes beside rank 0, or the defaults are refused."""
    with pytest.raises(ConfigError, match=r"trainer.lora.rank: is 0 .*ignores trainer.lora.dropout=0.5"):
        compose([CPU, "trainer.lora.dropout=0.5"])
    assert compose([CPU]).trainer.lora.rank == 0
    assert compose([CPU, "trainer.lora.rank=8"]).trainer.lora.targets == ["attention", "experts"]
    with pytest.raises(ConfigError, match="trainer.lora.rank: must be >= 0"):
        compose([CPU, "trainer.lora.rank=-1"])


def test_lora_on_gpus_adapts_megatrons_own_linears_under_tensor_parallel_but_not_split_experts():
    """On GPUs a LoRA run's experts are a SequentialMLP (no grouped GEMM) and no fused weight-gradient accumulation
    goes into the frozen base; without LoRA the GPU settings stay on. Tensor parallel (with the sequence
    parallelism Megatron's MoE needs) is allowed; expert tensor parallel is refused, naming the key. Fails if a LoRA
    GPU run kept grouped experts (the adapters would find no expert linear to hook), or if split experts, whose
    communication the token dispatcher does, slipped through."""
    full, lora = compose([GPU]), compose([GPU, "trainer.lora.rank=8"])
    assert megatron_config(full, "bfloat16")["moe_grouped_gemm"] is True
    settings = megatron_config(lora, "bfloat16")
    assert settings["moe_grouped_gemm"] is False and settings["gradient_accumulation_fusion"] is False
    tp = compose([GPU, "trainer.lora.rank=8", "parallelism.trainer.tensor_parallel=2",
                  "parallelism.trainer.sequence_parallel=true", "parallelism.trainer.expert_parallel=4"])
    assert tp.parallelism.trainer.tensor_parallel == 2
    with pytest.raises(ConfigError, match="parallelism.trainer.expert_tensor_parallel: must be 1 with trainer.lora"):
        compose([GPU, "trainer.lora.rank=8", "parallelism.trainer.tensor_parallel=2",
                 "parallelism.trainer.sequence_parallel=true", "parallelism.trainer.expert_parallel=4",
                 "parallelism.trainer.expert_tensor_parallel=2"])


@pytest.mark.parametrize("have_te, cpu, adapters, expected", [
    (True, False, False, True), (True, False, True, False), (False, False, False, False), (True, True, False, False)])
def test_transformer_engines_linears_only_without_adapters(have_te, cpu, adapters, expected):
    """The decision the GPU path takes, with TE's install simulated: TE's modules where it is installed on a GPU,
    Megatron's own linears under LoRA. Fails if a LoRA run on a GPU with TE built TE's fused linears, which the
    adapters cannot hook."""
    assert uses_transformer_engine(have_te, cpu, adapters) is expected


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.max_staleness=1", "algorithm.weight_update=in_flight"], "fixed for a request when it is sent"),
    (["rollout.weight_sync.backend=nccl"], "leave the backend auto"),
    (["rollout.engine.url=http://127.0.0.1:8000"], "not started with --enable-lora"),
])
def test_the_adapter_sync_refuses_what_it_cannot_keep(overrides, words):
    """On GPUs ``trainer.lora.sync=adapter`` is refused with weights landing under running requests (a request's
    adapter is fixed when it is sent), with a weight-transfer backend named (nothing is transferred), and with an
    attached engine (not started with --enable-lora). Fails if any of these rules were dropped."""
    with pytest.raises(ConfigError) as info:
        compose([GPU, "trainer.lora.rank=8", "trainer.lora.sync=adapter", *overrides])
    assert any(k == "trainer.lora.sync" and words in reason for k, reason in info.value.problems), \
        info.value.problems


def test_the_adapter_sync_starts_the_engines_with_lora_slots_and_plans_their_memory():
    """``trainer.lora.sync=adapter`` on GPUs: the engines start with --enable-lora, the narrowest --max-lora-rank
    vLLM allows above the rank, one slot per version a batch may still name (max_staleness + 1), the runtime-LoRA
    environment, and no weight-transfer backend; the plan counts the slots in the engine's share and no sync
    buffers in the trainer's. Fails if any flag were lost (vLLM would refuse the load or the rank), if a
    one-step-ahead run had one slot (the batch ahead names the previous adapter), or if the memory plan ignored
    the slots."""
    from r3rl.plan import build_plan

    split = ["parallelism=disaggregated_4p4", "trainer.lora.rank=12"]
    merged = build_plan(compose(split))
    plan = build_plan(compose([*split, "trainer.lora.sync=adapter", "algorithm.max_staleness=1", "correction=tis"]))
    argv, env = plan.engines[0].argv, plan.engines[0].env
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and argv[argv.index("--max-loras") + 1] == "2"
    assert "--enable-lora" in argv and "--weight-transfer-config" not in argv
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--enable-lora" not in merged.engines[0].argv and "--weight-transfer-config" in merged.engines[0].argv

    def parts(p):
        return {part.name: part.bytes for g in p.memory.gpus for _, part in g.parts}

    assert parts(plan)["engine LoRA slots"] > 0 and "engine LoRA slots" not in parts(merged)
    assert parts(plan)["weight sync buffers"] == 0 < parts(merged)["weight sync buffers"]
