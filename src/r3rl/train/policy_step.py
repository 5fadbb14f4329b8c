"""The trainer's optimizer steps: the GRPO/GSPO policy step over one or more global batches (per-token inputs,
rollout-correction weights, the replay check of the training forwards, skipped steps), the step whose pi_old is its
own forward, the gradients alone (tests, the doctor), and the SFT step."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from r3rl.sample import Sample
from r3rl.train import collect, grpo, optim, sft
from r3rl.train.batch import MicroBatch
from r3rl.train.logprob_pass import LogprobPasses, LogprobResult
from r3rl.train.replay import RouteProbe


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


class PolicySteps(LogprobPasses):
    """Optimizer steps of ``MegatronTrainer`` (it mixes this in); also reads its ``optimizer``, ``optimizer_step``,
    ``total_steps``, ``settings`` and ``bare``."""

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
                                    num_sequences=len(samples), loss_weights=p.get("loss_weights"))

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
        if self.cfg.algorithm.loss == "gspo":  # GSPO averages per sequence, then over sequences: its KL term too
            per_token["loss_weights"] = grpo.sequence_mean_weights(per_token["loss_mask"],
                                                                   mini_batch or self.cfg.algorithm.global_batch_size)
        if len(samples) > self.cfg.algorithm.global_batch_size:  # the later mini-batches' drift is measured
            per_token["rollout_logprobs"] = [np.asarray(s.rollout_logprobs, dtype=np.float32) for s in samples]
            per_token["rollout_weight"] = [(m > 0) / max(float((m > 0).sum()), 1.0) for m in per_token["loss_mask"]]
        for name, values in (("loss_mask", per_token["loss_mask"]), ("is_weights", per_token.get("is_weights")),
                             ("loss_weights", per_token.get("loss_weights"))):
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
        num_layers = self.cfg.model.num_moe_layers
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
        probe = RouteProbe(self.routers, self.cfg.model.num_moe_layers, self.layout, routes,
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
