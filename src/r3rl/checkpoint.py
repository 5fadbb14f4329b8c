"""Checkpoint folders of a run: ``<run.output_dir>/checkpoints/step_NNNNNN/`` plus a ``latest`` pointer.

A checkpoint is written into a temporary folder, flushed to disk (files and folders fsync'ed) and renamed into
place, and ``latest`` is replaced atomically after it, so a job killed mid-save (even ``kill -9``, even a node that
loses power once the rename is on disk) always leaves the previous checkpoint usable. A step saved again moves its
old folder aside before the new one takes the name, and pruning never removes a step newer than the one just
written. ``meta.json`` holds what the recipe needs to continue: the step, the data position and the W&B run id.
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


class CheckpointError(ValueError):
    """A checkpoint folder r3rl cannot read: a damaged ``meta.json``, ``COMPLETE`` or ``latest``; the message names
    the file."""


class CheckpointFormatError(CheckpointError):
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
    _fsync(tmp / META)  # the trainer state was flushed by the ranks that wrote it (r3rl.train.checkpoint)
    _fsync(tmp)
    replace_folder(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / LATEST)
    _fsync(root)
    _prune(root, keep, meta.step)
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(errors="replace").strip()
    if _step_of(root / name) is None or "/" in name:  # anything else could name a folder outside the run
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a step_NNNNNN folder: the pointer is damaged; "
                              "write the newest complete step folder's name into it, or remove it")
    folder = root / name
    aside = aside_name(folder)
    if not folder.exists() and (aside / META).is_file():
        return aside  # killed while a new save of the same step took the name (``replace_folder``)
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{pointer} names {folder.name}, which has no {META}: the checkpoint is incomplete")
    return folder


_META_TYPES = {"step": int, "wandb_run_id": (str, type(None)), "data_state": dict, "weight_version": int,
               "unlogged_metrics": (dict, type(None))}


def read_meta(folder: Path) -> CheckpointMeta:
    """A checkpoint's ``meta.json``; ``CheckpointError`` naming the file for one that is not what ``save`` wrote."""
    path = Path(folder) / META
    record = _read_json(path)
    wrong = [key for key in record if key not in _META_TYPES] + \
        [key for key, types in _META_TYPES.items() if key in record and (not isinstance(record[key], types) or
                                                                            isinstance(record[key], bool))]
    pending = record.get("data_state", {}).get("pending", []) if isinstance(record.get("data_state"), dict) else []
    if not isinstance(pending, list):  # the groups a stream drew and did not train (recipes/grpo.py)
        wrong.append("data_state.pending")
    if wrong or "step" not in record or record["step"] < 0:
        raise CheckpointError(f"{path}: not the meta.json r3rl writes (keys {sorted(record)[:8]}, wrong or "
                              f"missing: {wrong or ['step']}); the checkpoint is damaged")
    return CheckpointMeta(**record)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``CheckpointError`` naming it for anything else (bytes, other JSON)."""
    try:
        record = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, past Python's int or recursion limits
        raise CheckpointError(f"{path}: not valid JSON ({' '.join(str(err).split())[:120]}); the checkpoint is "
                              "damaged") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: a JSON {type(record).__name__}, not an object; the checkpoint is damaged")
    return record


def update_meta(folder: Path, meta: CheckpointMeta) -> None:
    """Replace a checkpoint's meta.json atomically (the trainer state stays as it is)."""
    tmp = Path(folder) / f".{META}.tmp"
    tmp.write_text(json.dumps(asdict(meta), indent=2))
    _fsync(tmp)
    os.replace(tmp, Path(folder) / META)
    _fsync(Path(folder))


def lora_shape(lora) -> dict | None:
    """The adapters a checkpoint of this ``trainer.lora`` holds; None for full-parameter training."""
    if lora.rank <= 0:
        return None
    return {"rank": lora.rank, "targets": sorted(lora.targets), "expert_adapters": lora.expert_adapters}


def lora_mismatch(path, saved: dict | None, now: dict | None) -> str | None:
    """Why a checkpoint cannot be resumed under another ``trainer.lora`` (its model holds other adapter tensors, or
    none); None when the adapters are the same. ``saved`` / ``now``: rank, targets and expert adapters, None for
    full-parameter training."""
    if saved == now:
        return None

    def says(lora):
        return "no LoRA" if lora is None else "trainer.lora " + ", ".join(f"{k}={v}" for k, v in lora.items())

    if saved is not None and now is not None and {**saved, "base": None} == {**now, "base": None}:
        return (f"{path} holds LoRA adapters trained on another base model (fingerprint {saved.get('base')}, this "
                f"run's model.checkpoint is {now.get('base')}): they cannot be merged into this one; start from "
                "the base the run used (its warm start or model.checkpoint)")
    return (f"{path} was saved with {says(saved)}, and this run has {says(now)}: the checkpoint's adapters (or "
            "their absence) do not fit this model; resume with the same trainer.lora, or start a new run "
            "(another run.output_dir) from its exported weights (python -m r3rl.export merges the adapters)")


def freeze_router_mismatch(path, saved: bool) -> str:
    """Why a checkpoint's optimizer state cannot be resumed with ``trainer.freeze_router`` toggled (frozen routers
    have no optimizer state, so the state's shapes differ)."""
    return (f"{path} was saved with trainer.freeze_router={str(saved).lower()}: its optimizer holds "
            f"{'no' if saved else 'the'} routers' state, which trainer.freeze_router={str(not saved).lower()} cannot "
            f"load; resume with trainer.freeze_router={str(saved).lower()}, or start a new run "
            "(another run.output_dir) from its exported weights")


# what a trainer state's tensors are shaped by: a resume with any of these changed fails inside Megatron's load
MODEL_SHAPE = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
               "num_experts", "moe_topk", "moe_ffn_hidden_size", "vocab_size", "tie_word_embeddings")


def model_shape(model: Any) -> dict[str, Any]:
    """The ``model`` config's fields that shape the trainer state, recorded in ``COMPLETE``."""
    return {key: getattr(model, key) for key in MODEL_SHAPE}


def model_mismatch(path, info: dict[str, Any], model: Any) -> str | None:
    """Why the trainer state ``info`` (its ``COMPLETE``) does not fit the ``model`` config, or None. A checkpoint
    saved before r3rl recorded the shape is compared by model name."""
    saved = info.get("model_shape")
    if saved is not None and not isinstance(saved, dict):
        return f"{path}: its COMPLETE records model_shape {saved!r:.60}, not the fields r3rl writes: it is damaged"
    if saved is None:
        if info.get("model_name") in (None, model.name):
            return None
        wrong = [f"model {info['model_name']!r}, this config {model.name!r}"]
    else:
        wrong = [f"{key}={value} where model.{key}={getattr(model, key, None)}" for key, value in saved.items()
                 if getattr(model, key, None) != value]
        if not wrong:
            return None
    return (f"{path} was saved by another model ({'; '.join(wrong)}): resume it with the model config that saved "
            "it, or start a new run in another run.output_dir")


def read_complete(trainer_dir: str | Path) -> dict[str, Any]:
    """What the trainer state's ``COMPLETE`` records (format, world size, layout, optimizer step). Raises
    ``FileNotFoundError`` for an unfinished folder and ``CheckpointFormatError`` for another format, naming it."""
    folder = Path(trainer_dir)
    marker = folder / COMPLETE
    if not marker.is_file():
        raise FileNotFoundError(f"{folder}: not a complete trainer checkpoint (no {COMPLETE} marker)")
    text = marker.read_bytes().strip()
    if text.isdigit() and len(text) < 10:
        raise CheckpointFormatError(
            f"{folder}: a checkpoint in r3rl's old per-rank format (one torch.save file per rank, saved by "
            f"{text.decode()} ranks); this version reads Megatron's distributed format ({TRAINER_FORMAT}) only. "
            "Resume or export it with the r3rl release that wrote it")
    info = _read_json(marker)
    if info.get("format") != TRAINER_FORMAT:
        raise CheckpointFormatError(f"{folder}: checkpoint format {info.get('format')!r:.60}, this version reads "
                                    f"{TRAINER_FORMAT}")
    return info


def existing_steps(run_dir: Path) -> list[Path]:
    """The published checkpoint folders under ``run_dir``, oldest step first."""
    root = checkpoint_root(run_dir)
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def replace_folder(new: Path, final: Path) -> None:
    """Give ``new`` the name ``final``: an existing ``final`` is renamed aside first and removed only once ``new``
    holds the name, so a crash in between leaves one of the two where a resume finds it (``latest`` falls back to
    the folder aside). A folder aside without ``final`` is that fallback itself, kept until ``new`` is in place."""
    aside = aside_name(final)
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        final.rename(aside)
    new.rename(final)
    _fsync(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def aside_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.replaced")


def sync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (itself included): a rename is atomic, but without this a
    crash of the node can leave the renamed folder with files the kernel never wrote."""
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int, written: int) -> None:
    """Remove the oldest checkpoints beyond ``keep`` among those up to step ``written``. A newer one is not this
    run's to remove: it was written by a longer run in the same folder (the launch refuses a fresh run into a folder
    with checkpoints, ``r3rl.preflight``, but a folder can be shared behind its back)."""
    steps = [p for p in sorted(root.glob("step_*")) if p.is_dir() and _step_of(p) is not None
             and _step_of(p) <= written]
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(folder: Path) -> int | None:
    suffix = folder.name.removeprefix("step_")
    return int(suffix) if suffix.isdigit() else None
