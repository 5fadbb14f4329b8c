"""The optimizer behind the trainer: Megatron's (distributed) optimizer, or the CPU's AdamW over ``main_grad``
(``r3rl.cpu_only.megatron``) for a CPU run without the distributed optimizer (the CPU profile's one rank).

Both expose ``step() -> (ok, grad_norm)``, ``zero_grad()``, ``set_lr()``, and their state for a checkpoint
(r3rl.train.checkpoint) in one form: a flat ``{n: ShardedTensor}`` (n numbers this rank's tensors; the file names
each by its own key and global offsets) under Megatron's ``fully_reshardable`` keys,
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model parameter key>`` in the model parameters' shapes, plus the Adam
step. Nothing in it depends on the layout or on how Megatron chains its optimizers (one at expert parallel 1, dense
+ expert above), so the state reshards, and the two optimizers read each other's checkpoints.
The learning rate follows a cosine from ``trainer.lr`` to ``trainer.min_lr`` over the run's optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from r3rl.config.schema import R3RLConfig
from r3rl.train import hardware, te_fallback


class Optimizer(Protocol):
    def step(self) -> tuple[bool, float]: ...

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    @property
    def stepped(self) -> bool:
        """Whether any optimizer step has made state (moments) to save."""

    @property
    def adam_step(self) -> int: ...

    def sharded_state_dict(self, model_state: dict, is_loading: bool, metadata: dict) -> dict: ...

    def load_sharded_state_dict(self, tensors: dict, adam_step: int) -> None: ...

    def reset_state(self) -> None:
        """Back to a never-stepped optimizer (a checkpoint saved before the first step holds no moments)."""


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


class MegatronOptimizer:
    """Megatron's (distributed) optimizer; its step reduces the grad norm over the right groups itself.

    Every call runs in ``hardware.optimizer_scope()`` (a no-op on GPUs), so CI runs this same optimizer
    on a CPU.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self._loading: dict | None = None

    def step(self) -> tuple[bool, float]:
        with hardware.optimizer_scope():
            ok, grad_norm, _ = self.inner.step()
        return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")

    def zero_grad(self) -> None:
        with hardware.optimizer_scope():
            self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def _parts(self) -> list:
        # get_megatron_optimizer chains a dense and an expert optimizer; each may be distributed
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    @property
    def stepped(self) -> bool:
        return any(len(part.optimizer.state) for part in self._parts())

    @property
    def adam_step(self) -> int:
        steps = set()
        with hardware.optimizer_scope():
            for part in self._parts():
                inner = part.state_dict()["optimizer"]
                # the distributed optimizer and TE's FusedAdam keep it in the param groups, torch's Adam per parameter
                found = {g["step"] for g in inner["param_groups"] if g.get("step") is not None}
                steps |= found or {float(s["step"]) for s in inner.get("state", {}).values() if "step" in s}
        assert len(steps) == 1, f"optimizers at different Adam steps: {sorted(steps)}"
        return int(steps.pop())

    def sharded_state_dict(self, model_state: dict, is_loading: bool, metadata: dict) -> dict:
        # inside the scope: the fully reshardable gather allocates on "the device"; no_grad: loading copies into main
        # parameters that are views of the model's float32 ones, which require grad
        with hardware.optimizer_scope(), torch.no_grad():
            if is_loading and not self.stepped:
                for part in self._parts():
                    _allocate_state(part)
            full = self.inner.sharded_state_dict(model_state, is_loading, metadata=metadata)
        if is_loading:
            self._loading = full  # what load_sharded_state_dict fills and hands to Megatron
        return _flat(full)

    def load_sharded_state_dict(self, tensors: dict, adam_step: int) -> None:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

        full, self._loading = self._loading, None
        assert full is not None, "sharded_state_dict(is_loading=True) first"
        numbered = iter(range(len(tensors)))  # in the order _flat numbered them
        dict_list_map_inplace(lambda v: tensors[next(numbered)] if isinstance(v, ShardedBase) else v, full)
        dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, full)
        with hardware.optimizer_scope(), torch.no_grad():
            for part, saved in zip(self._parts(), _parts_of(full)):
                if "param_state" in saved:
                    _load_distributed(part, saved, adam_step)
                else:  # Megatron's non-distributed optimizers: their own format, with the step common to all
                    saved["optimizer"]["state"]["common_step"] = adam_step
                    part.load_state_dict(saved)

    def reset_state(self) -> None:
        if self.stepped:
            # its state may hold the master weights (precision-aware): cleared, they would be lost
            raise ValueError("this checkpoint was saved before the first optimizer step and holds no optimizer "
                             "state; Megatron's optimizer here has stepped already: load it into a fresh trainer")


def _load_distributed(part, saved: dict, adam_step: int) -> None:
    """One distributed optimizer's state: its param groups (their step set to ``adam_step``), then its parameter
    state in the format it was saved in."""
    for group in saved["optimizer"]["param_groups"]:
        group["step"] = adam_step
    param_state = saved.pop("param_state")
    kind = saved.pop("param_state_sharding_type")  # the format the state was requested in
    part.load_state_dict(saved)  # param groups and the Adam step (torch's AdamW: per parameter)
    # Megatron copies every key of a parameter's optimizer state from the checkpoint, torch's per parameter "step"
    # included, which its saved state does not hold; and it gave every parameter one shared step tensor, which
    # torch's AdamW would then advance once per parameter
    steps = [(state, state.pop("step")) for state in part.optimizer.state.values() if "step" in state]
    getattr(part, f"load_parameter_state_from_{kind}")(param_state)
    for state, old in steps:  # one tensor each, where the optimizer kept it
        state["step"] = old.new_tensor(float(adam_step)) if isinstance(old, torch.Tensor) else adam_step


def _parts_of(full: dict) -> list[dict]:
    """A chained optimizer's sharded state is ``{index: part}``, a single one's the part itself."""
    return list(full.values()) if all(isinstance(k, int) for k in full) else [full]


def _flat(tree) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    # every sharded leaf (a distributed optimizer's parameter state; dp_reshardable's per-rank param groups; the
    # other optimizers' moments), numbered, not keyed: the stacked layers share one key (their index is an offset)
    return dict(enumerate(v for v in nested_values(tree) if isinstance(v, ShardedBase)))


def _allocate_state(part) -> None:
    """A never-stepped distributed optimizer has no state to load into, and without TransformerEngine or Apex its
    ``state_dict`` (which ``sharded_state_dict(is_loading=True)`` calls) asserts one common Adam step. Loading the
    bare param groups makes Megatron allocate every shard (uninitialised: the checkpoint overwrites it)."""
    if not hasattr(part, "load_parameter_state_from_fully_reshardable") or len(part.optimizer.state):
        return
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in part.optimizer.param_groups]
    part.load_state_dict({"optimizer": {"param_groups": groups}})


def build_optimizer(cfg: R3RLConfig, ddp_model, dtype: torch.dtype, use_distributed_optimizer: bool) -> Optimizer:
    tr = cfg.trainer
    if hardware.cpu_active() and not use_distributed_optimizer:
        from megatron.core import parallel_state as ps

        return hardware.cpu_optimizer(
            ddp_model.parameters(), lr=tr.lr, betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_eps,
            weight_decay=tr.weight_decay, clip_grad=tr.clip_grad,
            dense_norm_group=ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1
            else None,
            expert_norm_group=ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1
            else None,
        )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from r3rl.plan import optimizer_config

    settings = optimizer_config(cfg, {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                      torch.float16: "float16"}[dtype])
    settings.update(params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer)
    settings = te_fallback.drop_missing_optimizer_options(settings)
    # gloo groups hold the distributed optimizer's sharded-state gathers for checkpoints (r3rl.train.distributed)
    with hardware.optimizer_scope():
        return MegatronOptimizer(get_megatron_optimizer(OptimizerConfig(**settings), [ddp_model],
                                                        use_gloo_process_groups=True))
