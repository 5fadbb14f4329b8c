"""Per-sample digests of tokens and routes at each boundary a route crosses (``debug.route_trace``), and the check
that names the first boundary where a sample's digest changes.

A digest is a sum, mod 2^64, of one hash per (position, token, layer, expert set) row of the sample: a sum because a
sample's rows are split over data, context and sequence parallel ranks and over pipeline stages, whose partial
digests then add up to the whole sample's (``RouteProbe`` computes the router's part from the routing map Megatron
used, mapped back through the inverse of the packing). A route moved one row, given to another layer or token, or
a token changed on its way alters the sum; the order of rows and of the experts within a row does not.

Boundaries, in the order a route crosses them:

- ``rollout``: the ``Sample`` as the rollout client (or the episode runner, routes stitched) returned it;
- ``batch``: the sample as the driver hands it to the trainer, after every driver-side step;
- ``trainer input``: the sample as trainer rank 0 received it;
- ``router``: the (token, layer) routing Megatron used under replay, over every rank's rows.

NeMo-RL's ``NRL_R3_TRACE`` with ``tools/check_r3_trace.py`` checks token identity through packing and context
parallel the same way; this adds the routes and the boundaries before the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BOUNDARIES = ("rollout", "batch", "trainer input", "router")
TRACE_DIR = "trace"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_hashes(positions: np.ndarray, tokens: np.ndarray, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """One uint64 per row from its position, input token, layer and expert set (``experts``: ``[rows, K]``)."""
    with np.errstate(over="ignore"):
        h = _mix(np.asarray(positions, dtype=np.uint64))
        h = _mix(h ^ np.asarray(tokens, dtype=np.int64).astype(np.uint64))
        h = _mix(h ^ np.asarray(layers, dtype=np.uint64))
        for column in np.sort(np.asarray(experts, dtype=np.int64), axis=1).T:
            h = _mix(h ^ column.astype(np.uint64))
    return h


def wrapping_sum(values: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        return int(np.asarray(values, dtype=np.uint64).sum(dtype=np.uint64))


def sample_digest(tokens: np.ndarray, routes: np.ndarray | None) -> int | None:
    """The digest of one sample's ``T-1`` route rows (``[T-1, L, K]``) with the tokens they route (row t routes
    token t); None without routes."""
    if routes is None or not len(routes):
        return None
    rows, layers, _ = routes.shape
    pos = np.repeat(np.arange(rows), layers)
    return wrapping_sum(row_hashes(pos, np.asarray(tokens)[pos], np.tile(np.arange(layers), rows),
                                   routes.reshape(rows * layers, -1)))


def hex_digest(value: int | None) -> str | None:
    return None if value is None else f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def sample_hex(sample) -> str | None:
    """A ``Sample``'s digest as the trace records it."""
    return hex_digest(sample_digest(sample.tokens, sample.routed_experts))


def mark_rollout(samples: Sequence) -> Sequence:
    """Each sample's digest as the rollout returned it, kept on the sample for its step's record."""
    for s in samples:
        s.extra["trace_rollout"] = sample_hex(s)
    return samples


def step_records(samples: Sequence, boundaries: dict[str, list[str | None]] | None) -> list[dict]:
    """A step's records: each sample's digest at the rollout (``mark_rollout``), in the batch as trained, and at
    each boundary the trainer traced (one digest per sample)."""
    return [{"request_id": s.request_id, "index": i, "digests": {
        "rollout": s.extra.get("trace_rollout"),
        "batch": sample_hex(s),
        **{boundary: digests[i] for boundary, digests in (boundaries or {}).items()}}}
        for i, s in enumerate(samples)]


def write_step(folder: Path, step: int, records: Sequence[dict]) -> Path:
    """One JSON line per sample: its request id and index, and its digest at every boundary traced."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@dataclass(frozen=True)
class TraceBreak:
    step: int
    request_id: str
    boundary: str  # the first boundary whose digest differs from the one before it
    before: str  # the boundary before it

    def __str__(self) -> str:
        return (f"step {self.step}, sample {self.request_id}: the routes or tokens changed between "
                f"'{self.before}' and '{self.boundary}'")


def first_break(record: dict, step: int) -> TraceBreak | None:
    seen = [(b, record["digests"].get(b)) for b in BOUNDARIES if record["digests"].get(b) is not None]
    for (before, a), (boundary, b) in zip(seen, seen[1:]):
        if a != b:
            return TraceBreak(step, record["request_id"], boundary, before)
    return None


@dataclass(frozen=True)
class TraceReport:
    steps: int
    samples: int
    boundaries: tuple[str, ...]  # those recorded for every sample
    breaks: tuple[TraceBreak, ...]


def read_steps(folder: Path) -> Iterable[tuple[int, list[dict]]]:
    for path in sorted(Path(folder).glob("step_*.jsonl")):
        yield int(path.stem.split("_")[1]), [json.loads(line) for line in path.read_text().splitlines() if line]


def check(folder: Path) -> TraceReport:
    """Every traced sample of every step in ``folder``: the boundaries all its digests were recorded at, and where
    each broke."""
    return report(read_steps(folder))


def report(traced: Iterable[tuple[int, Sequence[dict]]]) -> TraceReport:
    """``check`` on records in hand, as ``(step, records)``."""
    steps = samples = 0
    common: set[str] | None = None
    breaks: list[TraceBreak] = []
    for step, records in traced:
        steps += 1
        for record in records:
            samples += 1
            present = {b for b, d in record["digests"].items() if d is not None}
            common = present if common is None else common & present
            found = first_break(record, step)
            if found is not None:
                breaks.append(found)
    order = tuple(b for b in BOUNDARIES if common and b in common)
    return TraceReport(steps, samples, order, tuple(breaks))
