"""The trainer's own checkpoints (``r3rl.train.checkpoint`` is their format on disk): its model and optimizer as
Megatron's sharded state, the RNG, the background save queue, and the checks a load makes before Megatron reads
anything (the model's shapes, the optimizer format against this layout, ``trainer.freeze_router``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from r3rl import checkpoint as run_checkpoint
from r3rl.train import checkpoint, distributed, lora


class Checkpointing:
    """Save and load of ``MegatronTrainer`` (it mixes this in): reads its ``cfg``, ``info``, ``settings``,
    ``bare``, ``optimizer``, ``optimizer_step``, ``device`` and ``_saves`` (the async queue)."""

    def _sharded_state(self, *, optimizer: bool, is_loading: bool, optimizer_format: str) -> dict:
        """Model (and optimizer) as Megatron sharded tensors: each names this rank's shard of a global tensor, which
        is what lets a checkpoint load under another layout."""
        metadata = checkpoint.sharding_metadata(optimizer_format)
        model = self.bare.sharded_state_dict(metadata=metadata)
        if self.cfg.trainer.lora.rank > 0:  # adapters only: the frozen base is the HF checkpoint the run starts from
            model = lora.shard_adapters({k: v for k, v in model.items() if lora.is_adapter(k)})
        state = {"model": model}
        if optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], is_loading, metadata)
        return state

    def _rng_state(self) -> dict:
        from megatron.core.tensor_parallel import random as mrandom

        return {"torch": torch.get_rng_state(), "tracker": mrandom.get_cuda_rng_tracker().get_states(),
                "cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}

    @property
    def optimizer_format(self) -> str:
        """How checkpoints store the optimizer state (``trainer.checkpoint.sharding`` for Megatron's distributed
        optimizer; the other optimizers' state is in the model's shapes, as fully_reshardable's)."""
        return self.cfg.trainer.checkpoint.sharding if self.settings.use_distributed_optimizer \
            else "fully_reshardable"

    def _check_optimizer_format(self, path: str | Path, info: dict) -> None:
        if info["optimizer_format"] != "dp_reshardable":
            return
        saved, here = info["layout"], dataclasses.asdict(self.info.layout)
        if not self.settings.use_distributed_optimizer or saved != here:
            raise ValueError(
                f"{path}: its optimizer state was saved with trainer.checkpoint.sharding=dp_reshardable under layout "
                f"{saved}, which only Megatron's distributed optimizer under that same layout (any data-parallel "
                f"size) reads; this trainer runs {here}"
                + ("" if self.settings.use_distributed_optimizer else " without the distributed optimizer")
                + ". Resume it under its own layout (and save with fully_reshardable to reshard)")

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Collective: the model, the optimizer (once it has stepped: before that a fresh one is the state), the
        optimizer step and ``extra`` in Megatron's distributed format; every rank writes its shards. With
        ``trainer.checkpoint.async_save`` the state is staged now and written in the background: the folder
        appears once ``poll_saves`` or ``finish_saves`` finalized it."""
        stepped = self.optimizer.stepped
        state = self._sharded_state(optimizer=stepped, is_loading=False, optimizer_format=self.optimizer_format)
        # common values: rank 0's copy is the one stored, so nothing per rank goes here (RNG has its own files)
        state["r3rl"] = {"optimizer_step": self.optimizer_step, "model_name": self.cfg.model.name,
                         "adam_step": self.optimizer.adam_step if stepped else 0, "extra": dict(extra or {})}
        queue = self._save_queue() if self.cfg.trainer.checkpoint.async_save else None
        return checkpoint.save(path, state, rank=self.info.rank, world_size=self.info.world_size,
                               layout=self.info.layout, rng=self._rng_state(), queue=queue,
                               info={"optimizer_step": self.optimizer_step, "optimizer_state": stepped,
                                     "optimizer_format": self.optimizer_format, "model_name": self.cfg.model.name,
                                     "model_shape": run_checkpoint.model_shape(self.cfg.model),
                                     # frozen routers have no optimizer state: the state's shapes depend on it
                                     "freeze_router": self.cfg.trainer.freeze_router,
                                     # the adapters are tensors of the model: another LoRA cannot load them
                                     "lora": self._lora_shape()})

    def _lora_shape(self) -> dict | None:
        """What a LoRA checkpoint must match to load: the adapters' shape and the base they were trained on (a
        fingerprint of its files: the checkpoint holds the adapters alone)."""
        shape = run_checkpoint.lora_shape(self.cfg.trainer.lora)
        return None if shape is None else {**shape, "base": self._base_fingerprint()}

    def _base_fingerprint(self) -> str:
        if getattr(self, "_base_digest", None) is None:  # read once: a save must not reread the base's files
            self._base_digest = lora.base_fingerprint(self.source)
        return self._base_digest

    def _save_queue(self):
        if self._saves is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            # a writer process forked per save: the persistent one would be sent live tensors through a queue
            self._saves = AsyncCallsQueue(persistent=False)
        return self._saves

    def poll_saves(self) -> bool:
        """Collective: finalize the background saves every rank has finished writing; True when none is left."""
        if self._saves is None:
            return True
        self._saves.maybe_finalize_async_calls(blocking=False)
        return self._saves.get_num_unfinalized_calls() == 0

    def finish_saves(self) -> None:
        """Collective: wait for the background saves and finalize them."""
        if self._saves is not None:
            self._saves.maybe_finalize_async_calls(blocking=True)

    def load_checkpoint(self, path: str | Path, *, optimizer: bool = True) -> dict:
        """Collective: restore a checkpoint saved under any parallel layout; the RNG too when the layout is this
        one (a resharded resume reseeds from the step instead). ``optimizer=False`` loads the weights only (an
        export). Returns the saving call's ``extra``."""
        from megatron.core.tensor_parallel import random as mrandom

        info = checkpoint.read_complete(path)
        wrong_model = run_checkpoint.model_mismatch(path, info, self.cfg.model)
        if wrong_model:
            raise ValueError(wrong_model)
        wrong_adapters = run_checkpoint.lora_mismatch(path, info.get("lora"), self._lora_shape())
        if wrong_adapters:
            raise ValueError(wrong_adapters)
        with_optimizer = optimizer and info["optimizer_state"]
        if with_optimizer:
            self._check_optimizer_format(path, info)
            frozen = info.get("freeze_router")  # None: saved before r3rl recorded it
            if frozen is not None and frozen != self.cfg.trainer.freeze_router:
                raise ValueError(run_checkpoint.freeze_router_mismatch(path, frozen))
        state = self._sharded_state(optimizer=with_optimizer, is_loading=True,
                                    optimizer_format=info["optimizer_format"])
        state["r3rl"] = {}
        loaded = checkpoint.load(path, state)
        if self.cfg.trainer.lora.rank > 0:
            missing, unexpected = self.bare.load_state_dict(loaded["model"], strict=False)
            adapters = [k for k in missing if lora.is_adapter(k)]
            if adapters or unexpected:
                raise ValueError(f"{path}: the adapters do not fit this model (missing {adapters[:5]}, unexpected "
                                 f"{list(unexpected)[:5]})")
        else:
            self.bare.load_state_dict(loaded["model"], strict=True)
        if with_optimizer:
            self.optimizer.load_sharded_state_dict(loaded["optimizer"], int(loaded["r3rl"]["adam_step"]))
        elif optimizer:
            self.optimizer.reset_state()
        self.optimizer_step = int(loaded["r3rl"]["optimizer_step"])
        rng = checkpoint.load_rng(path, self.info.rank, self.info.world_size, self.info.layout)
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            mrandom.get_cuda_rng_tracker().set_states(rng["tracker"])
            if rng["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"])
        else:  # another layout: no rank's saved stream is this rank's
            distributed.seed_all(self.cfg.run.seed + self.optimizer_step)
        return loaded["r3rl"]["extra"]
