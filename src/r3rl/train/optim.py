"""The optimizer behind the trainer: Megatron's on GPUs, the CPU compat AdamW over ``main_grad`` without one.

Both expose ``step() -> (ok, grad_norm)``, ``zero_grad()``, ``set_lr()``, ``state_dict()``/``load_state_dict()``.
The learning rate follows a cosine from ``trainer.lr`` to ``trainer.min_lr`` over the run's optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from r3rl.config.schema import R3RLConfig
from r3rl.train import cpu_compat


class Optimizer(Protocol):
    def step(self) -> tuple[bool, float]: ...

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def total_optimizer_steps(cfg: R3RLConfig) -> int:
    alg = cfg.algorithm
    per_rollout = max(alg.rollout_batch_size * alg.n_samples_per_prompt // alg.global_batch_size, 1)
    return cfg.run.num_steps * per_rollout


def lr_at(step: int, total: int, lr: float, min_lr: float) -> float:
    """Cosine decay from ``lr`` (step 0) to ``min_lr`` (step ``total``), flat after."""
    if total <= 0:
        return lr
    progress = min(step / total, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class CpuOptimizer:
    def __init__(self, inner: cpu_compat.MainGradAdam):
        self.inner = inner

    def step(self) -> tuple[bool, float]:
        return self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class MegatronOptimizer:
    """Megatron's (distributed) optimizer; its step reduces the grad norm over the right groups itself."""

    def __init__(self, inner: Any):
        self.inner = inner

    def step(self) -> tuple[bool, float]:
        ok, grad_norm, _ = self.inner.step()
        return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def _parts(self) -> list:
        # get_megatron_optimizer chains a dense and an expert optimizer; each may be distributed
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    def state_dict(self) -> dict:
        # the distributed optimizer keeps its Adam moments sharded; gather them (collective) for a checkpoint
        return {"optimizer": self.inner.state_dict(),
                "param_state": [p.get_parameter_state_dp_zero() if hasattr(p, "get_parameter_state_dp_zero")
                                else None for p in self._parts()]}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["optimizer"])
        for part, param_state in zip(self._parts(), state["param_state"]):
            if param_state is not None:
                part.load_parameter_state_from_dp_zero(param_state)


def build_optimizer(cfg: R3RLConfig, ddp_model, dtype: torch.dtype, use_distributed_optimizer: bool) -> Optimizer:
    tr = cfg.trainer
    if cpu_compat.is_active():
        from megatron.core import parallel_state as ps

        return CpuOptimizer(cpu_compat.MainGradAdam(
            ddp_model.parameters(), lr=tr.lr, betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_eps,
            weight_decay=tr.weight_decay, clip_grad=tr.clip_grad,
            dense_norm_group=ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1
            else None,
            expert_norm_group=ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1
            else None,
        ))
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=tr.lr, min_lr=tr.min_lr, weight_decay=tr.weight_decay, adam_beta1=tr.adam_beta1,
        adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps, clip_grad=tr.clip_grad, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer,
    )
    return MegatronOptimizer(get_megatron_optimizer(config, [ddp_model]))
