"""Rollout files (``debug.save_rollout``): a batch of ``Sample``s in one ``.npz``, read back without pickle.

Layout: per-field arrays concatenated over samples (prompt ids, response ids, log-probs, loss masks, and the routed
experts in their narrow dtype, ``sum(T_i - 1)`` rows) plus a JSON ``meta`` record per sample (lengths, status,
ids). Loading uses ``allow_pickle=False``; routes come back exactly as they were stored, dtype included.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from r3rl.sample import Sample, SampleStatus

FORMAT = "r3rl-rollout"
FORMAT_VERSION = 1


def save_rollout(samples: Sequence[Sample], path: str | os.PathLike) -> Path:
    """Write ``samples`` to ``path`` (``.npz`` appended when it has no suffix, like NumPy does); atomic: a reader
    never sees half a file. Returns the path written."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    dtypes = {r.dtype.str for r in routed}
    shapes = {r.shape[1:] for r in routed}
    if len(dtypes) > 1 or len(shapes) > 1:
        raise ValueError(f"save_rollout: samples mix route dtypes {sorted(dtypes)} / shapes {sorted(shapes)}")
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "samples": [
            {"index": s.index, "group": s.group, "request_id": s.request_id, "finish_reason": s.finish_reason,
             "status": s.status.value, "label": s.label, "reward": s.reward, "weight_version": s.weight_version,
             "prompt_len": int(len(s.prompt_ids)), "response_len": int(len(s.response_ids)),
             "route_rows": None if s.routed_experts is None else int(s.routed_experts.shape[0]),
             "extra": s.extra}
            for s in samples
        ],
    }
    arrays = {
        "meta": np.frombuffer(json.dumps(meta, default=str).encode(), dtype=np.uint8),
        "prompt_ids": _cat([s.prompt_ids for s in samples], np.int32),
        "response_ids": _cat([s.response_ids for s in samples], np.int32),
        "rollout_logprobs": _cat([s.rollout_logprobs for s in samples], np.float32),
        "loss_mask": _cat([s.loss_mask for s in samples], np.float32),
    }
    if routed:
        arrays["routed_experts"] = np.concatenate(routed, axis=0)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)  # a file object: np.savez would append ".npz" to a path
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def load_rollout(path: str | os.PathLike) -> list[Sample]:
    """Read a file written by ``save_rollout``."""
    path = Path(path)
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(data["meta"].tobytes().decode())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an r3rl rollout file (format={meta.get('format')!r})")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: rollout format version {meta.get('version')}, this r3rl reads "
                             f"{FORMAT_VERSION}")
        prompts, responses = data["prompt_ids"], data["response_ids"]
        logprobs, masks = data["rollout_logprobs"], data["loss_mask"]
        routes = data["routed_experts"] if "routed_experts" in data.files else None
    samples: list[Sample] = []
    p0 = r0 = e0 = 0
    for m in meta["samples"]:
        p1, r1 = p0 + m["prompt_len"], r0 + m["response_len"]
        rows = m["route_rows"]
        routed = None
        if rows is not None:
            if routes is None:
                raise ValueError(f"{path}: sample {m['index']} has routes in meta but the file holds none")
            routed = routes[e0:e0 + rows]
            e0 += rows
        samples.append(Sample(
            index=m["index"], group=m["group"], request_id=m["request_id"],
            prompt_ids=prompts[p0:p1], response_ids=responses[r0:r1], rollout_logprobs=logprobs[r0:r1],
            loss_mask=masks[r0:r1], finish_reason=m["finish_reason"], status=SampleStatus(m["status"]),
            routed_experts=routed, label=m["label"], reward=m["reward"], weight_version=m["weight_version"],
            extra=m["extra"] or {},
        ))
        p0, r0 = p1, r1
    if p0 != len(prompts) or r0 != len(responses) or (routes is not None and e0 != len(routes)):
        raise ValueError(f"{path}: array lengths do not match the per-sample meta (truncated or edited file?)")
    return samples
