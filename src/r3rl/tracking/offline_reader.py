"""Read W&B offline run files (``run-<id>.wandb``) back: run info, config, history rows and summary.

wandb ships no reader for these files. Their layout (as written by wandb-core 0.31):

- a 7-byte header: ``:W&B``, the magic 0xBEE1 (little-endian) and a version byte (0);
- then LevelDB-log framing: the file is cut into 32 KiB blocks (the header counts towards the first); each
  record is stored as one or more chunks, each with a 7-byte chunk header ``crc32 (u32 LE) | length (u16 LE) |
  type (u8)`` where type is FULL (1) or FIRST (2) / MIDDLE (3) / LAST (4) for a record split across blocks, and
  the crc32 (zlib) covers the type byte and the data. A block's tail shorter than a chunk header is zero padding;
- each reassembled record is a ``wandb.proto.wandb_internal_pb2.Record`` protobuf.

A run resumed with the same id writes another ``offline-run-*-<id>`` folder; ``read_run`` on a run's output folder
stitches its files together in start order (``wandb sync --id <id> <folders>`` uploads them the same way).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_MAGIC = b":W&B" + struct.pack("<H", 0xBEE1)
_HEADER_LEN = len(_MAGIC) + 1
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """A ``.wandb`` file that is not one, or is corrupt; the message names the file and the byte offset."""


@dataclass
class OfflineRun:
    run_id: str
    name: str
    group: str
    tags: tuple[str, ...]
    project: str
    entity: str
    config: dict[str, Any]
    history: list[dict[str, Any]]  # one dict per logged step, with its step under "_step"
    summary: dict[str, Any]
    files: tuple[Path, ...] = ()
    exit_code: int | None = None  # None: the last file has no exit record (the run crashed or is still running)
    truncated: bool = False  # the last record of a file was cut short (a crash while writing); the rest is intact
    metric_step_axes: dict[str, str] = field(default_factory=dict)  # glob or name -> its step metric

    @property
    def steps(self) -> list[int]:
        return [row["_step"] for row in self.history]

    def metric_keys(self) -> list[str]:
        keys: dict[str, None] = {}
        for row in self.history:
            keys.update(dict.fromkeys(k for k in row if not k.startswith("_")))
        return list(keys)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the rows that logged it."""
        pairs = [(row["_step"], row[key]) for row in self.history if key in row]
        return [s for s, _ in pairs], [v for _, v in pairs]

    @property
    def r3(self) -> bool | None:
        """True/False from the ``r3:on``/``r3:off`` tag; None when neither is there."""
        if "r3:on" in self.tags:
            return True
        if "r3:off" in self.tags:
            return False
        return None

    @property
    def replay(self) -> str | None:
        """The replay mode (``r3``, ``r2``, ``none``) from the ``replay:<mode>`` tag; runs from before that tag
        existed say it through ``r3:on``/``r3:off``; None when neither is there."""
        for tag in self.tags:
            if tag.startswith("replay:"):
                return tag.split(":", 1)[1]
        return {True: "r3", False: "none", None: None}[self.r3]


def read_records(path: str | Path) -> tuple[list[pb.Record], bool]:
    """(records, truncated) of one ``.wandb`` file; ``truncated`` when its last chunk was cut short."""
    p = Path(path)
    data = p.read_bytes()
    if len(data) < _HEADER_LEN or data[: len(_MAGIC)] != _MAGIC:
        raise WandbFileError(f"{p}: not a W&B run file (no ':W&B' header)")
    if data[len(_MAGIC)] != 0:
        raise WandbFileError(f"{p}: W&B file version {data[len(_MAGIC)]} is not supported (expected 0)")
    records: list[pb.Record] = []
    pending: bytearray | None = None
    pos = _HEADER_LEN
    while pos < len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:
            pos += left_in_block  # zero padding at a block's end
            continue
        if pos + _CHUNK_HEADER > len(data):
            return records, True
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        start, end = pos + _CHUNK_HEADER, pos + _CHUNK_HEADER + length
        if end > len(data):
            return records, True
        if end > pos + left_in_block:
            raise WandbFileError(f"{p}: chunk at byte {pos} runs past its 32 KiB block")
        chunk = data[start:end]
        if zlib.crc32(bytes([kind]) + chunk) != crc:
            if end == len(data):
                return records, True
            raise WandbFileError(f"{p}: checksum mismatch in the chunk at byte {pos}")
        pos = end
        if kind == _FULL:
            payload: bytes | None = chunk
        elif kind == _FIRST:
            pending, payload = bytearray(chunk), None
        elif kind in (_MIDDLE, _LAST):
            if pending is None:
                raise WandbFileError(f"{p}: continuation chunk at byte {start - _CHUNK_HEADER} without a first chunk")
            pending += chunk
            payload = None
            if kind == _LAST:
                payload, pending = bytes(pending), None
        else:
            raise WandbFileError(f"{p}: unknown chunk type {kind} at byte {start - _CHUNK_HEADER}")
        if payload is not None:
            rec = pb.Record()
            rec.ParseFromString(payload)
            records.append(rec)
    return records, pending is not None


def _value(item: Any) -> Any:
    """Decode one config/summary/history item: JSON text, or (newer writers, history only) a typed field."""
    if item.value_json:
        return json.loads(item.value_json)
    try:
        kind = item.WhichOneof("value")
    except ValueError:  # config and summary items have no typed fields
        return None
    if kind is None or kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def _path(item: Any) -> list[str]:
    return list(item.nested_key) if item.nested_key else [item.key]


def _set_nested(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        nxt = target.get(part)
        if not isinstance(nxt, dict):
            nxt = target[part] = {}
        target = nxt
    target[path[-1]] = value


def _del_nested(target: dict[str, Any], path: list[str]) -> None:
    for part in path[:-1]:
        target = target.get(part, {})
        if not isinstance(target, dict):
            return
    target.pop(path[-1], None)


@dataclass
class _Segment:
    path: Path
    start: float
    run: OfflineRun


def _read_segment(path: Path) -> _Segment:
    records, truncated = read_records(path)
    run_rec: pb.RunRecord | None = None
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    axes: dict[str, str] = {}
    exit_code: int | None = None
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_rec = rec.run
            for item in rec.run.config.update:
                _set_nested(config, _path(item), _value(item))
        elif kind == "config":
            for item in rec.config.update:
                _set_nested(config, _path(item), _value(item))
            for item in rec.config.remove:
                _del_nested(config, _path(item))
        elif kind == "history":
            row = {".".join(_path(item)): _value(item) for item in rec.history.item}
            row.setdefault("_step", rec.history.step.num)
            history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                summary[".".join(_path(item))] = _value(item)
            for item in rec.summary.remove:
                summary.pop(".".join(_path(item)), None)
        elif kind == "metric" and rec.metric.step_metric:
            axes[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
        elif kind == "exit":
            exit_code = rec.exit.exit_code
    if run_rec is None:
        raise WandbFileError(f"{path}: no run record (is this a complete W&B offline file?)")
    config.pop("_wandb", None)
    summary = {k: v for k, v in summary.items() if not k.startswith("_wandb")}
    run = OfflineRun(
        run_id=run_rec.run_id, name=run_rec.display_name, group=run_rec.run_group, tags=tuple(run_rec.tags),
        project=run_rec.project, entity=run_rec.entity, config=config, history=history, summary=summary,
        files=(path,), exit_code=exit_code, truncated=truncated, metric_step_axes=axes,
    )
    start = run_rec.start_time.seconds + run_rec.start_time.nanos * 1e-9
    return _Segment(path, start, run)


def _merge(segments: list[_Segment]) -> OfflineRun:
    """One run from its resumed segments, oldest first. A resumed segment restarts at its checkpoint's step, so
    rows an earlier segment logged at that step or later (work lost in the crash) give way to the new ones."""
    segments = sorted(segments, key=lambda s: (s.start, str(s.path)))
    merged = segments[0].run
    for seg in segments[1:]:
        nxt = seg.run
        if nxt.run_id != merged.run_id:
            raise WandbFileError(f"{seg.path}: run id {nxt.run_id} differs from {merged.run_id} of {merged.files[0]}")
        if nxt.history:
            first = nxt.history[0]["_step"]
            merged.history = [row for row in merged.history if row["_step"] < first]
        merged.history += nxt.history
        merged.config.update(nxt.config)
        merged.summary.update(nxt.summary)
        merged.metric_step_axes.update(nxt.metric_step_axes)
        merged.name, merged.group, merged.tags = nxt.name, nxt.group, nxt.tags
        merged.files += nxt.files
        merged.exit_code, merged.truncated = nxt.exit_code, merged.truncated or nxt.truncated
    return merged


def find_run_files(root: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file at or below ``root`` (a file is returned as is)."""
    p = Path(root)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or folder")
    return sorted(p.rglob("run-*.wandb"))


def read_runs(root: str | Path) -> list[OfflineRun]:
    """Every run at or below ``root``, one ``OfflineRun`` per run id (resumed segments stitched together)."""
    by_id: dict[str, list[_Segment]] = {}
    for f in find_run_files(root):
        seg = _read_segment(f)
        by_id.setdefault(seg.run.run_id, []).append(seg)
    return [_merge(segs) for segs in by_id.values()]


def read_run(path: str | Path) -> OfflineRun:
    """The run in ``path``: a ``run-<id>.wandb`` file, an ``offline-run-*`` folder, or a run's output folder
    (whose resumed segments of one run id are stitched together). Raises when it holds no run or several."""
    runs = read_runs(path)
    if not runs:
        raise FileNotFoundError(f"{path}: no run-*.wandb file there (is logger.wandb.mode=disabled?)")
    if len(runs) > 1:
        ids = ", ".join(r.run_id for r in runs)
        raise WandbFileError(f"{path}: holds several runs ({ids}); pass one run's folder or file, or use read_runs")
    return runs[0]
