"""Everything Megatron-core 0.16 needs to train on a machine without a GPU, in one place.

Megatron assumes CUDA in a handful of spots: ``torch.cuda.current_device()`` as the device of new tensors (rotary,
router, DDP buffers), the CUDA RNG tracker (attention always forks it, activation recompute saves and restores it),
``get_default_causal_mask`` allocating on ``cuda``, the alltoall dispatcher's CUDA streams, and an optimizer/grad-norm
stack that allocates on ``cuda``. ``apply_if_needed`` points the first two at the CPU and is a no-op when CUDA is
available (the missing-TransformerEngine fallbacks, needed on GPUs too, live in ``r3rl.train.te_fallback``); the rest are settings
(``transformer_overrides``), an explicit causal mask so Megatron never builds its own (``attention_mask``) and a plain
torch optimizer over Megatron's ``main_grad`` buffers (``MainGradAdam``, behind ``CpuOptimizer``), used only while
the compat layer is active. The trainer reaches all of it through ``r3rl.train.hardware``, which imports this module
only where CUDA is not available.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_ACTIVE = False

# TransformerConfig settings that only make sense without a GPU: CPU parameter init, no fused CUDA kernels beyond the
# GPU speed settings (which the plan already turns off for parallelism.device=cpu), the allgather dispatcher
# (alltoall needs torch.cuda.Stream).
CPU_TRANSFORMER_OVERRIDES: dict[str, Any] = {
    "use_cpu_initialization": True,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "moe_token_dispatcher_type": "allgather",
}


def apply_if_needed() -> bool:
    """Patch Megatron for the CPU when there is no GPU; return whether the CPU compat layer is active.

    Idempotent. With CUDA available nothing is touched, so GPU runs use Megatron exactly as shipped.
    """
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():  # a second guard behind r3rl.train.hardware's
        return False
    _expect_missing_fused_kernels()
    _patch_current_device()
    _patch_rng()
    _ACTIVE = True
    return True


# Megatron warns once per importing module that TransformerEngine / Apex are missing (six lines from every trainer
# rank); the CPU profile never has them, so that is said once, here, instead.
_NO_FUSED_KERNELS = ("Transformer Engine and Apex are not installed", "Apex is not installed")


def _expect_missing_fused_kernels() -> None:
    """Silence Megatron's import-time TE/Apex warnings in this process and say it once. Runs before the first
    Megatron import of the trainer (``distributed.init``), as those warnings fire at import."""
    for message in _NO_FUSED_KERNELS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    print("r3rl CPU profile: no Transformer Engine or Apex (expected without a GPU); Megatron uses its torch "
          "fallbacks", file=sys.stderr, flush=True)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


class CpuStream:
    """What ``torch.cuda.current_stream()`` returns on a CPU (Megatron-core 0.19 asks for it on every gradient sync):
    CPU ops run in program order, so every wait Megatron asks for between streams is already satisfied."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_synchronize(device: Any = None) -> None:
    """CPU ops have finished when they return."""


def _cpu_stream(device: Any = None) -> CpuStream:
    return CpuStream()


def _patch_current_device() -> None:
    # Megatron uses torch.cuda.current_device() as "the device"; on this machine that is the CPU.
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    torch.cuda.current_stream = _cpu_stream  # type: ignore[assignment]
    # dist_checkpointing's writer synchronises the device before every save, a synchronous one included
    torch.cuda.synchronize = _cpu_synchronize  # type: ignore[assignment]


class CpuRNGStatesTracker:
    """Megatron's CUDA RNG tracker with the CPU generator behind it (same add/fork/get/set contract).

    Forking swaps the CPU generator's state for the named one and back, as the CUDA tracker does with the device
    generator, so dropout streams stay separate and activation recompute replays the same random numbers.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    # Activation recompute saves/restores "the CUDA RNG state" through these two module-level functions.
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_rng_tracker(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """CPU twin of ``model_parallel_cuda_manual_seed`` (same seed offsets, so streams match Megatron's layout)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def transformer_overrides() -> dict[str, Any]:
    """TransformerConfig settings the CPU needs, on top of ``plan.megatron_config``."""
    return dict(CPU_TRANSFORMER_OVERRIDES)


def attention_mask(seq_len: int, device: torch.device) -> torch.Tensor | None:
    """An explicit causal mask (True = masked) for the local attention on a CPU.

    Batches are right-padded, so causal masking alone keeps every real token blind to the padding after it.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def check_supported(tensor_parallel: int, pipeline_parallel: int, context_parallel: int) -> None:
    """Refuse layouts that Megatron cannot run on a CPU, with the reason."""
    problems = []
    if tensor_parallel != 1:
        problems.append("tensor_parallel must be 1 (MoE + TP needs sequence parallel, which torch's CPU norm refuses)")
    if pipeline_parallel != 1:
        problems.append("pipeline_parallel must be 1 (Megatron's pipeline schedules allocate on cuda)")
    if context_parallel != 1:
        problems.append("context_parallel must be 1 (context parallel attention needs TransformerEngine)")
    if problems:
        raise RuntimeError("Megatron on a CPU: " + "; ".join(problems))


class MainGradAdam:
    """AdamW over Megatron DDP's ``main_grad`` buffers, with global-norm clipping (Megatron's optimizer is CUDA-only).

    Gradients live in ``param.main_grad`` (float32) after ``finalize_model_grads``. Parameters that are not float32
    get a float32 master copy, so bf16 runs on a CPU still update in full precision.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, clip_grad: float, dense_norm_group: Any, expert_norm_group: Any):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().clone().float() if p.dtype != torch.float32 else p for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.clip_grad = clip_grad
        self.dense_norm_group = dense_norm_group
        self.expert_norm_group = expert_norm_group
        self._keys: dict[int, dict[str, int]] = {}  # where sharded_state_dict put each master's tensors

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def grad_norm(self) -> float:
        """Global L2 norm: dense grads are identical on every data-parallel rank after the all-reduce; expert grads
        are sharded over expert-parallel ranks and summed over them."""
        dense = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            sq = p.main_grad.double().pow(2).sum()
            if getattr(p, "allreduce", True):
                dense += sq
            else:
                expert += sq
        if torch.distributed.is_initialized():
            if self.expert_norm_group is not None:
                torch.distributed.all_reduce(expert, group=self.expert_norm_group)
            if self.dense_norm_group is not None:
                torch.distributed.all_reduce(dense, group=self.dense_norm_group)
        return math.sqrt(float(dense + expert))

    def step(self) -> tuple[bool, float]:
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return False, norm
        scale = 1.0
        if self.clip_grad > 0 and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
        for p, master in zip(self.params, self.masters):
            grad = p.main_grad.float()
            master.grad = grad * scale if scale != 1.0 else grad
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master is not p:
                    p.copy_(master)
                master.grad = None
        return True, norm

    def zero_grad(self) -> None:
        for master in self.masters:
            master.grad = None

    def _ensure_state(self) -> None:
        """Moments for every parameter (zeros and step 0 before the first step: exactly a fresh AdamW), so that a
        sharded state dict names every tensor a checkpoint holds or a load needs."""
        for master in self.masters:
            state = self.optimizer.state[master]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)

    @property
    def adam_step(self) -> int:
        self._ensure_state()
        steps = {float(self.optimizer.state[m]["step"]) for m in self.masters}
        assert len(steps) == 1, f"parameters at different Adam steps: {sorted(steps)}"
        return int(steps.pop())

    def sharded_state_dict(self, model_state: dict) -> dict:
        """The moments and float32 masters as ShardedTensors under the keys of Megatron's fully reshardable
        optimizer state (``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, the model parameters' shapes
        and shards), numbered in one flat dict (the stacked layers share a key: their index is a global offset). A
        load fills the same tensors in place."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                make_sharded_optimizer_tensor)

        self._ensure_state()
        by_index = get_param_id_to_sharded_param_map(model_state, self.params)
        flat, self._keys = {}, {}
        for i, master in enumerate(self.masters):
            state, self._keys[i] = self.optimizer.state[master], {}
            for name, tensor in (("param", master), ("exp_avg", state["exp_avg"]),
                                 ("exp_avg_sq", state["exp_avg_sq"])):
                sharded = make_sharded_optimizer_tensor(by_index[i], tensor, f"optimizer.state.{name}")
                self._keys[i][name] = len(flat)
                flat[len(flat)] = sharded
        return flat

    def load_sharded_state_dict(self, tensors: dict, adam_step: int) -> None:
        with torch.no_grad():
            for i, master in enumerate(self.masters):
                keys, own = self._keys[i], self.optimizer.state[master]
                own["exp_avg"].copy_(tensors[keys["exp_avg"]])
                own["exp_avg_sq"].copy_(tensors[keys["exp_avg_sq"]])
                own["step"] = torch.tensor(float(adam_step))
                master.copy_(tensors[keys["param"]])
                if master is not self.params[i]:
                    self.params[i].copy_(master)


class CpuOptimizer:
    """``MainGradAdam`` behind the trainer's optimizer interface (``r3rl.train.optim.Optimizer``)."""

    def __init__(self, inner: MainGradAdam):
        self.inner = inner

    def step(self) -> tuple[bool, float]:
        return self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    @property
    def stepped(self) -> bool:
        return bool(self.inner.optimizer.state)

    @property
    def adam_step(self) -> int:
        return self.inner.adam_step

    def sharded_state_dict(self, model_state: dict, is_loading: bool, metadata: dict) -> dict:
        return self.inner.sharded_state_dict(model_state)

    def load_sharded_state_dict(self, tensors: dict, adam_step: int) -> None:
        self.inner.load_sharded_state_dict(tensors, adam_step)

    def reset_state(self) -> None:
        self.inner.optimizer.state.clear()  # torch's AdamW starts every parameter afresh at its next step


def _names_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare index means a CUDA device


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """Inside Megatron's optimizer: ``device='cuda'`` allocations and ``.cuda()`` land on the CPU, and CPU tensors
    report CUDA type names (its dtype checks compare ``param.type()`` with ``torch.cuda.FloatTensor`` & co)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and args[1:] and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str) \
                and not result.startswith("torch.cuda."):
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def megatron_optimizer_scope() -> contextlib.AbstractContextManager:
    """Where Megatron's (distributed) optimizer runs: CUDA allocations redirected to the CPU."""
    return _CudaAsCpu()
