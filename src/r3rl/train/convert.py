"""HF <-> Megatron-core weights for every family r3rl builds (``r3rl.config.families``).

The mapping works on full (unsharded) tensors; ``shard``/``gather`` move between a full tensor and this rank's
tensor-parallel slice, and expert ids are offset by the expert-parallel rank. Loading reads only the tensors this
rank needs from the safetensors files; export streams bucket by bucket (``r3rl.train.export``) and every rank writes
its own share of an HF folder that vLLM and transformers load as is.

Layouts (Megatron side):
- ``linear_qkv`` rows are grouped per query group g: ``[q rows of g's heads; k_g; v_g]``;
- an expert's ``linear_fc1`` is ``[gate_proj; up_proj]`` (SwiGLU);
- ``mlp.gate`` -> ``mlp.router``, ``post_attention_layernorm`` -> ``pre_mlp_layernorm``,
  ``q_norm``/``k_norm`` -> ``q_layernorm``/``k_layernorm``;
- the qkv bias is fused like the rows it adds to; a dense layer's and the shared experts' ``linear_fc1`` are
  ``[gate_proj; up_proj]`` like an expert's;
- the expert-score correction bias is the router's ``expert_bias`` buffer (not a parameter: it is read and written
  with the parameters here, and streamed to the engines with them).
MTP modules (``model.layers.{num_layers + i}``) are not built: loading never reads them and an export copies them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from r3rl.config.schema import ModelConfig
from r3rl.train import lora


@dataclass(frozen=True)
class HFLayout:
    """What the mapping needs of a model: the attention's grouping, and the family's HF module names."""

    num_heads: int
    num_groups: int
    head_dim: int
    shared_experts: str | None = None  # under a layer's ``mlp.``
    router_bias: str | None = None  # under a layer's ``mlp.``
    mla: bool = False  # multi-latent attention: q_layernorm is the query latent's norm (q_a_layernorm)

    @classmethod
    def of(cls, model: ModelConfig) -> "HFLayout":
        from r3rl.config.families import family

        fam = family(model)
        return cls(model.num_attention_heads, model.num_query_groups, model.head_dim,
                   fam.shared_experts if model.num_shared_experts else None,
                   fam.router_bias if model.expert_bias else None, model.kv_lora_rank is not None)


@dataclass(frozen=True)
class ParamRef:
    """What a Megatron parameter is, independent of sharding: kind, global layer, global expert."""

    kind: str
    layer: int | None = None
    expert: int | None = None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<seqfc>linear_fc[12])\.weight"
    r"|(?P<grpfc>linear_fc[12])\.weight(?P<grp>\d+))$"
)
_GLOBAL_KINDS = {
    "embedding.word_embeddings.weight": "embed",
    "decoder.final_layernorm.weight": "final_norm",
    "output_layer.weight": "output",
}
_LAYER_KINDS = {
    "input_layernorm.weight": "input_norm",
    # TransformerEngine's spec fuses the input norm into linear_qkv, and a dense MLP's norm into its linear_fc1
    "self_attention.linear_qkv.layer_norm_weight": "input_norm",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv_bias",
    "self_attention.linear_proj.weight": "proj",
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
    "pre_mlp_layernorm.weight": "pre_mlp_norm",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_norm",
    "mlp.router.weight": "router",
    "mlp.router.expert_bias": "router_bias",
    "mlp.linear_fc1.weight": "dense_fc1",
    "mlp.linear_fc2.weight": "dense_fc2",
    "mlp.shared_experts.linear_fc1.weight": "shared_fc1",
    "mlp.shared_experts.linear_fc2.weight": "shared_fc2",
    # multi-latent attention (DeepSeek-V3); TE fuses the latents' norms into the up projections
    "self_attention.linear_q_proj.weight": "q_full",
    "self_attention.linear_q_down_proj.weight": "q_down",
    "self_attention.linear_q_up_proj.weight": "q_up",
    "self_attention.linear_q_up_proj.layer_norm_weight": "q_latent_norm",
    "self_attention.linear_kv_down_proj.weight": "kv_down",
    "self_attention.linear_kv_up_proj.weight": "kv_up",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "kv_latent_norm",
    "self_attention.kv_layernorm.weight": "kv_latent_norm",
}
# kinds whose Megatron tensor is [gate; up] (split per half over tensor parallel)
GATED = ("fc1", "dense_fc1", "shared_fc1")


def parse_name(name: str, layer_numbers: dict[int, int], expert_offset: int) -> ParamRef:
    """Megatron parameter name (local to this rank) -> ParamRef with global layer and expert ids.

    ``layer_numbers`` maps the local layer index to the global 0-based layer (pipeline stages hold a slice).
    """
    if name in _GLOBAL_KINDS:
        return ParamRef(_GLOBAL_KINDS[name])
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no HF counterpart for Megatron parameter {name}")
    layer = layer_numbers[int(match.group(1))]
    rest = match.group(2)
    if rest in _LAYER_KINDS:
        return ParamRef(_LAYER_KINDS[rest], layer)
    expert = _EXPERT.match(rest)
    if expert is None:
        raise KeyError(f"no HF counterpart for Megatron parameter {name}")
    local = int(expert.group("seq") if expert.group("seq") is not None else expert.group("grp"))
    fc = expert.group("seqfc") or expert.group("grpfc")
    return ParamRef("fc1" if fc == "linear_fc1" else "fc2", layer, expert_offset + local)


def _hf_layer(layer: int) -> str:
    return f"model.layers.{layer}."


def hf_names(ref: ParamRef, layout: HFLayout) -> list[str]:
    """The HF tensors one Megatron parameter is made of (in concatenation order)."""
    if ref.kind == "embed":
        return ["model.embed_tokens.weight"]
    if ref.kind == "final_norm":
        return ["model.norm.weight"]
    if ref.kind == "output":
        return ["lm_head.weight"]
    p = _hf_layer(ref.layer)
    simple = {
        "input_norm": "input_layernorm.weight",
        "proj": "self_attn.o_proj.weight",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "pre_mlp_norm": "post_attention_layernorm.weight",
        "router": "mlp.gate.weight",
        "dense_fc2": "mlp.down_proj.weight",
        "q_full": "self_attn.q_proj.weight",
        "q_down": "self_attn.q_a_proj.weight",
        "q_up": "self_attn.q_b_proj.weight",
        "q_latent_norm": "self_attn.q_a_layernorm.weight",
        "kv_down": "self_attn.kv_a_proj_with_mqa.weight",
        "kv_up": "self_attn.kv_b_proj.weight",
        "kv_latent_norm": "self_attn.kv_a_layernorm.weight",
    }
    if ref.kind == "q_norm" and layout.mla:
        return [p + simple["q_latent_norm"]]
    if ref.kind in simple:
        return [p + simple[ref.kind]]
    if ref.kind in ("qkv", "qkv_bias"):
        kind = "weight" if ref.kind == "qkv" else "bias"
        return [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
    if ref.kind == "router_bias":
        return [f"{p}mlp.{_named(layout.router_bias, ref)}"]
    if ref.kind == "dense_fc1":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    if ref.kind in ("shared_fc1", "shared_fc2"):
        s = f"{p}mlp.{_named(layout.shared_experts, ref)}."
        return [s + "gate_proj.weight", s + "up_proj.weight"] if ref.kind == "shared_fc1" else [s + "down_proj.weight"]
    e = f"{p}mlp.experts.{ref.expert}."
    if ref.kind == "fc1":
        return [e + "gate_proj.weight", e + "up_proj.weight"]
    if ref.kind == "fc2":
        return [e + "down_proj.weight"]
    raise KeyError(ref.kind)


def _named(name: str | None, ref: ParamRef) -> str:
    if name is None:
        raise KeyError(f"{ref}: the model config's family has no such module (model.num_shared_experts / "
                       "model.expert_bias disagree with the Megatron model)")
    return name


def qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: HFLayout) -> torch.Tensor:
    """Fuse q/k/v weights ``[rows, hidden]`` or biases ``[rows]`` into Megatron's per-group rows."""
    g, d = shape.num_groups, shape.head_dim
    per_group = shape.num_heads // g
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape(g, per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def qkv_to_hf(fused: torch.Tensor, shape: HFLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = shape.num_groups, shape.head_dim
    per_group = shape.num_heads // g
    rest = tuple(fused.shape[1:])
    grouped = fused.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def full_from_hf(ref: ParamRef, get: Callable[[str], torch.Tensor], shape: HFLayout) -> torch.Tensor:
    parts = [get(n) for n in hf_names(ref, shape)]
    if ref.kind in ("qkv", "qkv_bias"):
        return qkv_from_hf(*parts, shape)
    if ref.kind in GATED:
        return torch.cat(parts, dim=0)
    return parts[0]


def full_to_hf(ref: ParamRef, full: torch.Tensor, shape: HFLayout) -> dict[str, torch.Tensor]:
    names = hf_names(ref, shape)
    if ref.kind in ("qkv", "qkv_bias"):
        return dict(zip(names, qkv_to_hf(full, shape)))
    if ref.kind in GATED:
        return dict(zip(names, full.chunk(2, dim=0)))
    return {names[0]: full}


# ----------------------------------------------------------------------------------------- tensor parallel slices

def shard(full: torch.Tensor, ref: ParamRef, partition_dim: int | None, size: int, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor (``partition_dim`` None: replicated)."""
    if partition_dim is None or size == 1:
        return full
    if ref.kind in GATED:
        # gate and up are split separately so every rank holds matching halves of both
        return torch.cat([shard(h, ParamRef("plain"), 0, size, rank) for h in full.chunk(2, dim=0)], dim=0)
    length = full.shape[partition_dim]
    if length % size:
        raise ValueError(f"{ref}: dimension {partition_dim} of size {length} does not split over {size} ranks")
    step = length // size
    return full.narrow(partition_dim, rank * step, step)


def unshard(pieces: list[torch.Tensor], ref: ParamRef, partition_dim: int | None) -> torch.Tensor:
    if partition_dim is None or len(pieces) == 1:
        return pieces[0]
    if ref.kind in GATED:
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
    return torch.cat(pieces, dim=partition_dim)


# ------------------------------------------------------------------------------------------------ HF checkpoints

class HFCheckpoint:
    """Lazy reader of a HF safetensors checkpoint folder (single file, sharded with an index, or several files)."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.folder}: no *.safetensors files")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    weight_map.update({k: f.name for k in handle.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.folder}: checkpoint has no tensor {name}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._open(str(self.folder / file), framework="pt")
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


# ---------------------------------------------------------------------------------------- model <-> checkpoint

@dataclass(frozen=True)
class ShardInfo:
    tp_size: int = 1
    tp_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    ep_rank: int = 0
    num_local_experts: int = 0

    @classmethod
    def current(cls, model) -> "ShardInfo":
        from megatron.core import parallel_state as ps

        experts = model.config.num_moe_experts or 0
        ep = ps.get_expert_model_parallel_world_size()
        return cls(
            tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(), num_local_experts=experts // ep,
        )

    def of(self, ref: ParamRef) -> tuple[int, int]:
        return (self.etp_size, self.etp_rank) if ref.kind in ("fc1", "fc2") else (self.tp_size, self.tp_rank)


def layer_numbers(model) -> dict[int, int]:
    """Local layer index -> global 0-based layer, for this rank's pipeline stage."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


def named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The tensors an HF checkpoint holds: every parameter but LoRA's adapters (an export merges them into their
    weights, ``r3rl.train.lora.effective``), and the routers' ``expert_bias`` buffers."""
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith("mlp.router.expert_bias")]
    return [(n, p) for n, p in model.named_parameters() if not lora.is_adapter(n)] + buffers


def _refs(model, info: ShardInfo) -> list[tuple[str, torch.Tensor, ParamRef]]:
    layers = layer_numbers(model)
    offset = info.ep_rank * info.num_local_experts
    return [(n, p, parse_name(n, layers, offset)) for n, p in named_weights(model)]


def partition_dim(param: torch.nn.Parameter) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


@torch.no_grad()
def load_hf(model, checkpoint: HFCheckpoint, shape: HFLayout, info: ShardInfo | None = None) -> int:
    """Copy a HF checkpoint into this rank's bare GPTModel; return the number of parameters loaded."""
    info = info or ShardInfo.current(model)
    count = 0
    for name, param, ref in _refs(model, info):
        full = full_from_hf(ref, checkpoint.get, shape)
        size, rank = info.of(ref)
        local = shard(full, ref, partition_dim(param), size, rank)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(f"{name}: HF gives {tuple(local.shape)} for this rank, the model has {tuple(param.shape)}")
        param.copy_(local.to(param.dtype))
        count += 1
    return count


TOKENIZER_AND_CONFIG = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                        "tokenizer.model", "added_tokens.json")
