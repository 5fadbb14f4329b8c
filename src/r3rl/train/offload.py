"""Optimizer state out of accelerator memory while colocated engines generate, and back before training.

Adam's two moments are twice the fp32 weights: on a colocated GPU that is the memory the engine's KV cache needs
during rollout. The state moves whole (no copy is kept where it was); parameters and gradient buffers stay.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside r3rl's/Megatron's wrappers (``inner``, ``optimizer``, ``chained_optimizers``)."""
    found, stack, seen = [], [optimizer], set()
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.optim.Optimizer):
            found.append(o)
            continue
        stack.extend(getattr(o, "chained_optimizers", []) or [])
        stack.extend(getattr(o, attr, None) for attr in ("inner", "optimizer"))
    return found


def move_optimizer_state(optimizer: Any, device: torch.device | str) -> int:
    """Move every state tensor to ``device``; return the bytes moved (0 when already there)."""
    device = torch.device(device)
    moved = 0
    for opt in torch_optimizers(optimizer):
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device:
                    state[key] = value.to(device, non_blocking=device.type == "cpu")
                    moved += value.numel() * value.element_size()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved
