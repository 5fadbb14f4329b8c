"""Check finished ``Sample``s against the rollout -> training contract (``r3rl.sample``, r3-contract.md §1).

Used by ``python -m r3rl.tools.verify_rollout`` on saved rollouts. Unlike the client's decode path (which fails
on the first bad sample), this collects every problem so one run tells the whole story.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3rl.rollout.routed_experts import RoutedExpertsError, RouteSpec, check_routes
from r3rl.sample import Sample, SampleStatus, routes_dtype

_FINISH_FOR_STATUS = {
    SampleStatus.COMPLETED: {"stop", "repetition"},
    SampleStatus.TRUNCATED: {"length"},
    SampleStatus.ABORTED: {"abort"},
}


def verify_sample(s: Sample, *, num_layers: int, topk: int, num_experts: int | None = None,
                  routing_replay: bool = True) -> list[str]:
    """Problems with one sample, each naming the sample index and request id with expected vs got."""
    where = f"sample {s.index} (request {s.request_id})"
    out: list[str] = []
    r = len(s.response_ids)
    for name, arr in (("rollout_logprobs", s.rollout_logprobs), ("loss_mask", s.loss_mask)):
        if len(arr) != r:
            out.append(f"{where}: {name} has the wrong length: expected {r} (one per response token), got {len(arr)}")
    if s.finish_reason not in _FINISH_FOR_STATUS.get(s.status, set()):
        out.append(f"{where}: status {s.status.value} does not match finish_reason: expected one of "
                   f"{sorted(_FINISH_FOR_STATUS.get(s.status, set()))}, got {s.finish_reason!r}")
    if s.status is SampleStatus.ABORTED and len(s.loss_mask) and np.any(s.loss_mask != 0):
        out.append(f"{where}: aborted sample would be trained on: expected an all-zero loss mask, got "
                   f"{int(np.count_nonzero(s.loss_mask))} tokens masked in")
    if s.rollout_logprobs.size and not np.all(np.isfinite(s.rollout_logprobs)):
        out.append(f"{where}: rollout log-probs: expected finite values, got non-finite ones")
    if not routing_replay:
        return out
    routes = s.routed_experts
    if routes is None:
        if not (s.status is SampleStatus.ABORTED and r == 0):
            out.append(f"{where}: routed experts missing: expected [{s.num_tokens - 1}, {num_layers}, {topk}], "
                       f"got None (allowed only for an abort with no token; status {s.status.value}, {r} tokens)")
        return out
    if routes.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        out.append(f"{where}: routed experts dtype: expected uint8 (<= 256 experts) or uint16, got {routes.dtype} "
                   "(routes are widened only at the replay gather)")
        return out
    if num_experts is not None and routes.dtype != routes_dtype(num_experts):
        out.append(f"{where}: routed experts dtype: expected {routes_dtype(num_experts)} for {num_experts} experts, "
                   f"got {routes.dtype}")
        return out
    if routes.ndim == 3 and routes.shape[0] != s.num_tokens - 1:
        out.append(f"{where}: routed experts rows: expected {s.num_tokens - 1} (len(tokens) - 1), got "
                   f"{routes.shape[0]}")
        return out
    experts = num_experts if num_experts is not None else int(np.iinfo(routes.dtype).max) + 1
    try:
        check_routes(routes, s.num_tokens, RouteSpec(num_layers, topk, experts), sample_index=s.index,
                     request_id=s.request_id)
    except RoutedExpertsError as err:
        out.append(str(err))
    return out


def verify_samples(samples: Sequence[Sample], **kwargs) -> list[str]:
    problems: list[str] = []
    if not samples:
        return ["rollout holds no samples"]
    for s in samples:
        problems.extend(verify_sample(s, **kwargs))
    return problems
