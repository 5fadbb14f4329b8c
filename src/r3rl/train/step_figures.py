"""What a GRPO step logs, from its batch, its log-prob passes and its update (the definitions are in ``r3rl.metrics``).

The mismatch with and without replay is computed on the same batch. Routing flips need the engine's routes, so
they come from the unreplayed pass (the only pass under R2 and none). Each figure is logged only where the step
measured it: no unreplayed figures on a step without the paired pass, no paired delta without replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from r3rl import metrics as M
from r3rl.sample import Sample
from r3rl.train import staleness

if TYPE_CHECKING:  # the trainer's module (torch, Megatron): the driver only reads its results
    from r3rl.train.logprob_pass import LogprobResult


def step_figures(samples: Sequence[Sample], replayed: LogprobResult, unreplayed: LogprobResult | None,
                 train_out: Mapping[str, float], *, replay_mode: str, step: int, max_staleness: int, multi_turn: bool,
                 timings: Mapping[str, float], step_time_s: float,
                 merged: Sequence[Mapping[str, float]] = ()) -> dict[str, float]:
    """The step's mismatch figures; ``merged`` (the correction's, the rollout's) go in, in order, before the
    per-turn and per-version splits."""
    r3 = replay_mode == "r3"
    rollout_lps, masks = [s.rollout_logprobs for s in samples], [s.loss_mask for s in samples]
    live = unreplayed if r3 else (replayed if samples[0].routed_experts is not None else None)
    values = M.step_metrics(
        rollout_logprobs=rollout_lps,
        trainer_logprobs=replayed.logprobs,
        trainer_logprobs_no_replay=unreplayed.logprobs if unreplayed is not None else None,
        loss_masks=masks,
        rewards=[s.reward for s in samples],
        response_lengths=[s.response_length for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
        routing_flip_per_layer=live.flip_per_layer if live is not None else None,
        routing_flip_per_layer_prompt=live.flip_per_layer_prompt if live is not None else None,
        router_per_layer=(live.margin_per_layer, live.small_margin_per_layer, live.load_max_vio_per_layer)
        if live is not None and live.margin_per_layer is not None else None,
        sample_groups=[s.group for s in samples],
        replay_mismatch_rows=replayed.replay_mismatch_figure if r3 else None,
        loss=train_out.get("loss"),
        grad_norm=train_out.get("grad_norm"),
        timings_s=dict(timings),
        step_time_s=step_time_s,
    )
    if r3 and unreplayed is None:  # the paired pass skipped this step: its figures are not logged
        for key in (M.LOGPROB_ABS_DIFF_NO_REPLAY, M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR):
            values.pop(key)
    if not r3:  # one pass, no pairing: replayed and unreplayed are the same figures
        for key in (M.LOGPROB_ABS_DIFF_PAIRED_DELTA, M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR):
            values.pop(key, None)
    for figures in merged:
        values.update(figures)
    if multi_turn:  # the mismatch of each turn's tokens, with and without replay, same batch
        turns = [s.extra["turn_of_token"] for s in samples]
        values.update(M.per_turn_mismatch(replayed.logprobs, rollout_lps, masks, turns))
        if unreplayed is not None:
            values.update(M.per_turn_mismatch(unreplayed.logprobs, rollout_lps, masks, turns,
                                              M.LOGPROB_ABS_DIFF_NO_REPLAY_TURN))
    if max_staleness:  # the engine mismatch alone, on the samples the trainer's weights generated
        fresh = [i for i, s in enumerate(samples) if (s.weight_version or 0) == step - 1]
        if fresh:
            values[M.LOGPROB_ABS_DIFF_FRESH] = M.logprob_abs_diff(
                [replayed.logprobs[i] for i in fresh], [rollout_lps[i] for i in fresh], [masks[i] for i in fresh])
        values.update(staleness.version_token_mismatch(samples, step - 1, replayed, unreplayed))
    return values


def update_figures(train_out: Mapping[str, float], replay_mode: str) -> dict[str, float]:
    """What the trainer's update returned beyond its loss and gradient norm, under ``train/``; R2's replay check."""
    values = {f"train/{k}": float(v) for k, v in train_out.items()
              if k not in ("loss", "grad_norm", "step") and isinstance(v, (int, float))}
    if replay_mode == "r2":
        values[M.R2_REPLAY_MISMATCH_ROWS] = float(train_out["replay_mismatch_rows"])
        values[M.R2_REPLAYED_ROWS] = float(train_out["replayed_rows"])
    return values
