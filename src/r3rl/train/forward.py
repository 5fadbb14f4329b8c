"""The trainer's forward passes: its micro batches (real and padding slots, packed or padded rows, by count or
token budget), one forward with replay armed, the no-grad pass over a whole batch with the route probe, Megatron's
pipeline schedule, and the sums over the ranks that split a batch's rows. ``MegatronTrainer`` mixes it in; the
log-prob passes (``r3rl.train.logprob_pass``) and the policy steps (``r3rl.train.policy_step``) build on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from r3rl.sample import Sample
from r3rl.train import collect, hardware
from r3rl.train.batch import MicroBatch, build_micro_batch, plan_micro_batches, plan_packed_micro_batches, \
    plan_token_micro_batches
from r3rl.train.replay import DriftReference, ProbeCounts, RouteProbe
from r3rl.train.routes import check_routes


class ForwardPasses:
    """Reads the trainer's ``cfg``, ``info``, ``layout``, ``device``, ``route_shape``, ``packing``, ``pipelined``,
    ``equal_shapes``, ``uniform_length``, ``replay``, ``model``, ``soft_ratio``, ``engine_unit_roundoff`` and
    ``_ps`` (Megatron's parallel state), all set by ``MegatronTrainer._build``."""

    def _validated_routes(self, samples: Sequence[Sample], required: bool) -> list[np.ndarray] | None:
        if not required and any(s.routed_experts is None for s in samples):
            return None
        m = self.cfg.model
        return [check_routes(s.routed_experts, sample=i, num_tokens=s.num_tokens, num_layers=m.num_moe_layers,
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

    def _forward(self, model, mb: MicroBatch, *, replay: bool, backward_follows: bool) -> torch.Tensor:
        """Token log-probs ``[B, S_local]`` of ``mb.labels`` (last pipeline stage) or the stage's activations."""
        from megatron.core import tensor_parallel

        if replay:
            self.replay.arm(mb.routes, self.device)
        try:
            if mb.packed:
                output = model(mb.tokens, mb.position_ids, None, packed_seq_params=self._packed_seq_params(mb))
            else:
                output = model(mb.tokens, mb.position_ids, hardware.attention_mask(mb.tokens.shape[1], self.device))
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
                      driver_routers: list | None = None, recorded: dict | None = None,
                      drift_reference: DriftReference | None = None
                      ) -> tuple[dict[int, np.ndarray], RouteProbe | None]:
        """No-grad pass over all samples; returns this rank's response log-probs by sample index and the route probe
        (its counts and, under ``debug.route_trace`` with replay, its digests: this rank's part of each).
        ``drift_reference``: the doctor's drift pass (``LogprobPasses.rounding_drift``) keeps or reads its rows.

        ``recorded``: a dict that receives, per sample index, this rank's recorded top-k rows per layer (the
        routers route themselves under Megatron's RECORD; never with ``replay``)."""
        if recorded is not None and (replay or self.pipelined):
            raise RuntimeError("routes are recorded in an unreplayed, unpipelined pass only")
        indices = list(range(len(samples)))
        routes = probe_routes
        mbs = self._micro_batches(samples, indices, self.cfg.trainer.micro_batch_size, routes=routes)
        results: dict[int, np.ndarray] = {}
        probe = RouteProbe(driver_routers, self.cfg.model.num_moe_layers, self.layout, routes,
                           [s.loss_mask for s in samples], trace=replay and self.cfg.debug.route_trace,
                           soft_ratio=self.soft_ratio, unit_roundoff=self.engine_unit_roundoff,
                           drift_reference=drift_reference) if (driver_routers and routes is not None) else None
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
                                       self.cfg.model.num_moe_layers, self.cfg.model.num_experts)

    def _reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Loss-token statistics: summed over data/context parallel on the last stage, shared with every stage."""
        t = values.to(self.device, torch.float64)
        t = collect.sum_over(t, [self._ps.get_data_parallel_group(with_context_parallel=True)])
        return collect.share_from_last_stage(t, self.pipelined).cpu()
