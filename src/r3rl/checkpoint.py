"""Checkpoint folders of a run: ``<run.output_dir>/checkpoints/step_NNNNNN/`` plus a ``latest`` pointer.

A checkpoint is written into a temporary folder and renamed into place, and ``latest`` is replaced atomically
after it, so a job killed mid-save always leaves the previous checkpoint usable. ``meta.json`` holds what the
recipe needs to continue: the step, the data position and the W&B run id.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

META = "meta.json"
LATEST = "latest"
TRAINER_DIR = "trainer"  # the trainer ranks' state inside a checkpoint folder (r3rl.train.checkpoint)
COMPLETE = "COMPLETE"  # written last into the trainer state: what saved it (JSON)
TRAINER_FORMAT = "megatron_dist/1"  # Megatron-core's dist_checkpointing, torch_dist backend


class CheckpointFormatError(ValueError):
    """A trainer state this version cannot load (r3rl's older per-rank format, or an unknown one)."""


@dataclass
class CheckpointMeta:
    step: int  # steps completed; the resumed run continues with step + 1
    wandb_run_id: str | None = None
    data_state: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0
    # the metrics of ``step`` not yet logged because SIGTERM interrupted its eval point: the resumed run redoes the
    # eval with these weights and logs both once
    unlogged_metrics: dict[str, float] | None = None


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save(run_dir: Path, meta: CheckpointMeta, write_state: Callable[[Path], None], keep: int = 2) -> Path:
    """Write a checkpoint: ``write_state(folder)`` stores the trainer state, then meta.json, then ``latest``."""
    folder = begin(run_dir, meta.step)
    write_state(folder)
    return publish(run_dir, folder, meta, keep)


def begin(run_dir: Path, step: int) -> Path:
    """The temporary folder step ``step``'s checkpoint is written into (emptied if a crash left one)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{step_dir_name(step)}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish(run_dir: Path, tmp: Path, meta: CheckpointMeta, keep: int = 2) -> Path:
    """Once the trainer state in ``tmp`` is complete: meta.json, the folder's final name, then ``latest``
    (atomically), and the oldest checkpoints beyond ``keep`` removed."""
    root = checkpoint_root(run_dir)
    read_complete(tmp / TRAINER_DIR)  # never name a checkpoint whose trainer state is unfinished
    final = root / step_dir_name(meta.step)
    (tmp / META).write_text(json.dumps(asdict(meta), indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    _prune(root, keep)
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    folder = root / pointer.read_text().strip()
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{pointer} names {folder.name}, which has no {META}: the checkpoint is incomplete")
    return folder


def read_meta(folder: Path) -> CheckpointMeta:
    return CheckpointMeta(**json.loads((folder / META).read_text()))


def update_meta(folder: Path, meta: CheckpointMeta) -> None:
    """Replace a checkpoint's meta.json atomically (the trainer state stays as it is)."""
    tmp = Path(folder) / f".{META}.tmp"
    tmp.write_text(json.dumps(asdict(meta), indent=2))
    os.replace(tmp, Path(folder) / META)


def freeze_router_mismatch(path, saved: bool) -> str:
    """Why a checkpoint's optimizer state cannot be resumed with ``trainer.freeze_router`` toggled (frozen routers
    have no optimizer state, so the state's shapes differ)."""
    return (f"{path} was saved with trainer.freeze_router={str(saved).lower()}: its optimizer holds "
            f"{'no' if saved else 'the'} routers' state, which trainer.freeze_router={str(not saved).lower()} cannot "
            f"load; resume with trainer.freeze_router={str(saved).lower()}, or start a new run (run.resume=false or "
            "another run.output_dir) from its exported weights")


def read_complete(trainer_dir: str | Path) -> dict[str, Any]:
    """What the trainer state's ``COMPLETE`` records (format, world size, layout, optimizer step). Raises
    ``FileNotFoundError`` for an unfinished folder and ``CheckpointFormatError`` for another format, naming it."""
    folder = Path(trainer_dir)
    marker = folder / COMPLETE
    if not marker.is_file():
        raise FileNotFoundError(f"{folder}: not a complete trainer checkpoint (no {COMPLETE} marker)")
    text = marker.read_text().strip()
    if text.isdigit():
        raise CheckpointFormatError(
            f"{folder}: a checkpoint in r3rl's old per-rank format (one torch.save file per rank, saved by {text} "
            f"ranks); this version reads Megatron's distributed format ({TRAINER_FORMAT}) only. Resume or export "
            "it with the r3rl release that wrote it")
    info = json.loads(text)
    if info.get("format") != TRAINER_FORMAT:
        raise CheckpointFormatError(f"{folder}: checkpoint format {info.get('format')!r}, this version reads "
                                    f"{TRAINER_FORMAT}")
    return info


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
