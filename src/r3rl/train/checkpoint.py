"""Trainer checkpoints: one file per rank (model shard, optimizer, step, RNG, caller's extra), written atomically.

Rank 0 creates a temporary folder, every rank writes its file, rank 0 renames the folder into place after a
barrier, so a crash never leaves a half-written checkpoint under the final name. Loading requires the same world
size and parallel layout that saved it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"


def rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank:05d}.pt"


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save(path: str | Path, rank: int, world_size: int, state: dict[str, Any]) -> Path:
    final = Path(path)
    tmp = final.with_name(f".{final.name}.partial")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save({**state, "world_size": world_size, "rank": rank}, rank_file(tmp, rank))
    _barrier()
    if rank == 0:
        (tmp / COMPLETE).write_text(str(world_size))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    _barrier()
    return final


def load(path: str | Path, rank: int, world_size: int) -> dict[str, Any]:
    folder = Path(path)
    if not (folder / COMPLETE).is_file():
        raise FileNotFoundError(f"{folder}: not a complete trainer checkpoint (no {COMPLETE} marker)")
    saved_world = int((folder / COMPLETE).read_text())
    if saved_world != world_size:
        raise ValueError(f"{folder}: saved by {saved_world} ranks, loading into {world_size}")
    state = torch.load(rank_file(folder, rank), map_location="cpu", weights_only=False)
    return state
