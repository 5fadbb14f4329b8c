"""Weight updates for vLLM's CPU grouped-GEMM MoE experts, whose weights live prepacked (runs inside a vLLM worker).

vLLM's reload re-runs each layer's post-load processing with "this is a weight update" set, and for an unquantized
MoE that skips the experts' ``process_weights_after_loading``, which on CPU prepacks ``w13_weight``/``w2_weight``
into the grouped-GEMM layout: the reload would leave unpacked values in packed storage and the engine would serve
wrong experts. Two ways around it:

- ``MoERepack`` (any update path, vLLM's reload included): the layers take the first-load path (kernel rebuilt,
  prepack re-run into fresh tensors) and vLLM's layerwise reload copies the result into the original storage.
- ``PackedExpertsUpdate`` (r3rl's transfer engine): a layer's expert weights are loaded by vLLM's own loader into a
  reused unpacked staging pair, then prepacked straight into the live storage once the layer is complete. No fresh
  tensor, no copy back: on a 2.3 GB model this is most of the engine's load time (``bench/weight_sync.py``).

Both touch only the CPU experts; on a GPU neither finds a layer and vLLM's reload runs unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

# Qwen-MoE naming: HF names of one layer's routed experts, and vLLM's experts module of that decoder layer. Other
# layouts (fused expert checkpoints, other module names) are left to ``MoERepack``
_EXPERTS_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")
_EXPERT_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$")
_EXPERTS_MODULE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts(?:\.|$)")
_KEEP_STAGING = 2  # staging pairs kept warm between updates: a bucket boundary holds at most two layers open


def cpu_experts(method: Any) -> Any:
    """The CPU grouped-GEMM experts behind an MoE layer's quant method, or None."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    kernel = getattr(method, "moe_kernel", None)
    if kernel is None:
        return None
    experts = getattr(kernel, "fused_experts", None) or getattr(getattr(kernel, "impl", None), "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def _experts_that_prepack(model: Any) -> list[Any]:
    """Quant methods of MoE layers whose experts repack weights after loading (the CPU grouped-GEMM experts)."""
    return [m.quant_method for m in model.modules()
            if cpu_experts(getattr(m, "quant_method", None)) is not None]


class MoERepack:
    """Around one weight update: the MoE layers whose experts prepack take the first-load path (kernel rebuilt,
    prepack re-run); ``skip`` are layers updated another way. ``finish`` after the update checks every such layer
    was rebuilt; ``abort`` restores the kernels when the update failed (the weights are then whatever was loaded
    so far)."""

    def __init__(self, model: Any, skip: frozenset[int] = frozenset()) -> None:
        self.methods = [m for m in _experts_that_prepack(model) if id(m) not in skip]
        self.kernels = [m.moe_kernel for m in self.methods]
        # "no kernel yet" is what makes the MoE method take the first-load path (kernel build + prepack)
        for method in self.methods:
            method.moe_kernel = None

    def abort(self) -> None:
        for method, kernel in zip(self.methods, self.kernels):
            if method.moe_kernel is None:
                method.moe_kernel = kernel

    def check(self) -> None:
        """Raises unless every layer was rebuilt (missing expert weights in the update)."""
        not_rebuilt = sum(m.moe_kernel is None for m in self.methods)
        if not_rebuilt:
            raise RuntimeError(f"{not_rebuilt} MoE layers were not reloaded (missing expert weights in the update?); "
                               "their weights are unchanged")

    def finish(self) -> int:
        try:
            self.check()
        finally:
            self.abort()
        return len(self.methods)


@dataclass
class _Layer:
    module: torch.nn.Module
    isa: str
    live: tuple[torch.nn.Parameter, torch.nn.Parameter]  # w13, w2 as the kernel reads them (prepacked)
    expected: int  # expert weights in a full update: gate, up and down of every expert
    seen: set[str] = field(default_factory=set)
    staged: tuple[torch.Tensor, torch.Tensor] | None = None
    done: bool = False


def _loads_in_place(module: torch.nn.Module, experts: Any) -> bool:
    """Layers whose packed storage is exactly the prepack of the loader's unpacked layout: one rank holds every
    expert unsharded, no intermediate padding, no bias, not zentorch's kernel (which keeps weights unpacked)."""
    config = experts.moe_config
    parallel = config.moe_parallel_config
    w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
    padded = getattr(experts, "_padded_intermediate_size", None)  # vLLM 0.32's CPU experts; unknown: not in place
    return (w13 is not None and w2 is not None and w13.dim() == 3 and w2.dim() == 3
            and not getattr(experts, "_use_zentorch", False)
            and parallel.tp_size == 1 and parallel.ep_size == 1
            and padded is not None and padded(config) == config.intermediate_size_per_partition
            and getattr(module, "w13_bias", None) is None and getattr(module, "w2_bias", None) is None)


class PackedExpertsUpdate:
    """One weight update of the CPU experts layers that load in place (the others are left to ``MoERepack``).

    Per bucket: ``stage`` puts an unpacked staging pair in place of each named layer's weights, the model's own
    ``load_weights`` fills it, ``loaded`` prepacks every layer that now has all its expert weights into the live
    storage and puts the live weights back. Staging pairs come from ``pool`` (kept by the caller across updates, so
    their pages are warm). A layer that did not get all its expert weights keeps its old weights whole."""

    def __init__(self, model: torch.nn.Module, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pool = pool
        self.layers: dict[int, _Layer] = {}
        clashing: set[int] = set()
        for name, module in model.named_modules():
            experts = cpu_experts(getattr(module, "quant_method", None))
            match = _EXPERTS_MODULE.match(name)
            if experts is None or match is None or not _loads_in_place(module, experts):
                continue
            index = int(match.group(1))
            if index in self.layers:
                clashing.add(index)
            self.layers[index] = _Layer(module, experts.isa, (module.w13_weight, module.w2_weight),
                                        3 * module.w13_weight.shape[0])
        for index in clashing:  # two experts modules under one layer index: names cannot tell them apart
            del self.layers[index]
        self.methods = frozenset(id(layer.module.quant_method) for layer in self.layers.values())

    def exclude_from_reload(self) -> None:
        """After vLLM's ``initialize_layerwise_reload``: these layers get their live tensors back (the reload had
        put them on the meta device) and are no longer waiting for weights, as a layer the update skips."""
        from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

        for layer in self.layers.values():
            info = get_layerwise_info(layer.module)
            if info.kernel_tensors is not None:
                _place_kernel_tensors(layer.module, info)
            info.reset()

    def stage(self, names: list[str]) -> None:
        for name in names:
            match = _EXPERTS_NAME.match(name)
            layer = self.layers.get(int(match.group(1))) if match else None
            if layer is None:
                continue
            # checked before anything is loaded: the loader would write these into the live packed storage
            if not _EXPERT_WEIGHT.match(name):
                raise ValueError(f"{name}: not a per-expert gate/up/down weight; the CPU experts of layer "
                                 f"{match.group(1)} load only those")
            if layer.done:
                raise ValueError(f"{name}: sent again after its layer was complete in this update")
            layer.seen.add(name)
            if layer.staged is None:
                layer.staged = self._take(layer)
                for attr, staged, live in zip(("w13_weight", "w2_weight"), layer.staged, layer.live):
                    param = torch.nn.Parameter(staged, requires_grad=False)
                    param.__dict__.update(live.__dict__)  # weight_loader and the other loading attributes
                    setattr(layer.module, attr, param)

    def loaded(self) -> None:
        for layer in self.layers.values():
            if layer.staged is not None and len(layer.seen) >= layer.expected:
                for staged, live in zip(layer.staged, layer.live):
                    torch.ops._C.prepack_moe_weight(staged, live.data, layer.isa)
                self._restore(layer)
                layer.done = True

    def abort(self) -> None:
        for layer in self.layers.values():
            self._restore(layer)

    def check(self) -> None:
        """After the last bucket: every layer was updated whole, or the update fails naming those that were not."""
        partial = {i: len(layer.seen) for i, layer in self.layers.items() if not layer.done}
        if partial:
            got = ", ".join(f"layer {i}: {n} of {self.layers[i].expected}" for i, n in sorted(partial.items()))
            raise RuntimeError(f"MoE expert weights missing from the update ({got}); those layers keep their "
                               "previous weights")

    def finish(self) -> int:
        """Puts back whatever is still staged; returns how many layers were updated."""
        self.abort()
        del self.pool[_KEEP_STAGING:]
        return sum(layer.done for layer in self.layers.values())

    def _take(self, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor]:
        shapes = tuple(t.shape for t in layer.live)
        for i, pair in enumerate(self.pool):
            if tuple(t.shape for t in pair) == shapes and pair[0].dtype == layer.live[0].dtype:
                return self.pool.pop(i)
        return torch.empty_like(layer.live[0].data), torch.empty_like(layer.live[1].data)

    def _restore(self, layer: _Layer) -> None:
        if layer.staged is None:
            return
        for attr, live in zip(("w13_weight", "w2_weight"), layer.live):
            setattr(layer.module, attr, live)
        self.pool.append(layer.staged)
        layer.staged = None
