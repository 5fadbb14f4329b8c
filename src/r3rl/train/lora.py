"""LoRA on Megatron's parallel linears and routed experts (``trainer.lora``): r3rl's own adapters.

Each adapted linear keeps its weight W, frozen, and gains a child ``lora`` holding A ``[r, in]`` and B ``[out, r]``
(B starts at zero, so the adapted model starts as the base); a forward hook adds ``(alpha / r) B A x`` to the
linear's output. The adapter is split the way its linear is: a column-parallel linear (its output split over the
tensor-parallel ranks) holds all of A and its rows of B, and the rank-r activations A x pass
``copy_to_tensor_model_parallel_region`` (whose backward sums the ranks' gradients, so A's gradient and the input's
are whole on every rank); a row-parallel linear (its input split) holds its columns of A and all of B, and the
partial A x is summed over the ranks (``reduce_from_tensor_model_parallel_region``) before B, so the update is
counted once, not once per rank (miles #3232). Expert adapters are expert parameters (reduced over the expert
data-parallel group, as their experts are); ``expert_adapters=shared`` gives all experts of a layer one pair.

Why r3rl's own: Megatron-Bridge's LoRA wraps TransformerEngine's linears (the CPU trainer has none) and PEFT wraps
``torch.nn.Linear`` (Megatron's linears are not); docs/development.md records the decision. The weight sync and the
HF export stream ``W + (alpha / r) B A`` (``effective``); nothing downstream knows the adapters exist.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from r3rl.config.lora import TARGETS
from r3rl.config.schema import LoRAConfig

ADAPTER = "lora"  # the child module's name: adapter parameters are ``<linear>.lora.a`` / ``.b``


class LoRAAdapter(torch.nn.Module):
    """The adapter of one linear (or, shared, of the same linear of every expert of a layer)."""

    def __init__(self, weight: torch.Tensor, parallel: str, rank: int, alpha: float, tp_group, *, seed: int,
                 tp_size: int, tp_rank: int, expert: bool, sequence_parallel: bool = False):
        super().__init__()
        out_local, in_local = weight.shape
        self.parallel, self.scale, self.tp_group = parallel, alpha / rank, tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        full_in = in_local * tp_size if parallel == "row" else in_local
        # PEFT's default: A ~ kaiming-uniform(a=sqrt(5)), B = 0. Drawn whole from a generator of its own, then cut,
        # so an adapter starts the same under any tensor-parallel split
        gen = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(full_in)
        a = (torch.rand(rank, full_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        if parallel == "row":
            a = a.chunk(tp_size, dim=1)[tp_rank]
        self.a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(out_local, rank, device=weight.device, dtype=weight.dtype))
        sharded = self.b if parallel == "column" else self.a
        if tp_size > 1:  # Megatron's marks: counted once in norms, split on its dim in checkpoints
            sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = True, \
                (0 if parallel == "column" else 1), 1
        for p in (self.a, self.b):
            p.allreduce = not expert  # Megatron's DDP: False reduces over the expert data-parallel group
        if self.sequence_parallel and parallel == "row":
            # B sees only this rank's tokens (the output is scattered over the sequence): Megatron's
            # finalize_model_grads sums the gradients of parameters marked so over the tensor-parallel ranks
            self.b.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism the linear's input (column) or output (row) is split over the sequence: the
        column adapter gathers its input as the linear does (its gradient then split back, not summed: the rank-r
        gradient is summed before it), and the row adapter's partial A x is summed and scattered over the
        sequence, as the linear's output is."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region,
                                                            reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region)

        x = x.to(self.a.dtype)
        if self.parallel == "column":
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
            h = copy_to_tensor_model_parallel_region(torch.nn.functional.linear(x, self.a), group=self.tp_group)
        elif self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(torch.nn.functional.linear(x, self.a), group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(torch.nn.functional.linear(x, self.a), group=self.tp_group)
        return torch.nn.functional.linear(h, self.b) * self.scale

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """This rank's shard of ``(alpha / r) B A``, in the linear's weight layout."""
        return (self.b.float() @ self.a.float()) * self.scale


def _add_delta(linear, args, output):
    adapter = linear._r3rl_lora
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def _attach(linear, adapter: LoRAAdapter, owner: bool) -> None:
    if owner:
        linear.add_module(ADAPTER, adapter)
    object.__setattr__(linear, "_r3rl_lora", adapter)  # not a submodule: a shared adapter has one owner
    linear.weight._r3rl_lora = adapter
    linear.register_forward_hook(_add_delta)


def _parallel(linear) -> str:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(linear, ColumnParallelLinear):
        return "column"
    if isinstance(linear, RowParallelLinear):
        return "row"
    raise TypeError(f"LoRA adapts Megatron's ColumnParallelLinear and RowParallelLinear (the local layer spec), got "
                    f"{type(linear).__name__}: TransformerEngine's linears and grouped experts are not adapted yet")


def _sequence_parallel(linear) -> bool:
    """Whether Megatron split this linear's input (column) or output (row) over the sequence: never for experts
    whose tokens the dispatcher moves (``explicit_expert_comm``), nor without tensor parallel."""
    return bool(getattr(linear, "sequence_parallel", False)) and not getattr(linear, "explicit_expert_comm", False)


def _seed(base_seed: int, name: str) -> int:
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def _linears(layer, target: str) -> Iterator[tuple[str, object]]:
    """(name under the layer, linear) of one target; routed experts one per local expert."""
    for path in TARGETS[target]:
        if target == "experts":
            experts = layer.mlp.experts
            if not hasattr(experts, "local_experts"):
                raise TypeError(f"LoRA on routed experts needs Megatron's SequentialMLP, got {type(experts).__name__}"
                                " (grouped GEMM experts are not adapted yet)")
            which = path.rsplit(".", 1)[1]
            for i, expert in enumerate(experts.local_experts):
                yield f"mlp.experts.local_experts.{i}.{which}", getattr(expert, which)
            continue
        node = layer
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if node is not None:
            yield path, node


def add_adapters(model, lora: LoRAConfig, seed: int) -> int:
    """Freeze every parameter of ``model`` (a bare GPTModel) and attach adapters to ``lora.targets`` (before DDP
    and the optimizer, so only the adapters get gradient buffers and optimizer state); returns the adapter count.
    ``seed`` and each linear's global name fix its A, so every data-parallel replica starts alike."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model.requires_grad_(False)
    tp = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    etp = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())
    ep_rank = ps.get_expert_model_parallel_rank()
    count = 0
    for layer in model.decoder.layers:
        prefix = f"decoder.layers.{layer.layer_number - 1}."
        moe = isinstance(layer.mlp, MoELayer)
        for target in lora.targets:
            if (target == "dense_mlp" and moe) or (target in ("experts", "shared_experts") and not moe):
                continue
            shared: dict[str, LoRAAdapter] = {}
            for name, linear in _linears(layer, target):
                parallel, expert = _parallel(linear), target == "experts"
                size, rank = etp if expert else tp
                which = name.rsplit(".", 1)[1]
                if expert and lora.expert_adapters == "shared":
                    owner = which not in shared
                    if owner:
                        shared[which] = LoRAAdapter(linear.weight, parallel, lora.rank, lora.alpha, linear.tp_group,
                                                    seed=_seed(seed, prefix + "mlp.experts." + which),
                                                    tp_size=size, tp_rank=rank, expert=False,
                                                    sequence_parallel=_sequence_parallel(linear))
                        layer.mlp.add_module(f"{ADAPTER}_experts_{which}", shared[which])
                    _attach(linear, shared[which], owner=False)
                    count += owner
                    continue
                key = name
                if expert:  # the global expert index seeds the adapter: the same A under any EP split
                    local = int(name.split(".")[3])
                    key = f"mlp.experts.{ep_rank * len(layer.mlp.experts.local_experts) + local}.{which}"
                adapter = LoRAAdapter(linear.weight, parallel, lora.rank, lora.alpha, linear.tp_group,
                                      seed=_seed(seed, prefix + key), tp_size=size, tp_rank=rank, expert=expert,
                                      sequence_parallel=_sequence_parallel(linear))
                _attach(linear, adapter, owner=True)
                count += 1
    return count


def effective(param: torch.Tensor) -> torch.Tensor:
    """What the engine must serve for this parameter: ``W + (alpha / r) B A`` for an adapted weight (this rank's
    shard), the parameter itself otherwise."""
    adapter = getattr(param, "_r3rl_lora", None)
    data = param.detach()
    if adapter is None:
        return data
    return (data.float() + adapter.delta()).to(data.dtype)


def base_fingerprint(folder, head_bytes: int = 1 << 20) -> str:
    """A digest of the HF checkpoint a LoRA run adapts: each weight file's name, size and first ``head_bytes``
    (its header and first tensors), and ``config.json``. A LoRA checkpoint holds the adapters alone, so a resume or
    an export on another base (a new warm start, another model) must be refused, not merged into it."""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256()
    folder = Path(folder)
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        digest.update(f"{path.name}:{path.stat().st_size}:".encode())
        with open(path, "rb") as f:
            digest.update(f.read(head_bytes))
    return digest.hexdigest()[:16]


def shard_adapters(sharded: dict) -> dict:
    """A model's sharded state dict with each tensor-parallel adapter factor (a column-parallel B, a row-parallel
    A) as a shard of its whole tensor. Megatron's linears list their children's parameters as replicated over the
    tensor-parallel ranks, so each rank's different shard would be saved under one key, and one of them lost."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    out = {}
    for key, sh in sharded.items():
        param = getattr(sh, "data", None)
        if is_adapter(key) and getattr(param, "tensor_model_parallel", False):
            offsets = tuple((i, sh.global_offset[i], sh.axis_fragmentations[i]) for i in range(sh.prepend_axis_num))
            sh = make_tp_sharded_tensor_for_checkpoint(param, sh.key, tp_axis=param.partition_dim,
                                                       prepend_offsets=offsets)
        out[key] = sh
    return out


def is_adapter(name: str) -> bool:
    """An adapter parameter's name (under a linear, or a layer's shared expert adapters)."""
    return f".{ADAPTER}." in name or f".{ADAPTER}_experts_" in name


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]
