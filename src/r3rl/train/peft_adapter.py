"""A LoRA run's adapters as a PEFT adapter folder (``python -m r3rl.export RUN --adapter DIR``).

The folder is what ``peft`` writes: ``adapter_config.json`` and ``adapter_model.safetensors``, loaded onto the base
checkpoint by ``PeftModel.from_pretrained`` or transformers' ``model.load_adapter``. Names and layouts are those of
transformers 5, where a layer's routed experts are two 3-D parameters, ``experts.gate_up_proj`` ``[E, 2I, H]`` and
``experts.down_proj`` ``[E, H, I]``, adapted through PEFT's ``target_parameters`` (peft >= 0.20). For such a
parameter PEFT keeps one pair per layer: A ``[r E, in]`` holds expert e's A in rows ``e r .. e r + r - 1``
(expert-major) and B ``[out, r E]`` holds its B in columns ``j E + e`` (rank-major), and the delta added to
``param[e]`` is ``(alpha / r) B_e A_e``. With both parameters adapted PEFT nests its wrappers, gate_up_proj inside:
its pair is saved under ``experts.base_layer.lora_*`` and down_proj's under ``experts.lora_*``
(peft/tuners/lora/layer.py, ``ParamWrapper``; the unit test loads the folder with peft itself).

Megatron's fused tensors split as their weights do (``r3rl.train.convert``): the column-parallel qkv and [gate; up]
linears have their B split by rows, each part keeping the whole A; row-parallel linears map one to one. An expert's
``linear_fc1`` is gate_up_proj's slice as it is. ``expert_adapters=shared`` writes its one pair for every expert.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from r3rl.train.convert import GATED, HFLayout, ParamRef, hf_names, qkv_to_hf

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# the pair of each 3-D expert parameter, under the layer's ``mlp.experts`` module (PEFT's nesting: see above)
EXPERT_KEYS = {"fc1": "base_layer.", "fc2": ""}
EXPERT_PARAMS = {"fc1": "gate_up_proj", "fc2": "down_proj"}
# PEFT on transformers 5 reads a ``target_modules`` entry ending in one of these as a transformers-4 expert of an MoE
# family (glm4_moe, deepseek_v3, qwen*_moe) and retargets it to the 3-D experts with twice the rank
# (peft/utils/transformers_weight_conversion.py, ``_convert_peft_config_moe``); a dense or shared-expert MLP's
# linears are named by their weight in ``target_parameters`` instead, which that conversion leaves alone
V4_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterPair:
    """One adapted Megatron linear, whole (gathered over tensor parallel): A ``[r, in]``, B ``[out, r]``, in its
    weight's layout."""

    ref: ParamRef
    a: torch.Tensor
    b: torch.Tensor


def _module(hf_weight: str) -> str:
    return hf_weight.removesuffix(".weight")


def _experts_module(ref: ParamRef, layout: HFLayout) -> str:
    """``model.layers.L.mlp.experts`` from the per-expert HF name of ``ref``."""
    name = hf_names(ref, layout)[0]
    return name[: name.rindex(f".{ref.expert}.")]


def _pack_experts(pairs: dict[int, AdapterPair], num_experts: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    missing = sorted(set(range(num_experts)) - set(pairs))
    if missing:
        raise ValueError(f"{where}: the adapters of experts {missing[:8]} were not collected (of {num_experts})")
    a = torch.cat([pairs[e].a for e in range(num_experts)], dim=0)  # expert-major rows
    b = torch.stack([pairs[e].b for e in range(num_experts)], dim=-1)  # [out, r, E]: column j E + e
    return a, b.reshape(b.shape[0], -1)


def peft_tensors(pairs: Iterable[AdapterPair], layout: HFLayout, num_experts: int, *,
                 per_expert: bool = False) -> dict[str, torch.Tensor]:
    """PEFT's adapter state dict (keys with ``base_model.model.``) for the whole model's adapter pairs.
    ``per_expert``: each expert's linears under their transformers-4 names (``experts.<e>.gate_proj``, ...), the
    layout vLLM's fused-MoE LoRA loads by default, instead of PEFT's 3-D expert parameters."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, AdapterPair]] = {}
    for pair in pairs:
        if pair.ref.kind in EXPERT_PARAMS and not per_expert:
            experts.setdefault((pair.ref.layer, pair.ref.kind), {})[pair.ref.expert] = pair
            continue
        names = hf_names(pair.ref, layout)
        if pair.ref.kind == "qkv":
            bs = qkv_to_hf(pair.b, layout)
        elif pair.ref.kind in GATED:
            bs = pair.b.chunk(2, dim=0)
        else:
            bs = (pair.b,)
        for name, b in zip(names, bs, strict=True):
            out[f"{PREFIX}{_module(name)}.lora_A.weight"] = pair.a
            out[f"{PREFIX}{_module(name)}.lora_B.weight"] = b
    for (layer, kind), by_expert in sorted(experts.items()):
        module = _experts_module(next(iter(by_expert.values())).ref, layout)
        a, b = _pack_experts(by_expert, num_experts, f"layer {layer} {EXPERT_PARAMS[kind]}")
        out[f"{PREFIX}{module}.{EXPERT_KEYS[kind]}lora_A.weight"] = a
        out[f"{PREFIX}{module}.{EXPERT_KEYS[kind]}lora_B.weight"] = b
    # clone: the parts of a fused linear share its A, and safetensors writes no tensor twice
    return {k: v.detach().cpu().clone().contiguous() for k, v in out.items()}


def peft_config(tensors: dict[str, torch.Tensor], rank: int, alpha: float, base: str | None, *,
                per_expert: bool = False) -> dict:
    """``adapter_config.json``: the adapted modules by full name (PEFT matches a target by name or suffix, so a
    short ``gate_proj`` would also adapt a shared expert's), the 3-D expert parameters by their suffix, and a dense
    or shared-expert MLP's linears by their weight (``V4_EXPERT_LEAVES``). ``per_expert`` (vLLM's layout): the
    adapted linears' short names, as vLLM reads them (which modules load is decided by the tensors' keys)."""
    common = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "bias": "none", "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": base}
    if per_expert:
        leaves = {k.removeprefix(PREFIX).rsplit(".lora_", 1)[0].rsplit(".", 1)[1] for k in tensors}
        return {**common, "target_modules": sorted(leaves)}
    modules, params = set(), set()
    for key in tensors:
        module = key.removeprefix(PREFIX).rsplit(".lora_", 1)[0]
        if module.endswith(".experts.base_layer") or module.endswith(".experts"):
            params.update(f"mlp.experts.{p}" for p in EXPERT_PARAMS.values())
        elif module.rsplit(".", 1)[1] in V4_EXPERT_LEAVES:
            params.add(f"{module}.weight")
        else:
            modules.add(module)
    return {**common, "target_modules": sorted(modules), "target_parameters": sorted(params) or None}


def write_folder(tensors: dict[str, torch.Tensor], config: dict, out: Path, info: dict) -> Path:
    """The adapter folder, appearing whole (written beside it, then renamed); ``info`` (what r3rl knows of the
    adapters' origin: run, step, base fingerprint) goes to ``r3rl_adapter.json``, which PEFT ignores."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.parent / f".{out.name}-partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    (tmp / "r3rl_adapter.json").write_text(json.dumps(info, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def local_pairs(model) -> list[AdapterPair]:
    """This rank's adapter pairs, whole, with global layer and expert ids, each pair from one replica only
    (data-parallel rank 0 for attention and dense adapters, expert-data-parallel rank 0 for the experts'). A factor
    split over tensor-parallel ranks is gathered in its group (collective: every rank of the group walks the same
    parameters); dense pairs are kept by tensor-parallel rank 0."""
    from megatron.core import parallel_state as ps

    from r3rl.train.convert import ShardInfo, layer_numbers, named_weights, parse_name, partition_dim, unshard

    info = ShardInfo.current(model)
    if info.etp_size > 1:
        raise ValueError("an adapter export needs expert tensor parallel 1 (trainer.lora refuses it above 1)")
    dense_first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_first = ps.get_expert_data_parallel_rank() == 0
    layers, offset = layer_numbers(model), info.ep_rank * info.num_local_experts

    def whole(factor: torch.Tensor, ref: ParamRef) -> torch.Tensor:
        dim = partition_dim(factor)
        if dim is None or info.tp_size == 1:
            return factor.detach().cpu()
        pieces = [torch.empty_like(factor) for _ in range(info.tp_size)]
        torch.distributed.all_gather(pieces, factor.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        return unshard([p.cpu() for p in pieces], ref, dim)  # a [gate; up] B joins per half, as its weight does

    pairs = []
    for name, param in named_weights(model):
        adapter = getattr(param, "_r3rl_lora", None)
        if adapter is None:
            continue
        ref = parse_name(name, layers, offset)
        a, b = whole(adapter.a, ref), whole(adapter.b, ref)
        # expert factors are never split (expert tensor parallel 1), and the experts of tensor-parallel ranks may
        # differ (expert parallel can span them): only the dense factors are kept by tensor-parallel rank 0 alone
        if expert_first if ref.kind in EXPERT_PARAMS else (dense_first and info.tp_rank == 0):
            pairs.append(AdapterPair(ref, a, b))
    return pairs
