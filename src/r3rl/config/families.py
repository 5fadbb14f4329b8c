"""Each MoE family r3rl builds, described once: how its ``config.json`` spells the model config's fields,
transformers' config class, the HF names of its router bias and shared experts, and the rules its fields obey.

The trainer (``r3rl.plan.megatron_config``), the converter, the route layer map, the memory plan (its parameter
counts are here), the preflight's checkpoint check and the tiny stand-ins all read a family from here instead of
branching on names. Pure data and rules over the model config, so it lives with the schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

# model config field -> config.json key, for the fields every family spells alike
_COMMON = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads", "head_dim": "head_dim", "moe_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size", "vocab_size": "vocab_size", "norm_topk_prob": "norm_topk_prob",
    "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
}


@dataclass(frozen=True)
class Family:
    """One model family. ``hf_fields``: model config field -> config.json key (read to check a checkpoint, written
    to generate a stand-in); ``fixed``: model config fields whose value the family fixes (refused otherwise)."""

    architecture: str  # config.json model_type, and model.architecture
    config_class: str  # transformers' config class (its model class is what config.json's architectures names)
    hf_fields: Mapping[str, str]
    fixed: Mapping[str, Any]
    router_bias: str | None  # the expert-score correction bias under a MoE layer's ``mlp.``, if the family has one
    shared_experts: str | None  # the shared experts' module under ``mlp.``
    # config.json fields the family's engine reads that transformers' config class does not write
    hf_extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def hf_config(self, model) -> dict[str, Any]:
        """The config.json fields this family's HF config takes from ``model`` (a ``ModelConfig``)."""
        out = {hf: getattr(model, key) for key, hf in self.hf_fields.items()}
        out.update(self.hf_extra)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": model.rope_theta}
        if "partial_rotary_factor" in self.hf_fields:
            out["rope_parameters"]["partial_rotary_factor"] = model.partial_rotary_factor
        return out


# the multi-latent attention fields, unset: every family without MLA
_NO_MLA = {"q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
           "v_head_dim": None}

QWEN3_MOE = Family(
    architecture="qwen3_moe", config_class="Qwen3MoeConfig",
    hf_fields=MappingProxyType({**_COMMON, "num_experts": "num_experts"}),
    fixed=MappingProxyType({"first_k_dense": 0, "num_shared_experts": 0, "router_score_function": "softmax",
                            "expert_bias": False, "routed_scaling_factor": 1.0, "router_num_groups": 1,
                            "router_group_topk": 1, "qk_norm": True, "qkv_bias": False,
                            "partial_rotary_factor": 1.0, "mtp_layers": 0, **_NO_MLA}),
    router_bias=None, shared_experts=None,
)

# the MoE fields GLM-4.5 spells as DeepSeek-V3 does (its config descends from DeepSeek's)
_DEEPSEEK_MOE = {
    "num_experts": "n_routed_experts", "first_k_dense": "first_k_dense_replace", "ffn_hidden_size": "intermediate_size",
    "num_shared_experts": "n_shared_experts", "routed_scaling_factor": "routed_scaling_factor",
    "router_num_groups": "n_group", "router_group_topk": "topk_group", "qkv_bias": "attention_bias",
    "mtp_layers": "num_nextn_predict_layers"}

GLM4_MOE = Family(
    architecture="glm4_moe", config_class="Glm4MoeConfig",
    hf_fields=MappingProxyType({**_COMMON, **_DEEPSEEK_MOE, "qk_norm": "use_qk_norm",
                                "partial_rotary_factor": "partial_rotary_factor"}),
    # GLM-4.5 routes on sigmoid scores plus e_score_correction_bias (noaux_tc): there is no field to say otherwise
    fixed=MappingProxyType({"router_score_function": "sigmoid", "expert_bias": True, **_NO_MLA}),
    router_bias="gate.e_score_correction_bias", shared_experts="shared_experts",
)

DEEPSEEK_V3 = Family(
    architecture="deepseek_v3", config_class="DeepseekV3Config",
    # transformers derives its head_dim from qk_rope_head_dim
    hf_fields=MappingProxyType({**{k: v for k, v in _COMMON.items() if k != "head_dim"}, **_DEEPSEEK_MOE,
                                **{k: k for k in _NO_MLA}}),
    # no per-head q/k norms (MLA normalises its latents) and RoPE on the rope dims only
    fixed=MappingProxyType({"router_score_function": "sigmoid", "expert_bias": True, "qk_norm": False,
                            "partial_rotary_factor": 1.0, "qkv_bias": False}),
    router_bias="gate.e_score_correction_bias", shared_experts="shared_experts",
    # vLLM's DeepseekV2/V3 reads the router from these; transformers' config class has neither, and without them
    # vLLM routes with a softmax and no bias, silently (model_executor/models/deepseek_v2.py)
    hf_extra=MappingProxyType({"scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
)

FAMILIES: Mapping[str, Family] = MappingProxyType({f.architecture: f for f in (QWEN3_MOE, GLM4_MOE, DEEPSEEK_V3)})


def family(model) -> Family:
    """The family of a ``ModelConfig`` (``model.architecture``); a ``KeyError`` names the ones there are."""
    try:
        return FAMILIES[model.architecture]
    except KeyError:
        raise KeyError(f"model.architecture={model.architecture!r}: r3rl builds {sorted(FAMILIES)}") from None


def family_problems(model) -> list[tuple[str, str]]:
    """Fields of a ``ModelConfig`` its family or the trainer cannot build, each with its key."""
    if model.architecture not in FAMILIES:
        return [("model.architecture", f"must be one of {sorted(FAMILIES)} (the families r3rl builds), got "
                                       f"{model.architecture!r}")]
    fam = FAMILIES[model.architecture]
    found = [(f"model.{key}", f"must be {want!r} for model.architecture={fam.architecture}, got "
                              f"{getattr(model, key)!r}")
             for key, want in fam.fixed.items() if getattr(model, key) != want]
    if not 0 <= model.first_k_dense < model.num_layers:
        found.append(("model.first_k_dense", f"must be in [0, model.num_layers={model.num_layers}) (at least one "
                                             f"MoE layer), got {model.first_k_dense}"))
    if model.first_k_dense and not (model.ffn_hidden_size or 0) > 0:
        found.append(("model.ffn_hidden_size", f"must be > 0: the {model.first_k_dense} dense leading layers need "
                                               f"their MLP width, got {model.ffn_hidden_size}"))
    if model.router_score_function not in ("softmax", "sigmoid"):
        found.append(("model.router_score_function", f"must be softmax or sigmoid, got "
                                                     f"{model.router_score_function!r}"))
    if model.expert_bias and model.router_score_function != "sigmoid":
        found.append(("model.expert_bias", "needs model.router_score_function=sigmoid (an expert-score correction "
                                           "bias is added to sigmoid scores)"))
    if model.router_score_function == "sigmoid" and model.moe_topk > 1 and not model.norm_topk_prob:
        found.append(("model.norm_topk_prob", "must be true with a sigmoid router: Megatron always renormalises its "
                                              "top-k weights there, and an engine that does not would mismatch"))
    groups, per = model.router_num_groups, model.router_group_topk
    if groups < 1 or model.num_experts % groups:
        found.append(("model.router_num_groups", f"must divide model.num_experts={model.num_experts}, got {groups}"))
    elif not 1 <= per <= groups or (groups > 1 and model.moe_topk != 2 * per):
        # a group scores the sum of its top two experts in transformers and vLLM, of its top topk / group_topk in
        # Megatron: they agree only at two (DeepSeek-V3: top-8 over 4 groups)
        found.append(("model.router_group_topk", f"must be in [1, model.router_num_groups={groups}] and, with "
                                                 f"groups, half of model.moe_topk={model.moe_topk} (a group scores "
                                                 f"its top two experts), got {per}"))
    rotary = model.head_dim * model.partial_rotary_factor
    if not 0 < model.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
        found.append(("model.partial_rotary_factor", f"must be in (0, 1] and leave an even number of rotary "
                                                     f"dimensions of model.head_dim={model.head_dim}, got "
                                                     f"{model.partial_rotary_factor}"))
    if model.kv_lora_rank is not None:
        dims = {k: getattr(model, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        bad = [k for k, v in dims.items() if not (v or 0) > 0]
        if bad or (model.q_lora_rank is not None and model.q_lora_rank <= 0):
            found.append((f"model.{(bad or ['q_lora_rank'])[0]}", f"multi-latent attention needs {sorted(dims)} > 0 "
                                                                  f"and q_lora_rank > 0 or null, got {dims}"))
        elif model.num_query_groups != model.num_attention_heads:
            found.append(("model.num_query_groups", f"must equal model.num_attention_heads="
                                                    f"{model.num_attention_heads} with multi-latent attention"))
        elif model.head_dim != model.qk_rope_head_dim:
            found.append(("model.head_dim", f"must be model.qk_rope_head_dim={model.qk_rope_head_dim} with "
                                            "multi-latent attention (transformers' DeepseekV3Config.head_dim)"))
    if model.num_shared_experts < 0 or model.mtp_layers < 0:
        key = "model.num_shared_experts" if model.num_shared_experts < 0 else "model.mtp_layers"
        found.append((key, "must be >= 0"))
    return found


def moe_layers(model) -> list[int]:
    """0-based decoder layers with a routed MoE block, in order: the route columns of a ``Sample`` and the routers
    of the trainer. MTP modules (past ``num_layers``) are never among them."""
    return list(range(model.first_k_dense, model.num_layers))


def dense_layers(model) -> list[int]:
    return list(range(model.first_k_dense))


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the whole model by how Megatron shards them (MTP modules, left out of training, not counted)."""

    dense: int  # attention, norms, routers, dense-layer MLPs, shared experts: split over tensor parallel
    experts: int  # routed experts: split over expert parallel x expert-tensor parallel
    embeddings: int  # input embedding + output layer (untied) + final norm

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.embeddings


def param_counts(model) -> ParamCounts:
    """From the model config's shape and family: the dense prefix, shared experts, biases and q/k norms."""
    h, moe = model.hidden_size, model.num_moe_layers
    attention = _attention_params(model)
    router = model.num_experts * h + (model.num_experts if model.expert_bias else 0)
    shared = 3 * h * model.num_shared_experts * model.moe_ffn_hidden_size  # SwiGLU: fc1 (gate+up) and fc2
    dense_mlp = 3 * h * (model.ffn_hidden_size or 0)
    dense = model.num_layers * (attention + 2 * h) + moe * (router + shared) + model.first_k_dense * dense_mlp
    experts = moe * model.num_experts * 3 * h * model.moe_ffn_hidden_size
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2) + h
    return ParamCounts(dense, experts, embeddings)


def attention_linears(model) -> list[tuple[int, int]]:
    """(in, out) of each of a layer's attention projections: q, k and v as one, or multi-latent attention's query
    (through its latent, or one projection), kv latent with the shared rope key, the latent's expansion to every
    head's key and value; then the output projection."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.kv_lora_rank is None:
        q, kv = heads * model.head_dim, model.num_query_groups * model.head_dim
        return [(h, q + 2 * kv), (q, h)]
    q = heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
    rank = model.q_lora_rank
    query = [(h, q)] if rank is None else [(h, rank), (rank, q)]
    return [*query, (h, model.kv_lora_rank + model.qk_rope_head_dim),
            (model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim)), (heads * model.v_head_dim, h)]


def _attention_params(model) -> int:
    weights = sum(i * o for i, o in attention_linears(model))
    if model.kv_lora_rank is None:
        q, kv = model.num_attention_heads * model.head_dim, model.num_query_groups * model.head_dim
        return weights + (2 * model.head_dim if model.qk_norm else 0) + ((q + 2 * kv) if model.qkv_bias else 0)
    # the query latent's norm (where there is one) and the kv latent's
    return weights + (model.q_lora_rank or 0) + model.kv_lora_rank


def kv_cache_per_token_layer(model, tensor_parallel: int) -> int:
    """Elements one token caches per layer on one engine GPU: multi-latent attention's latent and shared rope key
    (every tensor-parallel rank holds them whole), else the K and V of the GPU's KV heads (at least one)."""
    if model.kv_lora_rank is not None:
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * max(model.num_query_groups // tensor_parallel, 1) * model.head_dim
