"""The Megatron-core GPTModel of a MoE family, built from ``plan.megatron_config`` (the single source of its settings).

Every family in Megatron terms: RMSNorm, SwiGLU experts and dense MLPs, RoPE (partial for GLM-4.5), untied
embeddings; the router, q/k norms, qkv bias, shared experts and dense prefix as the family says
(``r3rl.config.families``). The CPU compat layer only adds the settings a CPU needs; GPU runs get Megatron as
configured.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from r3rl.config.schema import R3RLConfig
from r3rl.config.modes import resolve_dtype
from r3rl.plan import megatron_config
from r3rl.train import hardware, te_fallback

# Keys of plan.megatron_config that belong to GPTModel / DDP rather than TransformerConfig.
MODEL_KEYS = ("vocab_size", "max_sequence_length", "untie_embeddings_and_output_weights", "rotary_base",
              "rotary_percent")
DDP_KEYS = ("use_distributed_optimizer",)

ACTIVATIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSettings:
    transformer: dict[str, Any]
    vocab_size: int
    max_sequence_length: int
    untie_embeddings: bool
    rotary_base: float
    rotary_percent: float
    use_distributed_optimizer: bool
    dtype: torch.dtype
    # LoRA adapters go on this model (trainer.lora): Megatron's own linears, not TransformerEngine's
    adapters: bool = False


def model_settings(cfg: R3RLConfig, *, replay: bool | None = None) -> ModelSettings:
    """TransformerConfig kwargs + model arguments for this config; ``replay`` overrides routing replay (False for a
    reference model, which must never replay rollout routes: pitfall P12)."""
    dtype_name = resolve_dtype(cfg.trainer.params_dtype, cfg.parallelism.device)
    raw = megatron_config(cfg, dtype_name)
    raw.update(hardware.transformer_overrides())
    raw = te_fallback.drop_missing_kernels(raw)
    if replay is not None:
        raw["moe_enable_routing_replay"] = replay
    if raw.get("moe_enable_routing_replay") and raw.get("moe_router_fusion"):
        raise ValueError("routing replay with moe_router_fusion=True: Megatron's fused router returns before the "
                         "replayed top-k is applied (pitfall P7); set trainer.moe_router_fusion=false")
    model = {k: raw.pop(k) for k in MODEL_KEYS}
    ddp = {k: raw.pop(k) for k in DDP_KEYS}
    dtype = TORCH_DTYPES[raw.pop("params_dtype")]
    if isinstance(raw.get("activation_func"), str):
        raw["activation_func"] = ACTIVATIONS[raw["activation_func"]]
    raw.update(
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        # Loss is a token sum; finalize_model_grads divides by the global count of loss tokens (GRPO token mean).
        calculate_per_token_loss=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if raw.get("moe_enable_routing_replay") and raw.get("moe_expert_capacity_factor") is not None:
        raise ValueError("routing replay with moe_expert_capacity_factor set: token dropping runs after the replayed "
                         "top-k and would drop replayed routes")
    return ModelSettings(
        transformer=raw,
        vocab_size=model["vocab_size"],
        max_sequence_length=model["max_sequence_length"],
        untie_embeddings=model["untie_embeddings_and_output_weights"],
        rotary_base=model["rotary_base"],
        rotary_percent=model["rotary_percent"],
        use_distributed_optimizer=ddp["use_distributed_optimizer"],
        dtype=dtype,
        adapters=cfg.trainer.lora.rank > 0,
    )


def transformer_config(settings: ModelSettings):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kind = MLATransformerConfig if settings.transformer.get("multi_latent_attention") else TransformerConfig
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(settings.transformer) - known)
    if unknown:
        raise ValueError(f"not {kind.__name__} fields (trainer.transformer_overrides?): {unknown}")
    return kind(**settings.transformer)


MLA_WITHOUT_Q_LATENT = (
    "model.q_lora_rank=null (Moonlight's attention, one q_proj) with Megatron-core 0.19: it builds the kv latent's "
    "norm only together with a query norm fused into linear_q_proj (megatron/core/transformer/"
    "mla_qk_norm_config.py), which these checkpoints do not have; use Megatron-core 0.16 (the cpu and gpu extras "
    "allow it)")


def uses_transformer_engine(have_te: bool, cpu: bool, adapters: bool) -> bool:
    """Whether the layer spec takes TransformerEngine's modules: where TE is installed, on GPUs, and not under LoRA,
    whose adapters hook Megatron's own parallel linears (``r3rl.train.lora``; TE's fuse the layer norm in)."""
    return have_te and not cpu and not adapters


def layer_spec(config, *, adapters: bool = False):
    """Megatron's decoder block spec: a dense MLP in the leading layers ``moe_layer_freq`` marks 0 (GLM-4.5,
    DeepSeek-V3), a MoE block in the others, each with the model's own q/k norms and qkv bias from ``config``."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron.core.transformer.identity_op import IdentityOp

    use_te = uses_transformer_engine(gpt_layer_specs.HAVE_TE, hardware.cpu_active(), adapters)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if getattr(config, "multi_latent_attention", False) and config.q_lora_rank is None:
        if importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None:
            raise ValueError(MLA_WITHOUT_Q_LATENT)
        # Moonlight's one q_proj has no query latent to normalise
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.q_layernorm = IdentityOp
    if not use_te:
        # the local attention with a packed (THD) path, which TE's attention has natively, fused on CUDA
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = te_fallback.local_core_attention()
    return block


def build_gpt(settings: ModelSettings, device: torch.device):
    """The bare GPTModel on ``device`` (this rank's pipeline stage, tensor and expert shards)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    te_fallback.guard_router_gemm()
    te_fallback.guard_mla_without_te()
    config = transformer_config(settings)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, adapters=settings.adapters),
        vocab_size=settings.vocab_size,
        max_sequence_length=settings.max_sequence_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not settings.untie_embeddings,
        position_embedding_type="rope",
        rotary_base=settings.rotary_base,
        rotary_percent=settings.rotary_percent,
    )
    return model.to(device)


def wrap_ddp(model, settings: ModelSettings):
    """Megatron DDP: gradients accumulate into float32 ``main_grad`` buffers and are reduced over data parallel."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def routers(model) -> list:
    """This model's MoE routers in layer order, each with its 1-based global ``layer_number``.

    Walking the model (not Megatron's global registry of RouterReplay instances) keeps replay state scoped to one
    model: a second model in the process (a reference model, a test's twin) never receives this one's routes.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(found, key=lambda r: r.layer_number)


def route_column(router) -> int:
    """The column of a sample's routes (MoE layers only, in order) this router replays: its 0-based decoder layer
    less the dense layers before it (``moe_layer_freq`` 0). Reading ``layer_number - 1`` instead replays every
    layer after a dense one with the next layer's routes (verl #5037)."""
    config = router.config
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    return sum(pattern[: router.layer_number - 1])
