"""The launch plan derived from configs (in-process, structured)."""

from __future__ import annotations

import json
import shlex

from r3rl.plan import build_plan, describe


def test_disaggregated_4p4_r3(compose_cfg):
    cfg = compose_cfg("model=qwen3_30b", "rollout=vllm_r3", "parallelism=disaggregated_4p4")
    plan = build_plan(cfg)
    assert [(g.node, g.local) for g in plan.placement.trainer] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    (engine,) = plan.engines
    assert engine.gpus == (4, 5, 6, 7) and engine.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    argv = list(engine.argv)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert "--enable-expert-parallel" in argv and "--enable-return-routed-experts" in argv
    assert engine.host == "127.0.0.1"
    assert plan.megatron["moe_enable_routing_replay"] is True
    assert plan.megatron["expert_model_parallel_size"] == 4 and plan.data_parallel == 4
    assert plan.megatron["num_moe_experts"] == 128 and plan.megatron["moe_router_topk"] == 8
    assert plan.megatron["moe_router_pre_softmax"] is False  # norm_topk_prob=True
    assert plan.wandb.tags[:1] == ("r3:on",) and plan.wandb.mode == "online"


def test_colocated_shares_gpus_0_to_7(compose_cfg):
    plan = build_plan(compose_cfg("model=qwen3_30b", "rollout=vllm_r3", "parallelism=colocated"))
    trainer = {(g.node, g.local) for g in plan.placement.trainer}
    engines = {(e.node, g) for e in plan.engines for g in e.gpus}
    assert trainer == engines == {(0, g) for g in range(8)}
    assert plan.placement.colocated


def test_no_r3_has_no_routing_flag_and_no_replay(compose_cfg):
    plan = build_plan(compose_cfg("model=qwen3_30b", "rollout=vllm", "parallelism=disaggregated_4p4"))
    assert all("--enable-return-routed-experts" not in e.argv for e in plan.engines)
    assert plan.megatron["moe_enable_routing_replay"] is False
    assert "r3:off" in plan.wandb.tags


def test_attach_mode_launches_nothing(compose_cfg):
    cfg = compose_cfg("parallelism=cpu", "rollout.engine.url=http://127.0.0.1:9999")
    plan = build_plan(cfg)
    assert plan.engines == () and plan.attach_url == "http://127.0.0.1:9999"
    assert describe(cfg, plan)["engines"] == [{"url": "http://127.0.0.1:9999", "attach": True}]


def test_cpu_defaults_make_engine_and_trainer_numerics_differ(compose_cfg):
    """On a CPU the default run shows R3's effect only if the engine and trainer precisions differ (cpu-stack.md)."""
    plan = build_plan(compose_cfg("parallelism=cpu"))
    assert plan.engine_dtype == "bfloat16" and plan.trainer_dtype == "float32"
    argv = shlex.join(plan.engines[0].argv)
    assert "--enforce-eager" in argv and "--kv-cache-memory-bytes" in argv
    assert plan.engines[0].env["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_dtype_auto_resolves_by_device(compose_cfg):
    cpu = build_plan(compose_cfg("parallelism=cpu", "rollout.engine.dtype=auto", "trainer.params_dtype=auto"))
    gpu = build_plan(compose_cfg("model=qwen3_30b", "parallelism=colocated"))
    assert (cpu.engine_dtype, cpu.trainer_dtype) == ("float32", "float32")
    assert (gpu.engine_dtype, gpu.trainer_dtype) == ("bfloat16", "bfloat16")


def transfer_config(argv) -> dict | None:
    argv = list(argv)
    return json.loads(argv[argv.index("--weight-transfer-config") + 1]) if "--weight-transfer-config" in argv else None


def test_weight_transfer_backend_follows_the_layout(compose_cfg):
    """auto: nccl for separate GPUs, ipc + sleep mode when colocated, r3rl_gloo on CPU, none for attached engines."""
    (e,) = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4")).engines
    assert transfer_config(e.argv) == {"backend": "nccl"} and "--enable-sleep-mode" not in e.argv
    colocated = build_plan(compose_cfg("model=qwen3_30b", "parallelism=colocated")).engines
    assert all(transfer_config(e.argv) == {"backend": "ipc"} and "--enable-sleep-mode" in e.argv for e in colocated)
    (e,) = build_plan(compose_cfg("parallelism=cpu")).engines
    assert transfer_config(e.argv) == {"backend": "r3rl_gloo"} and "--enable-sleep-mode" not in e.argv
    (e,) = build_plan(compose_cfg("parallelism=cpu", "rollout.weight_sync.backend=disk")).engines
    assert transfer_config(e.argv) is None
