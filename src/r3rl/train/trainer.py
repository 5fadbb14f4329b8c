"""``MegatronTrainer``: one instance per trainer rank (Ray actor, torchrun process, or a plain process).

Every rank is called with the same full list of samples and takes its data-parallel share itself; results
(log-probs, metrics) come back complete on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from r3rl import metrics as M
from r3rl import checkpoint as run_checkpoint
from r3rl import route_trace
from r3rl.config.modes import resolve_dtype, soft_replay_ratio
from r3rl.config.schema import R3RLConfig
from r3rl.sample import Sample
from r3rl.train import checkpoint, collect, convert, cpu_compat, distributed, export, grpo, offload, optim, sft
from r3rl.train import model as model_lib
from r3rl.train.batch import (MicroBatch, RouteShape, build_micro_batch, plan_micro_batches,
                              plan_packed_micro_batches, plan_token_micro_batches)
from r3rl.train.layout import TokenLayout
from r3rl.train.replay import ProbeCounts, ReplayDriver, RouteProbe, check_megatron_api, forget_instances
from r3rl.train.routes import check_routes


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
    # logit), the share of rows with a small one, and the expert load's MaxVio (max load / mean load - 1)
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


def _tokens_in_loss(per_token: dict[str, list[np.ndarray]], indices: Sequence[int]) -> bool:
    """Whether any token of ``indices`` is in the loss mask with a nonzero correction weight."""
    weights = per_token.get("is_weights")
    for i in indices:
        kept = per_token["loss_mask"][i] > 0
        if weights is not None:
            kept &= weights[i] != 0
        if kept.any():
            return True
    return False


class MegatronTrainer:
    def __init__(self, cfg: R3RLConfig):
        self.cfg = cfg
        self._closed = True
        self.routers: list = []
        self.replay = None
        self._weight_stream: export.HFBucketStream | None = None
        self._saves = None  # Megatron's AsyncCallsQueue, once an async checkpoint save was scheduled
        par = cfg.parallelism.trainer
        self.info = distributed.init(
            distributed.Layout(par.tensor_parallel, par.pipeline_parallel, par.expert_parallel,
                               par.context_parallel, par.expert_tensor_parallel), seed=cfg.run.seed)
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.shutdown()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.device = self.info.device
        self.settings = model_lib.model_settings(cfg)
        self.replay_enabled = bool(self.settings.transformer.get("moe_enable_routing_replay"))
        if self.replay_enabled:
            check_megatron_api()
        self.attention = convert.AttentionShape.of(cfg.model)
        self.route_shape = RouteShape(cfg.model.num_layers, cfg.model.moe_topk, cfg.model.num_experts)
        self.source = self._ensure_checkpoint()

        self.bare = model_lib.build_gpt(self.settings, self.device)
        convert.load_hf(self.bare, convert.HFCheckpoint(self.source), self.attention)
        if cfg.trainer.freeze_router:  # before DDP and the optimizer: no gradient buffer, no optimizer state
            for router in model_lib.routers(self.bare):
                router.requires_grad_(False)
        self.model = model_lib.wrap_ddp(self.bare, self.settings)
        self.routers = model_lib.routers(self.bare)
        self.soft_ratio = soft_replay_ratio(cfg)
        # the unit roundoff of the engine's dtype: how far its rounding can move a router logit, relatively
        self.engine_unit_roundoff = M.UNIT_ROUNDOFF[resolve_dtype(cfg.rollout.engine.dtype, cfg.parallelism.device)]
        self.replay = ReplayDriver(self.routers, self.soft_ratio) if self.replay_enabled else None
        self.optimizer = optim.build_optimizer(cfg, self.model, self.settings.dtype,
                                               self.settings.use_distributed_optimizer)
        self.total_steps = optim.total_optimizer_steps(cfg)
        self.optimizer_step = 0

        self.ref_model = None
        if cfg.algorithm.use_kl_loss:
            ref_settings = model_lib.model_settings(cfg, replay=False)  # never replays (pitfall P12)
            self.ref_model = model_lib.build_gpt(ref_settings, self.device)
            convert.load_hf(self.ref_model, convert.HFCheckpoint(self.source), self.attention)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)

        from megatron.core import parallel_state as ps

        self._ps = ps
        tp = ps.get_tensor_model_parallel_world_size()
        sp = self.settings.transformer.get("sequence_parallel", False)
        self.layout = TokenLayout(cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                                  sp_size=tp if sp else 1, sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0)
        self.pipelined = ps.get_pipeline_model_parallel_world_size() > 1
        # pipeline stages pass fixed-size activations, and the allgather dispatcher gathers equal token counts from
        # the expert-parallel ranks: then micro batches share one shape. alltoall takes unequal counts (GPU runs).
        self.equal_shapes = ps.get_expert_model_parallel_world_size() > 1 and \
            self.settings.transformer.get("moe_token_dispatcher_type") == "allgather"
        self.uniform_length = self.equal_shapes or self.pipelined
        # micro batches as packed rows (trainer.packing); an attribute so a test can run both layouts on one model
        self.packing = cfg.trainer.packing

    # ------------------------------------------------------------------------------------------------ setup

    def _ensure_checkpoint(self) -> Path:
        """The HF checkpoint folder; rank 0 generates it first when the model config allows (the tiny model)."""
        from r3rl.models.tiny_moe import ensure_checkpoint

        if self.info.rank == 0:
            ensure_checkpoint(self.cfg.model)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return ensure_checkpoint(self.cfg.model)

    # ------------------------------------------------------------------------------------------------ batches

    def _validated_routes(self, samples: Sequence[Sample], required: bool) -> list[np.ndarray] | None:
        if not required and any(s.routed_experts is None for s in samples):
            return None
        m = self.cfg.model
        return [check_routes(s.routed_experts, sample=i, num_tokens=s.num_tokens, num_layers=m.num_layers,
                             topk=m.moe_topk, num_experts=m.num_experts, request_id=s.request_id)
                for i, s in enumerate(samples)]

    def _micro_batches(self, samples: Sequence[Sample], indices: Sequence[int], micro_batch_size: int, *,
                       routes: list[np.ndarray] | None, per_token: dict[str, list[np.ndarray]] | None = None
                       ) -> list[tuple[MicroBatch, list[bool]]]:
        """This rank's micro batches over ``indices`` with, per slot, whether it is a real sample (padding slots
        repeat a real one with a zero loss mask so every expert-parallel rank runs the same forwards).

        ``trainer.max_tokens_per_micro_batch`` fills micro batches by a token budget instead of a sample count;
        ``trainer.packing`` lays each micro batch's samples end to end in one row (no right padding)."""
        budget = self.cfg.trainer.max_tokens_per_micro_batch
        lengths = {i: samples[i].num_tokens - 1 for i in indices}
        packed = self.packing
        if packed:
            plan = plan_packed_micro_batches(lengths, indices, self.info.dp_rank, self.info.dp_size,
                                             self.layout.padded_len, max_tokens=budget,
                                             micro_batch_size=micro_batch_size, equal_shapes=self.equal_shapes,
                                             uniform=self.pipelined)
            filler = min(indices, key=lengths.__getitem__)
        elif budget is None:
            seq_len = max(lengths.values()) if self.uniform_length else None
            plan = [(slots, seq_len) for slots in
                    plan_micro_batches(indices, self.info.dp_rank, self.info.dp_size, micro_batch_size)]
            filler = indices[0]
        else:
            plan = plan_token_micro_batches(lengths, indices, self.info.dp_rank, self.info.dp_size, budget,
                                            self.layout.padded_len, equal_shapes=self.equal_shapes)
            filler = min(indices, key=lengths.__getitem__)
        out = []
        for slots, seq_len in plan:
            valid = [i is not None for i in slots]
            real = [i if i is not None else filler for i in slots]
            tokens_inputs = None
            if per_token is not None:
                tokens_inputs = {k: [v[i] if ok else np.zeros_like(v[i]) for i, ok in zip(real, valid)]
                                 for k, v in per_token.items()}
            mb = build_micro_batch(samples, real, self.layout, self.device, per_token=tokens_inputs,
                                   routes=[routes[i] for i in real] if routes is not None else None,
                                   route_shape=self.route_shape, seq_len=seq_len, packed=packed)
            out.append((mb, valid))
        return out

    # ------------------------------------------------------------------------------------------------ forward

    def _forward(self, model, mb: MicroBatch, *, replay: bool, backward_follows: bool) -> torch.Tensor:
        """Token log-probs ``[B, S_local]`` of ``mb.labels`` (last pipeline stage) or the stage's activations."""
        from megatron.core import tensor_parallel

        if replay:
            self.replay.arm(mb.routes, self.device)
        try:
            if mb.packed:
                output = model(mb.tokens, mb.position_ids, None, packed_seq_params=self._packed_seq_params(mb))
            else:
                output = model(mb.tokens, mb.position_ids, cpu_compat.attention_mask(mb.tokens.shape[1], self.device))
        finally:
            if replay:
                self.replay.after_forward(backward_follows=backward_follows)
        if not self._ps.is_pipeline_last_stage():
            return output
        return -tensor_parallel.vocab_parallel_cross_entropy(output.float(), mb.labels)

    def _packed_seq_params(self, mb: MicroBatch):
        """Megatron's THD description of a packed row: the padded cu_seqlens for queries and keys alike (padding is
        then each segment's own trailing tokens, which causal attention keeps every real token blind to), the
        global ones under context parallel (RoPE and TE split them per rank), and the longest padded segment as a
        Python int (RoPE's table length, cached per value). ``tokens_per_sample`` stays unset: on 0.19 it reshapes
        the MoE input to ``[S, b, h]`` and the router rows would no longer be the packed tokens."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.as_tensor(mb.segments, dtype=torch.int32, device=self.device)
        longest = int(np.diff(mb.segments).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)

    def _forward_only(self, model, samples: Sequence[Sample], *, replay: bool, probe_routes: list | None,
                      driver_routers: list | None = None, recorded: dict | None = None
                      ) -> tuple[dict[int, np.ndarray], RouteProbe | None]:
        """No-grad pass over all samples; returns this rank's response log-probs by sample index and the route probe
        (its counts and, under ``debug.route_trace`` with replay, its digests: this rank's part of each).

        ``recorded``: a dict that receives, per sample index, this rank's recorded top-k rows per layer (the
        routers route themselves under Megatron's RECORD; never with ``replay``)."""
        if recorded is not None and (replay or self.pipelined):
            raise RuntimeError("routes are recorded in an unreplayed, unpipelined pass only")
        indices = list(range(len(samples)))
        routes = probe_routes
        mbs = self._micro_batches(samples, indices, self.cfg.trainer.micro_batch_size, routes=routes)
        results: dict[int, np.ndarray] = {}
        probe = RouteProbe(driver_routers, self.cfg.model.num_layers, self.layout, routes,
                           [s.loss_mask for s in samples], trace=replay and self.cfg.debug.route_trace,
                           soft_ratio=self.soft_ratio, unit_roundoff=self.engine_unit_roundoff
                           ) if (driver_routers and routes is not None) else None
        if replay and model is not self.model:
            raise RuntimeError("routes are replayed into the policy model only, never a reference model (P12)")
        model.eval()
        session = self.replay.session() if (self.replay is not None and model is self.model) \
            else contextlib.nullcontext()
        with torch.no_grad(), session, (probe or contextlib.nullcontext()):
            if self.pipelined:
                token_lps = self._pipelined(model, [mb for mb, _ in mbs], replay=replay, forward_only=True,
                                            probe=probe, valid=[v for _, v in mbs])
            else:
                token_lps = []
                for mb, valid in mbs:
                    if probe is not None:
                        probe.expect(mb, replaying=replay, valid=valid)
                    if recorded is not None:
                        self.replay.record()
                    token_lps.append(self._forward(model, mb, replay=replay, backward_follows=False))
                    if recorded is not None:
                        self._keep_recorded(samples, mb, valid, recorded)
                        self.replay.clear()
            if self._ps.is_pipeline_last_stage():
                for (mb, valid), lp in zip(mbs, token_lps):
                    self._keep_response_logprobs(mb, valid, lp, results)
        return results, probe

    def _keep_response_logprobs(self, mb: MicroBatch, valid: list[bool], token_lp: torch.Tensor,
                                out: dict[int, np.ndarray]) -> None:
        """Into ``out``, by sample index: the response log-probs of ``mb``'s real samples from its token log-probs
        (last pipeline stage; gathered over context parallel, a collective of its ranks)."""
        full = self.layout.gather_tokens(token_lp, group=self._ps.get_context_parallel_group(), segments=mb.segments)
        for b, (index, ok) in enumerate(zip(mb.indices, valid)):
            if ok:
                row, start, end = mb.scored(b)
                out[index] = full[row, start:end].float().cpu().numpy()

    def _pipelined(self, model, mbs: list[MicroBatch], *, replay: bool, forward_only: bool, probe=None,
                   loss=None, valid: list[list[bool]] | None = None) -> list:
        """Megatron's pipeline schedule over ``mbs`` (pipeline parallel > 1; GPU only). Forward-only returns the last
        stage's token log-probs per micro batch; training returns the loss terms per micro batch."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        queue = iter(mbs)
        collected: list = []
        validity = {id(mb): v for mb, v in zip(mbs, valid)} if valid is not None else {}

        def step(data_iterator, chunk):
            mb = next(data_iterator)
            if probe is not None:
                probe.expect(mb, replaying=replay, valid=validity.get(id(mb)))
            out = self._forward(chunk, mb, replay=replay, backward_follows=not forward_only)

            def loss_func(token_lp):
                if forward_only:
                    collected.append(token_lp.detach())
                    return token_lp.sum() * 0.0, {}
                terms = loss(token_lp, mb)
                collected.append(terms)
                return terms.loss, terms.tokens.to(torch.int), {}

            return out, loss_func

        get_forward_backward_func()(
            forward_step_func=step, data_iterator=queue, model=[model], num_microbatches=len(mbs),
            seq_length=mbs[0].seq_len, micro_batch_size=mbs[0].tokens.shape[0], forward_only=forward_only)
        return collected

    # ------------------------------------------------------------------------------------------------ collectives

    def _row_groups(self) -> list:
        """Groups over which the rows of a batch are split (data and context parallel, and TP under SP)."""
        ps = self._ps
        groups = [ps.get_data_parallel_group(with_context_parallel=True)]
        if self.layout.sp_size > 1:
            groups.append(ps.get_tensor_model_parallel_group())
        return groups

    def _reduce_counts(self, counts: ProbeCounts) -> ProbeCounts:
        t = counts.as_tensor().to(self.device)
        layer_groups = [self._ps.get_pipeline_model_parallel_group()] if self.pipelined else []
        return ProbeCounts.from_tensor(collect.sum_over(t, self._row_groups() + layer_groups),
                                       self.cfg.model.num_layers, self.cfg.model.num_experts)

    def _reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Loss-token statistics: summed over data/context parallel on the last stage, shared with every stage."""
        t = values.to(self.device, torch.float64)
        t = collect.sum_over(t, [self._ps.get_data_parallel_group(with_context_parallel=True)])
        return collect.share_from_last_stage(t, self.pipelined).cpu()

    # ------------------------------------------------------------------------------------------------ public API

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
            return LogprobResult([], np.full(self.cfg.model.num_layers, np.nan), None, 0)
        routes = self._validated_routes(samples, required=replay)
        kept: dict | None = {} if record else None
        local, probe = self._forward_only(self.model, samples, replay=replay, probe_routes=routes,
                                          driver_routers=self.routers, recorded=kept)
        logprobs = collect.merge_by_index(local, len(samples), "log-probs")
        own = self._merge_recorded(samples, kept) if record else None
        num_layers = self.cfg.model.num_layers
        if probe is None:
            return LogprobResult(logprobs, np.full(num_layers, np.nan), None, 0, own)
        counts = self._reduce_counts(probe.counts)
        def per_row(total: np.ndarray, rows: np.ndarray) -> np.ndarray:
            return np.where(rows > 0, total / np.maximum(rows, 1), np.nan).astype(np.float64)

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
        return collect.merge_routes(local, [s.num_tokens - 1 for s in samples], m.num_layers, m.moe_topk,
                                    routes_dtype(m.num_experts))

    def reference_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Response log-probs under the frozen reference model (live routing, never replayed)."""
        if self.ref_model is None:
            raise RuntimeError("no reference model: set algorithm.use_kl_loss=true")
        local, _ = self._forward_only(self.ref_model, samples, replay=False, probe_routes=None)
        return collect.merge_by_index(local, len(samples), "reference log-probs")

    def _accumulate(self, samples: Sequence[Sample], indices: list[int], per_token: dict[str, list[np.ndarray]],
                    routes: list[np.ndarray] | None, replay: bool,
                    probe: RouteProbe | None = None, objective: str = "grpo",
                    pi_old: dict[int, np.ndarray] | None = None, later: bool = False) -> tuple[torch.Tensor, int]:
        """Forward/backward over one global batch into the DDP grad buffers, then reduce and normalise them by the
        global loss-token count. Returns the summed loss terms and the backward-replay entries left unconsumed.
        ``probe`` checks, in these training forwards, that the routing maps used were the replayed routes.
        ``objective``: ``grpo`` (the policy loss) or ``sft`` (the NLL of the loss-mask tokens).
        ``pi_old`` (a dict, unpipelined only): the policy loss takes each forward's own log-probs, detached, as pi_old
        (``per_token`` holds none), and the dict receives them per sample index, as ``logprobs`` would.
        ``later``: this global batch is not its rollout batch's first, so the two last sums are the samples' mean
        |log-prob - rollout log-prob| over their loss tokens, summed, and the samples counted (the later mini-batches'
        mismatch, ``per_token`` holding ``rollout_logprobs`` and ``rollout_weight``); zero otherwise."""
        if pi_old is not None and self.pipelined:
            raise RuntimeError("pi_old from the training forward: not under pipeline parallel (1F1B)")
        from megatron.core.distributed import finalize_model_grads

        alg = self.cfg.algorithm
        mbs = self._micro_batches(samples, indices, self.cfg.trainer.micro_batch_size, routes=routes,
                                  per_token=per_token)

        drift = []  # later mini-batches: (sum of per-sample mean |log-prob - rollout log-prob|, samples) per micro batch

        def loss(token_lp: torch.Tensor, mb: MicroBatch) -> grpo.LossTerms:
            p = mb.per_token
            if later and "rollout_logprobs" in p:
                # slime's per-sample mean, then over samples, as train/logprob_abs_diff: each loss token weighs
                # 1/(its sample's loss tokens), so the weights sum to the samples counted
                weight = p["rollout_weight"].double()
                gap = (token_lp.detach().double() - p["rollout_logprobs"].double()).abs()
                drift.append(((weight * gap).sum(), weight.sum()))  # read back once, below
            if objective == "sft":
                return sft.nll_loss(token_lp, p["loss_mask"])
            old = token_lp.detach() if pi_old is not None else p["old_logprobs"]
            gspo = alg.loss == "gspo"
            return grpo.policy_loss(token_lp, old, p["advantages"], p["loss_mask"],
                                    clip_low=alg.gspo_clip_eps_low if gspo else alg.clip_eps_low,
                                    clip_high=alg.gspo_clip_eps_high if gspo else alg.clip_eps_high,
                                    ref_logprobs=p.get("ref_logprobs"),
                                    kl_coef=alg.kl_coef if alg.use_kl_loss else 0.0,
                                    is_weights=p.get("is_weights"), sequences=p.get("sequence"),
                                    num_sequences=len(samples))

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        unconsumed = 0
        session = self.replay.session() if self.replay is not None else contextlib.nullcontext()
        with session:
            if self.pipelined:
                self.model.config.finalize_model_grads_func = finalize_model_grads
                self.model.config.no_sync_func = self.model.no_sync
                # 1F1B interleaves forwards and backwards of different micro batches: no per-forward probe
                terms_list = self._pipelined(self.model, [mb for mb, _ in mbs], replay=replay, forward_only=False,
                                             loss=loss)
                num_tokens = None
            else:
                terms_list = []
                for mb, valid in mbs:
                    if probe is not None:
                        probe.expect(mb, replaying=replay)
                    token_lp = self._forward(self.model, mb, replay=replay, backward_follows=True)
                    if pi_old is not None:
                        self._keep_response_logprobs(mb, valid, token_lp.detach(), pi_old)
                    if probe is not None:  # activation recompute in backward re-runs the routers: not counted twice
                        probe.expect(None, replaying=False)
                    terms = loss(token_lp, mb)
                    terms.loss.backward()
                    if replay:
                        # with activation recompute, backward replays (pops) exactly what forward queued
                        unconsumed += self.replay.pending() if self.settings.transformer.get(
                            "recompute_granularity") == "full" else 0
                        self.replay.clear()
                    terms_list.append(terms)
                num_tokens = sum(t.tokens for t in terms_list).to(self.device, torch.int)
                finalize_model_grads([self.model], num_tokens=num_tokens)
        zero = torch.zeros((), dtype=torch.float64)
        sums = torch.stack([
            sum((t.loss.detach().double().cpu() for t in terms_list), zero),
            sum((t.pg.double().cpu() for t in terms_list), zero),
            sum((t.kl.double().cpu() for t in terms_list), zero),
            sum((t.clipped.double().cpu() for t in terms_list), zero),
            sum((t.ratio.double().cpu() for t in terms_list), zero),
            sum((t.tokens.double().cpu() for t in terms_list), zero),
            sum((d.double().cpu() for d, _ in drift), zero),
            sum((n.double().cpu() for _, n in drift), zero),
        ])
        return self._reduce_sums(sums), unconsumed

    def _per_token_inputs(self, samples: Sequence[Sample], advantages, old_logprobs, replay: bool,
                          is_weights=None, loss_masks=None, *, pi_old_from_forward: bool = False,
                          mini_batch: int | None = None) -> dict[str, list[np.ndarray]]:
        """The per-token inputs of the loss, per sample; ``mini_batch``: the samples one optimizer step takes
        (default ``algorithm.global_batch_size``), over which GSPO's sequence mean is taken."""
        lengths = [s.response_length for s in samples]
        adv = grpo.per_token_advantages(advantages, lengths)
        masks = loss_masks if loss_masks is not None else [s.loss_mask for s in samples]
        per_token = {"advantages": adv, "loss_mask": [np.asarray(m, dtype=np.float32) for m in masks]}
        if self.cfg.algorithm.loss == "gspo":  # which sample each position holds: GSPO's ratio is per sequence
            per_token["sequence"] = [np.full(n, i, dtype=np.float32) for i, n in enumerate(lengths)]
        if not pi_old_from_forward:
            if old_logprobs is None:
                # pi_old: the current weights on the same routes, before any update of this call
                old_logprobs = self.logprobs(samples, replay=replay).logprobs
            per_token["old_logprobs"] = [np.asarray(o, dtype=np.float32) for o in old_logprobs]
        if is_weights is not None:
            per_token["is_weights"] = [np.asarray(w, dtype=np.float32) for w in is_weights]
        if self.cfg.algorithm.loss == "gspo":  # GSPO averages per sequence, then over sequences
            seq = grpo.sequence_mean_weights(per_token["loss_mask"],
                                             mini_batch or self.cfg.algorithm.global_batch_size)
            own = per_token.get("is_weights")
            per_token["is_weights"] = seq if own is None else [w * s for w, s in zip(own, seq)]
        if len(samples) > self.cfg.algorithm.global_batch_size:  # the later mini-batches' drift is measured
            per_token["rollout_logprobs"] = [np.asarray(s.rollout_logprobs, dtype=np.float32) for s in samples]
            per_token["rollout_weight"] = [(m > 0) / max(float((m > 0).sum()), 1.0) for m in per_token["loss_mask"]]
        for name, values in (("loss_mask", per_token["loss_mask"]), ("is_weights", per_token.get("is_weights"))):
            bad = [i for i, (v, n) in enumerate(zip(values or [], lengths)) if v.shape != (n,)]
            if bad:
                raise ValueError(f"{name} of samples {bad[:5]} do not have one value per response token")
        if self.ref_model is not None and self.cfg.algorithm.use_kl_loss:
            per_token["ref_logprobs"] = self.reference_logprobs(samples)
        return per_token

    def train_step(self, samples: Sequence[Sample], advantages, *, replay: bool,
                   old_logprobs: Sequence[np.ndarray] | None = None, is_weights: Sequence[np.ndarray] | None = None,
                   loss_masks: Sequence[np.ndarray] | None = None) -> dict[str, float]:
        """GRPO update on ``samples``: ``len(samples) / algorithm.global_batch_size`` optimizer steps, each over
        micro batches of ``trainer.micro_batch_size`` per data-parallel rank.

        ``advantages``: one scalar or one ``float32[R]`` per sample. ``old_logprobs`` (pi_old per response token)
        default to a no-grad pass of the current weights with the same ``replay`` setting. ``is_weights`` and
        ``loss_masks`` (one ``[R]`` per sample) are the rollout correction's weights and masks. Every per-token
        input and route is indexed by sample, so each optimizer step's share keeps its own.
        Under replay the routing maps of every training forward are checked against the routes replayed
        (``replay_mismatch_rows``: must be 0; ``replayed_rows``).
        An optimizer step whose every token is out of the loss (mask 0 or correction weight 0) is skipped with a
        warning: no forward, no optimizer step (``rejected_steps``, also counted in ``skipped_steps``).
        """
        return self._train(samples, advantages, replay=replay, old_logprobs=old_logprobs, is_weights=is_weights,
                           loss_masks=loss_masks)

    def train_on_policy(self, samples: Sequence[Sample], advantages, *, replay: bool
                        ) -> tuple[LogprobResult, dict[str, float]]:
        """One optimizer step over ``samples`` (one global batch) whose pi_old is its own training forward's
        log-probs, detached. Before the update they are the current weights' log-probs on the same routes: what a
        no-grad pass (``logprobs``) would compute again, bit for bit on the CPU, for one forward more. So the ratio
        is exactly 1 and the gradient that of ``train_step`` with that pass's pi_old (TRL's GRPO with
        num_iterations=1 does the same). No correction weights or masks (they need pi_old before the loss), no
        pipeline stages (1F1B interleaves the forwards). Returns pi_old as ``logprobs(samples, replay=replay)``
        would, with the replay check of the training forwards and no routing-flip figures (the unreplayed pass
        measures those), and ``train_step``'s metrics."""
        gbs = self.cfg.algorithm.global_batch_size
        if len(samples) != gbs:
            raise ValueError(f"pi_old from the training forward needs one optimizer step: {len(samples)} samples, "
                             f"algorithm.global_batch_size={gbs}")
        kept: dict[int, np.ndarray] = {}
        metrics = self._train(samples, advantages, replay=replay, pi_old=kept)
        if metrics["rejected_steps"]:  # every token out of the loss: no forward ran (on any rank), the weights stand
            return self.logprobs(samples, replay=replay), metrics
        logprobs = collect.merge_by_index(kept, len(samples), "log-probs of the training forward")
        num_layers = self.cfg.model.num_layers
        if not replay:
            return LogprobResult(logprobs, np.full(num_layers, np.nan), None, 0), metrics
        mismatches = int(metrics["replay_mismatch_rows"])
        matched = mismatches == 0 and metrics["replayed_rows"] > 0
        return LogprobResult(logprobs, np.full(num_layers, np.nan), matched, mismatches), metrics

    def _train(self, samples: Sequence[Sample], advantages, *, replay: bool,
               old_logprobs: Sequence[np.ndarray] | None = None, is_weights: Sequence[np.ndarray] | None = None,
               loss_masks: Sequence[np.ndarray] | None = None, pi_old: dict[int, np.ndarray] | None = None
               ) -> dict[str, float]:
        if replay and self.replay is None:
            raise RuntimeError("train_step(replay=True) needs a model built with routing replay")
        gbs = self.cfg.algorithm.global_batch_size
        if not samples or len(samples) % gbs:
            raise ValueError(f"{len(samples)} samples do not split into global batches of {gbs} "
                             "(algorithm.global_batch_size)")
        routes = self._validated_routes(samples, required=True) if replay else None
        per_token = self._per_token_inputs(samples, advantages, old_logprobs, replay, is_weights, loss_masks,
                                           pi_old_from_forward=pi_old is not None)
        probe = RouteProbe(self.routers, self.cfg.model.num_layers, self.layout, routes,
                           [s.loss_mask for s in samples], soft_ratio=self.soft_ratio
                           ) if replay and not self.pipelined else None
        totals = torch.zeros(8, dtype=torch.float64)
        norms, ok_steps, unconsumed, rejected_steps = [], 0, 0, 0
        lr = self.cfg.trainer.lr
        for start in range(0, len(samples), gbs):
            indices = list(range(start, start + gbs))
            lr = optim.lr_at(self.optimizer_step, self.total_steps, self.cfg.trainer.lr, self.cfg.trainer.min_lr)
            if not _tokens_in_loss(per_token, indices):
                # every token rejected (mask 0 or weight 0): a zero gradient, on which Adam would still move the
                # weights by its momentum (and weight decay): no forward, no optimizer step. Every rank holds the
                # same per-token inputs, so every rank skips the same step.
                warnings.warn(f"optimizer step {self.optimizer_step + 1}: the rollout correction rejected every "
                              f"token of samples {indices[0]}..{indices[-1]}; the step is skipped", RuntimeWarning,
                              stacklevel=2)
                self.optimizer_step += 1
                rejected_steps += 1
                norms.append(0.0)
                continue
            with probe or contextlib.nullcontext():
                sums, left = self._accumulate(samples, indices, per_token, routes, replay, probe, pi_old=pi_old,
                                              later=start > 0)
            self.optimizer.set_lr(lr)
            ok, norm = self.optimizer.step()
            self.optimizer_step += 1
            ok_steps += int(ok)
            norms.append(norm)
            unconsumed += left
            totals += sums
        tokens = max(float(totals[5]), 1.0)
        steps = len(samples) // gbs
        metrics = {
            "loss": float(totals[0]) / tokens,
            "pg_loss": float(totals[1]) / tokens,
            "kl": float(totals[2]) / tokens,
            "clip_frac": float(totals[3]) / tokens,
            "ratio_mean": float(totals[4]) / tokens,
            "loss_tokens": float(totals[5]),
            "grad_norm": float(np.mean(norms)),
            "grad_norm_max": float(np.max(norms)),
            "lr": lr,
            "optimizer_steps": float(steps),
            "skipped_steps": float(steps - ok_steps),  # the optimizer's own skips and the rejected steps
            "rejected_steps": float(rejected_steps),
            "step": float(self.optimizer_step),
        }
        if totals[7] > 0:  # the rollout batch took several optimizer steps: the later ones' drift from the rollout
            metrics["later_minibatch_logprob_abs_diff"] = float(totals[6] / totals[7])
        if replay:
            metrics["replay_backward_unconsumed"] = float(unconsumed)
            metrics["replay_queue_after_step"] = float(self.replay.pending())
        if probe is not None:
            counts = self._reduce_counts(probe.counts)
            metrics["replay_mismatch_rows"] = float(counts.replay_mismatches.sum())
            metrics["replayed_rows"] = float(counts.replay_rows.sum())
            if self.soft_ratio is not None:  # prime-rl's figure: replayed (row, slot) pairs the filter overrode
                slots = counts.replay_rows.sum() * self.cfg.model.moe_topk
                metrics["router_replay_replace_rate"] = float(counts.replaced_slots.sum() / max(slots, 1))
        return metrics

    def gradients(self, samples: Sequence[Sample], advantages, *, replay: bool,
                  old_logprobs: Sequence[np.ndarray] | None = None, is_weights: Sequence[np.ndarray] | None = None,
                  loss_masks: Sequence[np.ndarray] | None = None) -> dict[str, Any]:
        """One global batch's reduced gradients (``main_grad`` per parameter name), without an optimizer step;
        ``is_weights`` and ``loss_masks`` as in ``train_step``. ``loss_tokens``: the token count it divides by."""
        routes = self._validated_routes(samples, required=True) if replay else None
        per_token = self._per_token_inputs(samples, advantages, old_logprobs, replay, is_weights, loss_masks,
                                           mini_batch=len(samples))
        sums, left = self._accumulate(samples, list(range(len(samples))), per_token, routes, replay)
        grads = self._main_grads()
        self.model.zero_grad_buffer()
        return {"grads": grads, "loss": float(sums[0]) / max(float(sums[5]), 1.0), "loss_tokens": float(sums[5]),
                "replay_backward_unconsumed": left,
                "replay_queue_after": self.replay.pending() if self.replay is not None else 0}

    # ------------------------------------------------------------------------------------------------ SFT

    def _sft_accumulate(self, samples: Sequence[Sample]) -> torch.Tensor:
        if not samples:
            raise ValueError("SFT: no samples")
        masks = [np.asarray(s.loss_mask, dtype=np.float32) for s in samples]
        bad = [i for i, (m, s) in enumerate(zip(masks, samples)) if m.shape != (s.response_length,)]
        if bad:
            raise ValueError(f"loss_mask of samples {bad[:5]} do not have one value per response token")
        sums, _ = self._accumulate(samples, list(range(len(samples))), {"loss_mask": masks}, None, False,
                                   objective="sft")
        return sums

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on ``samples`` (all of them one batch): the mean negative
        log-likelihood of the tokens their loss masks select (the response tokens; prompt positions never count),
        over the whole batch, in micro batches as ``train_step`` forms them (``trainer.micro_batch_size`` or
        ``trainer.max_tokens_per_micro_batch``). Live routing: there are no rollout routes to replay."""
        sums = self._sft_accumulate(samples)
        lr = optim.lr_at(self.optimizer_step, self.total_steps, self.cfg.trainer.lr, self.cfg.trainer.min_lr)
        self.optimizer.set_lr(lr)
        ok, norm = self.optimizer.step()
        self.optimizer_step += 1
        tokens = float(sums[5])
        return {"loss": float(sums[0]) / max(tokens, 1.0), "grad_norm": float(norm), "loss_tokens": tokens,
                "lr": lr, "skipped_steps": float(not ok), "step": float(self.optimizer_step)}

    def _main_grads(self) -> dict[str, torch.Tensor]:
        """The reduced gradient of every parameter that trains; a frozen one (``trainer.freeze_router``) has no
        ``main_grad`` buffer and is left out."""
        return {n: p.main_grad.detach().clone().cpu() for n, p in self.bare.named_parameters() if p.requires_grad}

    def sft_gradients(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """The reduced gradients (``main_grad`` per parameter name) and loss of one ``sft_step`` batch, without an
        optimizer step."""
        sums = self._sft_accumulate(samples)
        grads = self._main_grads()
        self.model.zero_grad_buffer()
        return {"grads": grads, "loss": float(sums[0]) / max(float(sums[5]), 1.0), "loss_tokens": float(sums[5])}

    # ------------------------------------------------------------------------------------------------ weights

    def weight_stream(self) -> export.HFBucketStream:
        """The weights as HF-named tensors in buckets of ``rollout.weight_sync.bucket_mb`` (what a weight sync
        sends). The plan is built once (collective); the stream reads the live parameters every time."""
        if self._weight_stream is None:
            bucket = int(self.cfg.rollout.weight_sync.bucket_mb * (1 << 20))
            self._weight_stream = export.HFBucketStream(self.bare, self.attention, bucket)
        return self._weight_stream

    def export_hf(self, out_dir: str | Path) -> Path:
        """Write the current weights as an HF checkpoint (safetensors + config + tokenizer): every rank writes its
        own tensors bucket by bucket, rank 0 the index. Collective."""
        return export.write_hf(self.weight_stream(), out_dir, self.source)

    def offload_optimizer_state(self) -> int:
        """Optimizer state to host memory (colocated engines generate meanwhile); bytes moved."""
        return offload.move_optimizer_state(self.optimizer, "cpu")

    def onload_optimizer_state(self) -> int:
        return offload.move_optimizer_state(self.optimizer, self.device)

    def yield_device(self) -> int:
        """Before colocated engines wake: the optimizer state to host (a no-op when it is there already) and the
        allocator's cached blocks released; the bytes this rank still reserves on its device."""
        offload.move_optimizer_state(self.optimizer, "cpu")
        return offload.release_cached_memory()

    def _sharded_state(self, *, optimizer: bool, is_loading: bool, optimizer_format: str) -> dict:
        """Model (and optimizer) as Megatron sharded tensors: each names this rank's shard of a global tensor, which
        is what lets a checkpoint load under another layout."""
        metadata = checkpoint.sharding_metadata(optimizer_format)
        state = {"model": self.bare.sharded_state_dict(metadata=metadata)}
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
                                     "freeze_router": self.cfg.trainer.freeze_router})

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

    def peak_device_memory(self) -> int | None:
        """The most device memory this rank's allocator held since it started (bytes; None without a GPU)."""
        return int(torch.cuda.max_memory_reserved(self.device)) if self.device.type == "cuda" else None

    def router_inventory(self) -> dict[str, Any]:
        """The routers this rank built (a pipeline stage holds its own): their 0-based decoder layers and weight
        dtype, with the params and router compute dtypes (``python -m r3rl.doctor``'s layer map and precision)."""
        weights = sorted({str(r.weight.dtype).removeprefix("torch.") for r in self.routers})
        return {"layers": [int(r.layer_number) - 1 for r in self.routers],
                "router_weight_dtype": ",".join(weights) or "none",
                "params_dtype": str(self.settings.dtype).removeprefix("torch."),
                "router_compute_dtype": self.settings.transformer.get("moe_router_dtype") or "params"}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.replay is not None:
            self.replay.clear()
        if self.routers:
            forget_instances(self.routers)
        if self._saves is not None and self._saves.get_num_unfinalized_calls():
            # shutdown goes rank by rank, and finalizing is collective: what was not finished stays a .partial
            self._saves.close(abort=True)
        self._saves = None
        checkpoint.close_writer()
        self.model = self.bare = self.ref_model = self.optimizer = self._weight_stream = None
        self.routers = []
        distributed.release()

    def __enter__(self) -> "MegatronTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
