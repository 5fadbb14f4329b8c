"""Runs inside each vLLM worker (``--worker-extension-cls``): load new weights from an HF safetensors folder.

This is vLLM's ``reload_weights`` with ``MoERepack`` around it: a plain reload leaves the CPU experts' prepacked
weights unpacked and the engine silently serves wrong experts, even after reloading the *same* checkpoint
(``r3rl.sync.cpu_experts``). Elsewhere (GPU kernels whose update path is complete) it is vLLM's reload unchanged.

Reached through ``POST /collective_rpc {"method": "r3rl_update_weights_from_hf", "args": [hf_dir]}``; it imports
nothing of r3rl's client side, so the worker does not load it.

vLLM imports this module in the worker before it builds the worker and its model runner, which makes it the place
where the CPU profile swaps Model Runner V2's interpreted Triton kernels for torch
(``r3rl.cpu_only.vllm_mrv2_kernels``): imported only when the engine's environment asks for it, never on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from r3rl.sync.cpu_experts import MoERepack

# set by r3rl.plan.cpu_engine_env on the CPU profile's engines only
CPU_STAND_INS_FLAG = "R3RL_MRV2_TORCH_KERNELS"


def _cpu_stand_ins():
    """The CPU profile's MRv2 stand-ins, installed (once per process), or None where the engine does not ask."""
    if os.environ.get(CPU_STAND_INS_FLAG) != "1":
        return None
    from r3rl.cpu_only import vllm_mrv2_kernels

    vllm_mrv2_kernels.install()  # refuses where CUDA is available
    return vllm_mrv2_kernels


_cpu_stand_ins()


def _iter_safetensors(hf_dir: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


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
                "received_tensors": getattr(engine, "received_tensors", None),
                "received_from": getattr(engine, "received_from", None),
                "experts_packed_in_place": getattr(engine, "experts_packed_in_place", None)}

    def r3rl_worker_info(self) -> dict[str, Any]:
        """The worker's process, torch threads and the MRv2 kernels it runs as r3rl's torch stand-ins."""
        import torch

        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "stand_ins": kernels.installed() if (kernels := _cpu_stand_ins()) else []}

    def r3rl_interpreter_clock(self, start: bool) -> dict[str, Any]:
        """``start``: clock Triton's interpreter from now on; else what it ran since (``bench/cpu_rollout.py``)."""
        kernels = _cpu_stand_ins()
        if kernels is None:
            raise RuntimeError("Triton's interpreter runs only on the CPU profile's engines (R3RL_MRV2_TORCH_KERNELS=1)")
        clock = kernels.interpreter_clock
        if start:
            clock.start()
        return clock.read()
