"""Runs inside each vLLM worker (``--worker-extension-cls``): load new weights from an HF safetensors folder.

Why not vLLM's own ``reload_weights``: it re-runs each layer's post-load processing with "this is a weight update"
set, and for an unquantized MoE that skips the experts' own ``process_weights_after_loading``. On CPU that step
prepacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout, so a reload leaves unpacked values in packed
storage and the engine silently serves wrong experts (even reloading the *same* checkpoint changes the weights).
Here the MoE layers whose experts prepack are reloaded as on first load (their kernel is rebuilt, the prepack
re-runs), and the result is copied into the original storage by vLLM's layerwise reload. Elsewhere (GPU kernels
whose update path is complete) this is vLLM's reload unchanged.

Reached through ``POST /collective_rpc {"method": "r3rl_update_weights_from_hf", "args": [hf_dir]}``; it imports
nothing from r3rl so the worker does not load the client side. ``MoERepack`` is the same fix around a transfer
through vLLM's weight-transfer engine (``r3rl.rollout.gloo_transfer``).
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


class MoERepack:
    """Around one weight update: the MoE layers whose experts prepack take the first-load path (kernel rebuilt,
    prepack re-run). ``finish`` after the update checks every such layer was rebuilt; ``abort`` restores the kernels
    when the update failed (the weights are then whatever was loaded so far)."""

    def __init__(self, model: Any) -> None:
        self.methods = _experts_that_prepack(model)
        self.kernels = [m.moe_kernel for m in self.methods]
        # "no kernel yet" is what makes the MoE method take the first-load path (kernel build + prepack)
        for method in self.methods:
            method.moe_kernel = None

    def abort(self) -> None:
        for method, kernel in zip(self.methods, self.kernels):
            if method.moe_kernel is None:
                method.moe_kernel = kernel

    def finish(self) -> int:
        not_rebuilt = [i for i, m in enumerate(self.methods) if m.moe_kernel is None]
        for i in not_rebuilt:
            self.methods[i].moe_kernel = self.kernels[i]
        if not_rebuilt:
            raise RuntimeError(f"{len(not_rebuilt)} MoE layers were not reloaded (missing expert weights in the "
                               "update?); their weights are unchanged")
        return len(self.methods)


class R3RLWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``reload_weights``)."""

    def r3rl_update_weights_from_hf(self, hf_dir: str) -> dict[str, Any]:
        path = Path(hf_dir)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        repack = MoERepack(model)
        counter = {"tensors": 0}

        def counted() -> Iterator[tuple[str, Any]]:
            for item in _iter_safetensors(path):
                counter["tensors"] += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except BaseException:
            repack.abort()
            raise
        layers = repack.finish()
        return {"tensors": counter["tensors"], "moe_layers_reprocessed": layers, "path": str(path)}

    def r3rl_transfer_stats(self) -> dict[str, Any]:
        """What the weight-transfer engine received in the last update (tests read it through /collective_rpc)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {"backend": type(engine).__name__ if engine is not None else None,
                "received_tensors": getattr(engine, "received_tensors", None)}
