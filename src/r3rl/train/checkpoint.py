"""Trainer checkpoints in Megatron-core's distributed format (``dist_checkpointing``, ``torch_dist`` backend).

Every rank writes its own shards of the model and optimizer in parallel; the files name tensors by their global
shape and offsets, so a checkpoint saved under one parallel layout loads under another (expert parallel 2 -> 1, the
reverse, a 4+4 checkpoint resumed colocated). The distributed optimizer's state goes through Megatron's
``fully_reshardable`` format by default: the Adam moments and float32 masters in the model's parameter shapes (its
default, ``fully_sharded_model_space``, builds flattened-range tensors Megatron's own validation refuses), or
``dp_reshardable`` (``trainer.checkpoint.sharding``: each rank's flat buffers, same layout only).

Completion is atomic: rank 0 creates ``.<name>.partial``, every rank writes into it, rank 0 writes ``COMPLETE``
(JSON: format, world size, layout, optimizer step and format) and renames the folder after a barrier, so a crash
while saving never leaves a half-written checkpoint under the final name. Per-rank RNG states sit beside the shards
(``rng/rank<r>.pt``): a resume under the same layout continues bit for bit, a resharded one reseeds. An async save
(``trainer.checkpoint.async_save``) does the same once Megatron's queue finalizes it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from r3rl.checkpoint import COMPLETE, TRAINER_FORMAT, read_complete, replace_folder, sync_tree

RNG_DIR = "rng"


# Megatron's optimizer-state formats r3rl writes: fully_reshardable gathers each model-parallel rank's float32 state
# over data parallel into the model's shapes (any layout resumes it); dp_reshardable writes every rank's own flat
# buffers as they are (no gather, no copy; only the data-parallel size may change)
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")


def sharding_metadata(optimizer_format: str = "fully_reshardable") -> dict[str, Any]:
    """The metadata Megatron's ``sharded_state_dict`` calls take. A fresh dict per call: Megatron adds process
    groups to it in place. The fully reshardable gather goes over gloo to data-parallel rank 0 only (host memory,
    one copy per model-parallel group) rather than NCCL to every rank."""
    assert optimizer_format in OPTIMIZER_FORMATS, optimizer_format
    return {"distrib_optim_sharding_type": optimizer_format, "chained_optim_avoid_prefix": True,
            "distrib_optim_fully_reshardable_mem_efficient": True, "singleton_local_shards": False}


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # one write bucket per rank: Megatron-core 0.16 forks a writer process per bucket
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def rng_file(folder: Path, rank: int) -> Path:
    return folder / RNG_DIR / f"rank{rank:05d}.pt"


def _async_options() -> dict[str, Any]:
    """Megatron-core 0.19's save takes an async strategy, and its default ("nvrx") needs a package r3rl does not
    install; 0.16 has one way only."""
    import inspect

    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


def save(path: str | Path, state: dict[str, Any], *, rank: int, world_size: int, layout: Any, rng: dict[str, Any],
         info: dict[str, Any], queue: Any = None) -> Path:
    """Collective: write ``state`` (a sharded state dict: ShardedTensors plus common plain values, identical on
    every rank) and this rank's ``rng``; ``info`` goes into ``COMPLETE``. Returns the final folder. With ``queue``
    (Megatron's ``AsyncCallsQueue``) the tensors are staged now and written in the background; the folder gets its
    name when the queue finalizes the save (``AsyncCallsQueue.maybe_finalize_async_calls``, collective)."""
    from megatron.core import dist_checkpointing

    final = Path(path)
    tmp = final.with_name(f".{final.name}.partial")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()

    def complete() -> None:  # after every rank's shards are written (Megatron's own finalizers ran first)
        if rank == 0:
            (tmp / RNG_DIR).mkdir(exist_ok=True)
        _barrier()
        torch.save({"rng": rng, "layout": dataclasses.asdict(layout), "world_size": world_size}, rng_file(tmp, rank))
        _barrier()
        if rank == 0:
            record = {"format": TRAINER_FORMAT, "world_size": world_size, "layout": dataclasses.asdict(layout), **info}
            (tmp / COMPLETE).write_text(json.dumps(record, indent=1) + "\n")
            sync_tree(tmp)  # the shards on disk before the name says they are complete
            replace_folder(tmp, final)
        _barrier()

    if queue is None:
        dist_checkpointing.save(state, str(tmp), sharded_strategy=_strategy())  # ends with a barrier
        complete()
    else:
        request = dist_checkpointing.save(state, str(tmp), sharded_strategy=_strategy(), async_sharded_save=True,
                                          **_async_options())
        request.add_finalize_fn(complete)
        queue.schedule_async_request(request)
    return final


def load(path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Collective: the tensors ``state`` asks for (its ShardedTensors say which shards this rank holds now), from a
    checkpoint saved under any layout, plus the common values. A key the checkpoint lacks is an error naming it;
    keys the checkpoint has but ``state`` does not ask for (the optimizer, for an export) are skipped."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    read_complete(path)
    return dist_checkpointing.load(state, str(path), strict=StrictHandling.RAISE_UNEXPECTED)


def load_rng(path: str | Path, rank: int, world_size: int, layout: Any) -> dict[str, Any] | None:
    """This rank's saved RNG states when the checkpoint was saved by the same world size and layout, else None."""
    file = rng_file(Path(path), rank)
    if not file.is_file():
        return None
    # tensors, ints and strings only: a checkpoint is code only where it holds pickled objects (docs/security.md)
    saved = torch.load(file, map_location="cpu", weights_only=True)
    if saved["world_size"] != world_size or saved["layout"] != dataclasses.asdict(layout):
        return None
    return saved["rng"]


def close_writer() -> None:
    """Stop the multiprocessing Manager (a server process) Megatron's writer starts at a process's first save and
    keeps for the next ones: a Ray actor is killed without running the atexit hook that would stop it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is None:
        return
    filesystem_async._results_queue = None
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
