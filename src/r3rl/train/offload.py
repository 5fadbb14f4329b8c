"""Optimizer state out of accelerator memory while colocated engines generate, and back before training.

Adam's two moments are twice the fp32 weights: on a colocated GPU that is the memory the engine's KV cache needs
during rollout. Only state that lives on the accelerator moves (whole: no copy is kept where it was); parameters and
gradient buffers stay.

With ``trainer.optimizer_cpu_offload=true`` Megatron wraps a ``HybridDeviceOptimizer``: a torch optimizer whose own
``state`` aliases the state dicts of its sub-optimizers, one GPU optimizer (``gpu_optimizer``, None when everything
is offloaded) and CPU optimizers (``cpu_optimizers``, fused torch AdamW over pinned host copies). The CPU part already
lives in host memory and must stay there: moving it to the GPU on onload would put the offloaded Adam state on the
card (~43 GiB per GPU for Qwen3-30B-A3B colocated) and hand the CPU AdamW device tensors at the next step. So the
walk below takes a hybrid optimizer's GPU part only, never its aliased ``state``, never a state entry that is one of
the optimizer's own parameters (the hybrid's ``master_param``), and onload moves back exactly what offload moved.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

# torch optimizer -> [(state dict, key, device it was offloaded from)]: what onload puts back
_OFFLOADED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[dict, str, torch.device]]]" = \
    weakref.WeakKeyDictionary()


def is_hybrid(optimizer: Any) -> bool:
    """Megatron's ``HybridDeviceOptimizer`` (or anything split the same way into a device and a host part)."""
    return hasattr(optimizer, "cpu_optimizers") and hasattr(optimizer, "gpu_optimizer")


def torch_optimizers(optimizer: Any, *, host_part: bool = False) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside r3rl's/Megatron's wrappers (``inner``, ``optimizer``, ``chained_optimizers``).

    A hybrid optimizer contributes its device part (``gpu_optimizer``), or with ``host_part=True`` its host part
    (``cpu_optimizers``); never itself, whose ``state`` only aliases theirs. A plain torch optimizer is device part.
    """
    found, stack, seen = [], [optimizer], set()
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        if is_hybrid(o):
            found.extend(o.cpu_optimizers if host_part else [o.gpu_optimizer] if o.gpu_optimizer is not None else [])
            continue
        if isinstance(o, torch.optim.Optimizer):
            if not host_part:
                found.append(o)
            continue
        stack.extend(getattr(o, "chained_optimizers", []) or [])
        stack.extend(getattr(o, attr, None) for attr in ("inner", "optimizer"))
    return found


def _state_tensors(opt: torch.optim.Optimizer):
    """(state dict, key, tensor) of every state tensor that is not one of ``opt``'s own parameters."""
    params = {id(p) for group in opt.param_groups for p in group["params"]}
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and id(value) not in params:
                yield state, key, value


def offload_moves(optimizer: Any, host: torch.device | str = "cpu") -> list[tuple[dict, str, torch.Tensor]]:
    """What offload moves: the device part's state tensors that are not on ``host``."""
    host = torch.device(host)
    return [(s, k, v) for opt in torch_optimizers(optimizer) for s, k, v in _state_tensors(opt)
            if v.device != host]


def offload_optimizer_state(optimizer: Any, host: torch.device | str = "cpu") -> int:
    """Move the device part's state to ``host``; remember it for onload; return the bytes moved."""
    host = torch.device(host)
    moved = 0
    for opt in torch_optimizers(optimizer):
        record = _OFFLOADED.setdefault(opt, [])
        for state, key, value in _state_tensors(opt):
            if value.device != host:
                state[key] = value.to(host, non_blocking=host.type == "cpu")
                record.append((state, key, value.device))
                moved += value.numel() * value.element_size()
    _settle()
    return moved


def onload_optimizer_state(optimizer: Any, device: torch.device | str | None = None) -> int:
    """Move back what ``offload_optimizer_state`` moved (to ``device``, else where it was); return the bytes.

    A no-op for everything else: the host part of a hybrid optimizer, and state offload never saw."""
    moved = 0
    for opt in torch_optimizers(optimizer):
        live = {id(s) for s in opt.state.values()}  # a checkpoint load in between replaces the state dicts
        for state, key, origin in _OFFLOADED.pop(opt, []):
            value = state.get(key)
            if id(state) not in live or not isinstance(value, torch.Tensor):
                continue
            target = torch.device(device) if device is not None else origin
            if value.device != target:
                state[key] = value.to(target, non_blocking=True)
                moved += value.numel() * value.element_size()
    _settle()
    return moved


def move_optimizer_state(optimizer: Any, device: torch.device | str) -> int:
    """Offload (``device`` on the host) or onload (an accelerator); return the bytes moved (0 when nothing was)."""
    device = torch.device(device)
    if device.type == "cpu":
        return offload_optimizer_state(optimizer, device)
    return onload_optimizer_state(optimizer, device)


def release_cached_memory() -> int:
    """Give the allocator's cached, unused device blocks back to the driver: a colocated engine waking next allocates
    with cudaMalloc, which cannot see memory torch keeps cached. Returns the bytes this process still reserves
    (0 without CUDA): what the trainer really holds while the engines are awake."""
    gc.collect()  # tensors only a reference cycle keeps alive (a finished step's graph) would pin their blocks
    _settle()
    return torch.cuda.memory_reserved() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def _settle() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        # blocks shared with the engines over CUDA IPC (the weight sync's packed chunks) stay reserved until their
        # consumers' references are collected: the last chunk of a sync would otherwise still pin its block when the
        # engines wake their KV cache
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
