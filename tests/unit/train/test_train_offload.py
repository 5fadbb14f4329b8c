"""Colocated offload/onload of optimizer state (``r3rl.train.offload``) on a hybrid optimizer split like Megatron's
``HybridDeviceOptimizer``: a device part (``gpu_optimizer``) and a host part (``cpu_optimizers``), whose own
``state`` aliases its sub-optimizers' state dicts and carries each sub-optimizer's parameter as ``master_param``.

On a CPU the parts are told apart by where their state is put: the ``meta`` device stands for the accelerator
(tensors move onto it, never off it), the host part stays on the CPU. The round trip on a real GPU is
``tests/integration/train/test_megatron_gpu_optimizer.py``."""

from __future__ import annotations

from collections import defaultdict

import torch

from r3rl.train import offload


class HybridLike(torch.optim.Optimizer):
    """Megatron's HybridDeviceOptimizer's layout (``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``):
    a torch optimizer itself, sub-optimizers ``gpu_optimizer`` and ``cpu_optimizers`` (one AdamW per parameter, as
    with ``overlap_cpu_optimizer_d2h_h2d``), ``state`` rebuilt after each step from the sub-optimizers' dicts."""

    def __init__(self, device_params, host_params):
        super().__init__([*device_params, *host_params], {"lr": 0.1})
        self.gpu_optimizer = torch.optim.Adam(device_params, lr=0.1) if device_params else None
        self.cpu_optimizers = [torch.optim.AdamW([p], lr=0.1) for p in host_params]

    @property
    def sub_optimizers(self):
        return self.cpu_optimizers + ([self.gpu_optimizer] if self.gpu_optimizer is not None else [])

    def step(self, closure=None):
        for opt in self.sub_optimizers:
            opt.step()
        new_state = defaultdict(dict)  # _sync_sub_optimizers_state_to_hdo: the same dicts, plus master_param
        for opt in self.sub_optimizers:
            for param in opt.state:
                new_state[param] = opt.state[param]
                new_state[param]["master_param"] = param
        self.state = new_state


class Wrapper:
    """Megatron's DistributedOptimizer inside a ChainedOptimizer: the hybrid sits at ``.optimizer``."""

    def __init__(self, inner):
        self.optimizer = inner


def stepped_hybrid(n_device=2, n_host=3):
    dev = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(n_device)]
    host = [torch.nn.Parameter(torch.randn(32, 8)) for _ in range(n_host)]
    hybrid = HybridLike(dev, host)
    for p in dev + host:
        p.grad = torch.ones_like(p)
    hybrid.step()
    return hybrid, type("Chained", (), {"chained_optimizers": [Wrapper(hybrid)]})()


def host_tensors(hybrid):
    return {(id(s), k): v for opt in hybrid.cpu_optimizers for s in opt.state.values() for k, v in s.items()
            if torch.is_tensor(v)}


def test_onload_leaves_the_host_part_of_a_hybrid_optimizer_in_host_memory():
    """Fails if onload walks the hybrid optimizer's aliased ``state`` (or its ``cpu_optimizers``) and moves every
    tensor to the accelerator, as ``move_optimizer_state`` did before (the colocated step-2 failure)."""
    hybrid, chained = stepped_hybrid()
    before = host_tensors(hybrid)
    assert before and all(v.device.type == "cpu" for v in before.values())
    moved = offload.move_optimizer_state(chained, "meta")  # onload: "meta" stands for the GPU
    after = host_tensors(hybrid)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), "the host part's Adam state must stay where it is"
    # nothing was offloaded in this process: the device part stays too, and no byte moved
    assert moved == 0
    assert all(v.device.type == "cpu" for s in hybrid.gpu_optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


def test_offload_takes_the_device_part_only_and_never_a_parameter():
    """Fails if offload selects the host part's state, the hybrid's aliased ``state``, or a ``master_param`` entry
    (a parameter of the sub-optimizer: moving the dict entry frees nothing and puts a second copy back on onload)."""
    hybrid, chained = stepped_hybrid()
    # the device part on the accelerator (meta), its parameters (the hybrid's master_param entries) included, as
    # after a real step on a GPU: torch Adam's state layout, built by hand (nothing steps on meta)
    dev = [torch.nn.Parameter(torch.empty(16, 8, device="meta")) for _ in range(2)]
    hybrid.gpu_optimizer = torch.optim.Adam(dev, lr=0.1)
    for p in dev:
        hybrid.gpu_optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                         "exp_avg_sq": torch.zeros_like(p)}
        hybrid.state[p] = hybrid.gpu_optimizer.state[p]
        hybrid.state[p]["master_param"] = p
    moves = offload.offload_moves(chained)
    expected = [(id(s), k) for s in hybrid.gpu_optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert sorted((id(s), k) for s, k, _ in moves) == sorted(expected)
    dev_bytes = sum(s[k].numel() * s[k].element_size() for s in hybrid.gpu_optimizer.state.values()
                    for k in ("exp_avg", "exp_avg_sq"))
    assert sum(v.numel() * v.element_size() for _, _, v in moves) == dev_bytes == 2 * 2 * 16 * 8 * 4


def test_fully_offloaded_hybrid_has_no_device_part():
    """Megatron with ``optimizer_offload_fraction=1``: ``gpu_optimizer`` is None; fails if the walk falls back to
    the hybrid itself (whose ``state`` is the host part's) when there is no GPU optimizer."""
    hybrid, chained = stepped_hybrid(n_device=0)
    assert hybrid.gpu_optimizer is None
    assert offload.torch_optimizers(chained) == []
    assert offload.torch_optimizers(chained, host_part=True) == hybrid.cpu_optimizers
    before = host_tensors(hybrid)
    assert offload.move_optimizer_state(chained, "meta") == 0
    assert all(host_tensors(hybrid)[k] is v for k, v in before.items())


def test_plain_optimizer_onload_moves_back_only_what_offload_moved():
    """A plain torch optimizer (no hybrid): fails if onload moves state that offload did not take (here: state that
    was in host memory all along stays there when the trainer onloads)."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert offload.move_optimizer_state(Wrapper(opt), "cpu") == 0  # already on the host: nothing to offload
    assert offload.move_optimizer_state(Wrapper(opt), "meta") == 0
    assert all(v.device.type == "cpu" for v in opt.state[p].values() if torch.is_tensor(v))
