"""The optimizer behind the trainer: Megatron's (distributed) optimizer, or the CPU compat AdamW over ``main_grad``
for a CPU run without the distributed optimizer (the CPU profile's one rank).

Both expose ``step() -> (ok, grad_norm)``, ``zero_grad()``, ``set_lr()``, ``state_dict()``/``load_state_dict()``.
The learning rate follows a cosine from ``trainer.lr`` to ``trainer.min_lr`` over the run's optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from r3rl.config.schema import R3RLConfig
from r3rl.train import cpu_compat, te_fallback


class Optimizer(Protocol):
    def step(self) -> tuple[bool, float]: ...

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def total_optimizer_steps(cfg: R3RLConfig) -> int:
    if cfg.recipe.name == "sft":  # one optimizer step per run step
        return cfg.run.num_steps
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
    """Megatron's (distributed) optimizer; its step reduces the grad norm over the right groups itself.

    Every call runs in ``cpu_compat.megatron_optimizer_scope()`` (a no-op on GPUs), so CI runs this same optimizer
    on a CPU.
    """

    def __init__(self, inner: Any):
        self.inner = inner

    def step(self) -> tuple[bool, float]:
        with cpu_compat.megatron_optimizer_scope():
            ok, grad_norm, _ = self.inner.step()
        return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")

    def zero_grad(self) -> None:
        with cpu_compat.megatron_optimizer_scope():
            self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def _parts(self) -> list:
        # get_megatron_optimizer chains a dense and an expert optimizer; each may be distributed
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    def state_dict(self) -> dict:
        # the distributed optimizer keeps its Adam moments sharded; gather them (collective) for a checkpoint
        with cpu_compat.megatron_optimizer_scope():
            return {"optimizer": self.inner.state_dict(),
                    "param_state": [p.get_parameter_state_dp_zero() if hasattr(p, "get_parameter_state_dp_zero")
                                    else None for p in self._parts()],
                    "steps": [_adam_steps(p) for p in self._parts()]}

    def load_state_dict(self, state: dict) -> None:
        # no_grad: with float32 parameters the main parameters are views of the model's, which require grad
        with cpu_compat.megatron_optimizer_scope(), torch.no_grad():
            self.inner.load_state_dict(state["optimizer"])
            for part, param_state, steps in zip(self._parts(), state["param_state"], state["steps"]):
                # collective: data-parallel rank 0 holds the gathered state (None on the others) and scatters it
                if hasattr(part, "load_parameter_state_from_dp_zero"):
                    _set_adam_steps(part, None)  # the gathered state holds param/exp_avg/exp_avg_sq only
                    part.load_parameter_state_from_dp_zero(param_state)
                _set_adam_steps(part, steps)


def _adam_tensors(part) -> list:
    inner = getattr(part, "optimizer", None)
    if inner is None:
        return []
    return [(inner.state, p) for group in inner.param_groups for p in group["params"]]


def _adam_steps(part) -> list:
    """torch's AdamW (what Megatron uses without TransformerEngine or Apex) counts steps per parameter in its state;
    Megatron's gathered parameter state leaves them out, so they travel beside it."""
    return [state[p].get("step") for state, p in _adam_tensors(part)]


def _set_adam_steps(part, steps: list | None) -> None:
    entries = _adam_tensors(part)
    for i, (state, p) in enumerate(entries):
        if steps is None:
            state[p].pop("step", None)
        elif steps[i] is not None:
            state[p]["step"] = steps[i].clone() if isinstance(steps[i], torch.Tensor) else steps[i]


def build_optimizer(cfg: R3RLConfig, ddp_model, dtype: torch.dtype, use_distributed_optimizer: bool) -> Optimizer:
    tr = cfg.trainer
    if cpu_compat.is_active() and not use_distributed_optimizer:
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

    from r3rl.plan import optimizer_config

    settings = optimizer_config(cfg, {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                      torch.float16: "float16"}[dtype])
    settings.update(params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer)
    settings = te_fallback.drop_missing_optimizer_options(settings)
    # gloo groups hold the distributed optimizer's sharded-state gathers for checkpoints (r3rl.train.distributed)
    with cpu_compat.megatron_optimizer_scope():
        return MegatronOptimizer(get_megatron_optimizer(OptimizerConfig(**settings), [ddp_model],
                                                        use_gloo_process_groups=True))
