"""Runs inside each vLLM worker (``--worker-extension-cls``): load new weights from an HF safetensors folder.

Why not vLLM's own ``reload_weights``: it re-runs each layer's post-load processing with "this is a weight update"
set, and for an unquantized MoE that skips the experts' own ``process_weights_after_loading``. On CPU that step
prepacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout, so a reload leaves unpacked values in packed
storage and the engine silently serves wrong experts (even reloading the *same* checkpoint changes the weights).
Here the MoE layers whose experts prepack are reloaded as on first load (their kernel is rebuilt, the prepack
re-runs), and the result is copied into the original storage by vLLM's layerwise reload. Elsewhere (GPU kernels
whose update path is complete) this is vLLM's reload unchanged.

Reached through ``POST /collective_rpc {"method": "r3rl_update_weights_from_hf", "args": [hf_dir]}``; it imports
nothing from r3rl so the worker does not load the client side.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _iter_safetensors(hf_dir: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _experts_that_prepack(model: Any) -> list[Any]:
    """Quant methods of MoE layers whose experts repack weights after loading (the CPU grouped-GEMM experts)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    methods = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None:
            continue
        experts = getattr(kernel, "fused_experts", None) or getattr(getattr(kernel, "impl", None), "fused_experts",
                                                                    None)
        if isinstance(experts, CPUUnquantizedExperts):
            methods.append(method)
    return methods


class R3RLWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``reload_weights``)."""

    def r3rl_update_weights_from_hf(self, hf_dir: str) -> dict[str, Any]:
        path = Path(hf_dir)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        methods = _experts_that_prepack(model)
        kernels = [m.moe_kernel for m in methods]
        # "no kernel yet" is what makes the MoE method take the first-load path (kernel build + prepack)
        for method in methods:
            method.moe_kernel = None
        counter = {"tensors": 0}

        def counted() -> Iterator[tuple[str, Any]]:
            for item in _iter_safetensors(path):
                counter["tensors"] += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except BaseException:
            for method, kernel in zip(methods, kernels):
                if method.moe_kernel is None:
                    method.moe_kernel = kernel
            raise
        not_rebuilt = [i for i, m in enumerate(methods) if m.moe_kernel is None]
        for i in not_rebuilt:
            methods[i].moe_kernel = kernels[i]
        if not_rebuilt:
            raise RuntimeError(f"{len(not_rebuilt)} MoE layers were not reloaded from {hf_dir} (missing expert "
                               "weights in the checkpoint?); their weights are unchanged")
        return {"tensors": counter["tensors"], "moe_layers_reprocessed": len(methods), "path": str(path)}
