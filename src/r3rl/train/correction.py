"""Rollout correction: importance-sampling weights and rejection masks for the gap between the engine that sampled
the tokens (pi_rollout) and the trainer's pi_old, per token.

The ratio is ``pi_old / pi_rollout = exp(trainer - rollout)`` on each response token, with the trainer's log-probs
the recipe's mismatch metrics use (the rollout's routes replayed under R3, the trainer's recorded ones under R2).
Every option returns one ``float32`` weight per token (multiplying that token's policy-gradient term, never
differentiated) and a loss mask. A rejected token's weight is exactly 0. ``rejected_tokens`` says what happens to
the tokens an option rejects (IcePop's, seq_mask_tis's):

- ``zero_weight`` (the default, the published behaviour: NeMo-RL's loss, slime, the IcePop paper): they stay in
  the loss mask, so in the token count the loss is divided by, and contribute nothing;
- ``drop_from_count``: they also leave the loss mask, so the survivors' tokens weigh more (verl's rollout_rs).

The options:

- ``none``: weights 1, nothing rejected (the metrics still show what a correction would do).
- ``tis``: truncated IS, weights ``min(ratio, ratio_high)`` (Yao et al.'s TIS; verl's ``rollout_is=token``).
- ``icepop``: tokens whose ratio is outside ``[ratio_low, ratio_high]`` are rejected, the others weighted by their
  ratio (IcePop; NeMo-RL's ``truncated_importance_sampling_type=icepop``).
- ``seq_mask_tis``: sequences whose geometric-mean ratio ``exp(mean(trainer - rollout))`` is outside
  ``[seq_ratio_low, seq_ratio_high]`` are rejected whole, the tokens of the others weighted by their (untruncated)
  ratio (NeMo-RL's ``seq-mask-tis``).
- the gate ``seq_error_threshold`` (any option): sequences whose multiplicative probability error, the masked mean
  of ``exp(|trainer - rollout|)`` within the sequence, exceeds it are rejected whole (NeMo-RL's
  ``seq_logprob_error_threshold``, ``token_mult_prob_error`` per sequence). As in NeMo-RL (it clears the
  sequence's sample mask) a gated sequence leaves the token count whatever ``rejected_tokens`` says.

Pure numpy over one array per sample; the metrics live in ``r3rl.metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from r3rl import metrics as M
from r3rl.config.modes import CORRECTION_NAMES as KINDS
from r3rl.config.modes import REJECTED_TOKENS

# exp() of a log-ratio beyond this overflows or vanishes in float32 (verl's safety bound, ~[2e-9, 5e8])
LOG_RATIO_BOUND = M.SAFETY_BOUND


@dataclass(frozen=True)
class Correction:
    """The settings of ``correction`` (one ``CorrectionConfig``), as plain values."""

    kind: str = "none"
    ratio_low: float = 0.5
    ratio_high: float = 2.0
    seq_ratio_low: float = 0.999
    seq_ratio_high: float = 1.002
    seq_error_threshold: float | None = None
    rejected_tokens: str = "zero_weight"

    @classmethod
    def of(cls, cfg) -> "Correction":
        return cls(cfg.name, cfg.ratio_low, cfg.ratio_high, cfg.seq_ratio_low, cfg.seq_ratio_high,
                   cfg.seq_error_threshold, cfg.rejected_tokens)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"correction.name: must be one of {KINDS}, got {self.kind!r}")
        if self.rejected_tokens not in REJECTED_TOKENS:
            raise ValueError(f"correction.rejected_tokens: must be one of {REJECTED_TOKENS}, "
                             f"got {self.rejected_tokens!r}")

    @property
    def changes_training(self) -> bool:
        """Whether the loss gets weights or masks (``none`` without the gate only logs what a correction would do)."""
        return self.kind != "none" or self.seq_error_threshold is not None


@dataclass
class Corrected:
    weights: list[np.ndarray]  # float32 [R] per sample: multiplies each token's policy-gradient term (0: rejected)
    loss_masks: list[np.ndarray]  # float32 [R] per sample: the tokens the loss counts (see ``rejected_tokens``)
    metrics: dict[str, float]
    kept: list[np.ndarray] | None = None  # float32 [R] per sample: 1 where a valid token was not rejected


def log_ratios(trainer_lps: Sequence[np.ndarray], rollout_lps: Sequence[np.ndarray]) -> list[np.ndarray]:
    """log(pi_old / pi_rollout) per token, bounded to +-LOG_RATIO_BOUND."""
    return [np.clip(np.asarray(t, np.float64) - np.asarray(r, np.float64), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            for t, r in zip(trainer_lps, rollout_lps)]


def _seq_mean(values: np.ndarray, mask: np.ndarray) -> float:
    n = mask.sum()
    return float((values * mask).sum() / n) if n > 0 else 0.0


def correct(c: Correction, trainer_lps: Sequence[np.ndarray], rollout_lps: Sequence[np.ndarray],
            loss_masks: Sequence[np.ndarray]) -> Corrected:
    """Weights, masks and every ``rollout_corr/`` metric of one step's samples under correction ``c``."""
    if not len(trainer_lps) == len(rollout_lps) == len(loss_masks):
        raise ValueError(f"sample counts differ: trainer {len(trainer_lps)}, rollout {len(rollout_lps)}, "
                         f"masks {len(loss_masks)}")
    masks = [np.asarray(m, np.float64) for m in loss_masks]
    for i, (t, r, m) in enumerate(zip(trainer_lps, rollout_lps, masks)):
        if not np.shape(t) == np.shape(r) == m.shape:
            raise ValueError(f"sample {i}: token counts differ: trainer {np.shape(t)}, rollout {np.shape(r)}, "
                             f"mask {m.shape}")
    logr = log_ratios(trainer_lps, rollout_lps)
    ratios = [np.exp(d) for d in logr]
    seq_geo = np.asarray([np.exp(_seq_mean(d, m)) for d, m in zip(logr, masks)])
    # NeMo-RL's seq_mult_prob_error: mean(exp|d|) per sequence, NaN without a valid token (never gated)
    seq_error = M.seq_mult_prob_error(trainer_lps, rollout_lps, masks)

    option_keep = [np.ones_like(m) for m in masks]
    if c.kind == "none":
        weights = [np.ones_like(r) for r in ratios]
    elif c.kind == "tis":
        weights = [np.minimum(r, c.ratio_high) for r in ratios]
    elif c.kind == "icepop":
        weights = [r.copy() for r in ratios]
        option_keep = [((r >= c.ratio_low) & (r <= c.ratio_high)).astype(np.float64) for r in ratios]
    else:  # seq_mask_tis
        weights = [r.copy() for r in ratios]
        option_keep = [np.full_like(m, float(c.seq_ratio_low <= g <= c.seq_ratio_high))
                       for m, g in zip(masks, seq_geo)]
    gate_keep = [np.ones_like(m) for m in masks]
    if c.seq_error_threshold is not None:
        gate_keep = [np.full_like(m, float(not e > c.seq_error_threshold)) for m, e in zip(masks, seq_error)]
    keep = [o * g for o, g in zip(option_keep, gate_keep)]
    # a rejected token's weight is exactly 0 (never a raw ratio left behind a mask: inf x 0 = NaN)
    weights = [np.where(k > 0, w, 0.0) for w, k in zip(weights, keep)]
    if c.rejected_tokens == "drop_from_count":
        new_masks = [m * k for m, k in zip(masks, keep)]
    else:  # zero_weight: only the gate (NeMo-RL's sample mask) takes tokens out of the count
        new_masks = [m * g for m, g in zip(masks, gate_keep)]
    kept = [m * k for m, k in zip(masks, keep)]
    # NeMo-RL's mask for its loss figures: token_mask * sample_mask, the sample mask cleared by the gate
    gated = [m * g for m, g in zip(masks, gate_keep)]

    metrics = M.is_metrics(trainer_lps, rollout_lps, masks, c.ratio_high)
    metrics.update(M.rs_metrics(masks, kept))
    metrics.update(M.offpolicy_metrics(trainer_lps, rollout_lps, masks))
    metrics[M.TOKEN_MULT_PROB_ERROR] = M.token_mult_prob_error(trainer_lps, rollout_lps, gated)
    metrics[M.EXTREME_TOKEN_FRACTION] = M.extreme_token_fraction(trainer_lps, rollout_lps, masks)
    metrics[M.CORRECTION_KEPT_TOKENS] = float(sum(float(m.sum()) for m in new_masks))
    valid = np.asarray([m.sum() > 0 for m in masks], dtype=bool)
    finite = seq_error[valid]
    metrics[M.MEAN_SEQ_MULT_PROB_ERROR] = float(finite.mean()) if finite.size else float("nan")
    metrics[M.MAX_SEQ_MULT_PROB_ERROR] = float(finite.max()) if finite.size else float("nan")
    # NeMo-RL's is_oob_ratio, for the options NeMo-RL has, over the tokens (sequences) its gate left: tokens outside
    # the truncation bounds (tis: above ratio_high, r3rl's tis has no lower clamp; icepop: outside
    # [ratio_low, ratio_high]) or sequences (seq_mask_tis)
    if c.kind == "tis":
        metrics[M.IS_OOB_RATIO] = M.token_masked_mean([(r > c.ratio_high).astype(np.float64) for r in ratios], gated)
    elif c.kind == "icepop":
        metrics[M.IS_OOB_RATIO] = M.token_masked_mean([1.0 - k for k in option_keep], gated)
    elif c.kind == "seq_mask_tis":
        out = np.asarray([not (c.seq_ratio_low <= g <= c.seq_ratio_high) for g in seq_geo])
        left = np.asarray([m.sum() > 0 for m in gated], dtype=bool)
        metrics[M.IS_OOB_RATIO] = float(out[left].mean()) if left.any() else float("nan")
    if c.seq_error_threshold is not None:
        gated = valid & (seq_error > c.seq_error_threshold)
        metrics[M.SEQ_ERROR_GATED_FRACTION] = float(gated.sum() / valid.sum()) if valid.any() else float("nan")
    return Corrected([w.astype(np.float32) for w in weights], [m.astype(np.float32) for m in new_masks], metrics,
                     [k.astype(np.float32) for k in kept])
