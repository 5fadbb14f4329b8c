"""The trainer's log-prob passes: response log-probs with or without replay, the route probe's per-layer figures
(routing flips, margins, expert load, whether replay used the routes given), the trainer's own recorded routes
(R2), the reference model's log-probs, and the route trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from r3rl import metrics as M
from r3rl import route_trace
from r3rl.sample import Sample
from r3rl.train import collect, drift
from r3rl.train.batch import MicroBatch
from r3rl.train.forward import ForwardPasses
from r3rl.train.replay import DriftReference, ProbeCounts, RouteProbe


@dataclass
class LogprobResult:
    logprobs: list[np.ndarray]  # float32 [R] per sample: log-prob of each response token
    # float [L]: share of the response rows' (token, layer) top-k sets the router would pick otherwise than the
    # rollout (rows P-1 .. T-2 of each real sample, whose output scores a response token)
    flip_per_layer: np.ndarray
    # replay: on every (token, layer), the routing map Megatron used equalled the rollout's route on the Sample
    # (mapped back through the inverse of the packing); None without replay
    replayed_routes_match: bool | None
    replay_mismatch_rows: int  # (token, layer) rows whose routing map differed from the rollout's route
    # the trainer's own routes of this pass, ``[T-1, L, K]`` per sample (R2 records them); None unless asked
    recorded_routes: list[np.ndarray] | None = None
    flip_per_layer_prompt: np.ndarray | None = None  # float [L]: the same over the prompt rows (0 .. P-2)
    # float [L] each, over the response rows, from the router's own logits: the mean margin (k-th minus (k+1)-th
    # selection score: the logit of a softmax router, sigmoid + bias of a sigmoid one), the share of rows with a
    # small one, and the expert load's MaxVio (max load / mean load - 1)
    margin_per_layer: np.ndarray | None = None
    small_margin_per_layer: np.ndarray | None = None
    load_max_vio_per_layer: np.ndarray | None = None
    # debug.route_trace under replay: per boundary the trainer sees ("trainer input", "router"), a digest per sample
    trace: dict[str, list[str | None]] | None = None
    # float [L]: the share of response rows the engine's rounding alone can flip (margin under its reach, the probe's
    # ``reachable``), and int [L]: the response rows counted
    reachable_per_layer: np.ndarray | None = None
    rows_per_layer: np.ndarray | None = None

    @property
    def flip_rate(self) -> float:
        return float(np.nanmean(self.flip_per_layer)) if np.isfinite(self.flip_per_layer).any() else float("nan")

    @property
    def replay_mismatch_figure(self) -> float:
        """``r3/replay_mismatch_rows``: rows Megatron routed otherwise than the rollout under replay (0 proves the
        replay, every step); NaN when the check saw no row (it must never read as a pass)."""
        if self.replay_mismatch_rows or self.replayed_routes_match:
            return float(self.replay_mismatch_rows)
        return float("nan")


@dataclass
class DriftResult:
    """The doctor's drift pass (``LogprobPasses.rounding_drift``), per layer over the response rows: the share whose
    margin is within the engine's rounding reach plus the drift measured on the row (check 3's reachable rows), the
    share whose own top-k the emulated rounding changed, and the drift's mean margin move in units of the rounding
    reach (how much more than one rounding the depth adds); ``scale`` the factor on the measured move."""

    reachable_per_layer: np.ndarray
    flip_per_layer: np.ndarray
    move_over_reach_per_layer: np.ndarray
    rows_per_layer: np.ndarray
    scale: float


# the drift pass's chunk: the unperturbed pass keeps ~36 bytes per row and MoE layer for the perturbed one to read
# (32 samples of 8k tokens on 48 layers: ~0.4 GB of device memory)
DRIFT_CHUNK_SAMPLES = 32


def per_row(total: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A per-layer count over the rows it was counted on; NaN where a layer saw none."""
    return np.where(rows > 0, total / np.maximum(rows, 1), np.nan).astype(np.float64)


class LogprobPasses(ForwardPasses):
    """No-grad passes of ``MegatronTrainer`` (it mixes this in); also reads its ``routers``, ``ref_model``, ``bare``
    (the unwrapped model) and ``settings``."""

    def logprobs(self, samples: Sequence[Sample], *, replay: bool, record: bool = False) -> LogprobResult:
        """Response log-probs of every sample (no grad), replaying the rollout routes or with live routing.

        Also measures, per layer, how often the trainer's own router picks a different top-k set than the rollout
        (over rows with rollout routes), and under replay whether the routing maps equalled the routes given.
        ``record`` (live routing only) also returns the routes the trainer chose in this very pass (R2's routes).
        """
        if (replay or record) and self.replay is None:
            raise RuntimeError("logprobs(replay=True or record=True) needs a model built with routing replay "
                               "(replay=r2|r3)")
        if record and replay:
            raise ValueError("logprobs: record the trainer's own routes in an unreplayed pass (replay=False)")
        if not samples:
            return LogprobResult([], np.full(self.cfg.model.num_moe_layers, np.nan), None, 0)
        routes = self._validated_routes(samples, required=replay)
        kept: dict | None = {} if record else None
        local, probe = self._forward_only(self.model, samples, replay=replay, probe_routes=routes,
                                          driver_routers=self.routers, recorded=kept)
        logprobs = collect.merge_by_index(local, len(samples), "log-probs")
        own = self._merge_recorded(samples, kept) if record else None
        num_layers = self.cfg.model.num_moe_layers
        if probe is None:
            return LogprobResult(logprobs, np.full(num_layers, np.nan), None, 0, own)
        counts = self._reduce_counts(probe.counts)
        flips, prompt = per_row(counts.flips, counts.routed_rows), per_row(counts.prompt_flips, counts.prompt_rows)
        margins_known = self.cfg.model.num_experts > self.cfg.model.moe_topk
        margin = per_row(counts.margin_sum, counts.routed_rows) if margins_known else np.full(num_layers, np.nan)
        small = per_row(counts.small_margins, counts.routed_rows) if margins_known else np.full(num_layers, np.nan)
        reachable = per_row(counts.reachable, counts.routed_rows) if margins_known else np.full(num_layers, np.nan)
        max_vio = np.asarray([M.max_vio(load) for load in counts.expert_load])
        mismatches = int(counts.replay_mismatches.sum())
        matched = (mismatches == 0 and bool((counts.replay_rows > 0).all())) if replay else None
        return LogprobResult(logprobs, flips, matched, mismatches, own, prompt, margin, small, max_vio,
                             self._route_trace(samples, probe), reachable, counts.routed_rows.copy())

    def rounding_drift(self, samples: Sequence[Sample], emulated_roundoff: float | None = None) -> DriftResult:
        """Two replayed passes over ``samples``: as they are, then with the engine's rounding emulated at every
        decoder layer (``r3rl.train.drift.engine_rounding``); the probe compares each row's router margin between
        them. Both replay the engine's routes, so what moves is numerics alone, propagated through this model's
        depth. ``emulated_roundoff``: the unit roundoff emulated (the engine's by default; 0 moves nothing, which
        tests pair the two passes with)."""
        if self.replay is None:
            raise RuntimeError("rounding_drift needs a model built with routing replay (replay=r2|r3)")
        routes = self._validated_routes(samples, required=True)
        scale = drift.drift_scale(drift.trainer_unit_roundoff(self.settings.dtype), self.engine_unit_roundoff)
        u = self.engine_unit_roundoff if emulated_roundoff is None else emulated_roundoff
        total = None
        # chunk by chunk: the unperturbed pass's rows wait on the device for the perturbed one (every router's rows
        # of a chunk, not of a GPU run's whole batch)
        for start in range(0, len(samples), DRIFT_CHUNK_SAMPLES):
            chunk, chunk_routes = samples[start:start + DRIFT_CHUNK_SAMPLES], routes[start:start + DRIFT_CHUNK_SAMPLES]
            reference = DriftReference(scale=scale)
            self._forward_only(self.model, chunk, replay=True, probe_routes=chunk_routes, driver_routers=self.routers,
                               drift_reference=reference)
            reference.keeping = False
            with drift.engine_rounding(self.bare, u, self.cfg.run.seed + start):
                _, probe = self._forward_only(self.model, chunk, replay=True, probe_routes=chunk_routes,
                                              driver_routers=self.routers, drift_reference=reference)
            part = probe.counts.as_tensor()
            total = part if total is None else total + part
        m = self.cfg.model
        counts = self._reduce_counts(ProbeCounts.from_tensor(total, m.num_moe_layers, m.num_experts))
        rows = counts.routed_rows
        if m.num_experts <= m.moe_topk:  # every expert routed: no margin, no flip
            nan = np.full(len(rows), np.nan)
            return DriftResult(nan, nan, nan, rows.copy(), scale)
        return DriftResult(per_row(counts.drift_reachable, rows), per_row(counts.drift_flips, rows),
                           per_row(counts.drift_over_reach, rows), rows.copy(), scale)

    def _route_trace(self, samples: Sequence[Sample], probe: RouteProbe) -> dict[str, list[str | None]] | None:
        """``debug.route_trace``: per sample, the digest of its tokens and routes as this rank received them, and of
        the routing the replayed pass used, summed over the ranks that split its rows and the stages that split its
        layers (``r3rl.route_trace``)."""
        if probe.digests is None:
            return None
        part = torch.from_numpy(probe.digests.view(np.int64).copy()).to(self.device)
        layer_groups = [self._ps.get_pipeline_model_parallel_group()] if self.pipelined else []
        router = collect.sum_over(part, self._row_groups() + layer_groups).cpu().numpy().view(np.uint64)
        return {"trainer input": [route_trace.sample_hex(s) for s in samples],
                "router": [route_trace.hex_digest(int(d)) for d in router]}

    def record_routes(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """The trainer's own routing (Megatron's RECORD), shaped like the engine's: ``[T-1, L, K]`` per sample in the
        narrow route dtype. Replaying these reproduces the unreplayed forward."""
        return self.logprobs(samples, replay=False, record=True).recorded_routes

    def _keep_recorded(self, samples: Sequence[Sample], mb: MicroBatch, valid: list[bool],
                       local: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]]) -> None:
        """This rank's rows of the top-k each router recorded in ``mb``'s forward, by sample index and layer."""
        # which (sample slot, position) each of this rank's router rows is, via the tokens' own layout
        slot, pos = (self.layout.router_rows(x, mb.segments) for x in mb.grid())
        from r3rl.sample import routes_dtype

        m = self.cfg.model
        # the engine's narrow dtype from here on: what all ranks gather (pickled) is 8x smaller than int64
        narrow = routes_dtype(m.num_experts)
        for layer, idx in self.replay.recorded().items():
            idx = idx.cpu().numpy().astype(narrow)
            for b, (index, ok) in enumerate(zip(mb.indices, valid)):
                length = samples[index].num_tokens - 1
                mine = (slot == b) & (pos < length)
                if not ok or not mine.any():
                    continue
                held = np.zeros(length, dtype=bool)
                rows = np.zeros((length, m.moe_topk), dtype=narrow)
                held[pos[mine]] = True
                rows[pos[mine]] = idx[mine]
                local.setdefault(index, {})[layer] = (held, rows)

    def _merge_recorded(self, samples: Sequence[Sample], local: dict) -> list[np.ndarray]:
        from r3rl.sample import routes_dtype

        m = self.cfg.model
        return collect.merge_routes(local, [s.num_tokens - 1 for s in samples], m.num_moe_layers, m.moe_topk,
                                    routes_dtype(m.num_experts))

    def reference_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Response log-probs under the frozen reference model (live routing, never replayed)."""
        if self.ref_model is None:
            raise RuntimeError("no reference model: set algorithm.use_kl_loss=true")
        local, _ = self._forward_only(self.ref_model, samples, replay=False, probe_routes=None)
        return collect.merge_by_index(local, len(samples), "reference log-probs")
