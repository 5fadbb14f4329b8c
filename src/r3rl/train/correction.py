"""Rollout correction: importance-sampling weights and rejection masks for the gap between the engine that sampled
the tokens (pi_rollout) and the trainer's pi_old, per token.

The ratio is ``pi_old / pi_rollout = exp(trainer - rollout)`` on each response token, with the trainer's log-probs
the recipe's mismatch metrics use (the rollout's routes replayed under R3, the trainer's recorded ones under R2).
Every option returns one ``float32`` weight per token (multiplying that token's policy-gradient term, never
differentiated) and a loss mask (the sample's mask with the rejected tokens cleared, so they also leave the token
count the loss is divided by, as in verl and NeMo-RL):

- ``none``: weights 1, nothing rejected (the metrics still show what a correction would do).
- ``tis``: truncated IS, weights ``min(ratio, ratio_high)`` (Yao et al.'s TIS; verl's ``rollout_is=token``).
- ``icepop``: tokens whose ratio is outside ``[ratio_low, ratio_high]`` are rejected, the others weighted by their
  ratio (IcePop; NeMo-RL's ``truncated_importance_sampling_type=icepop``).
- ``seq_mask_tis``: sequences whose geometric-mean ratio ``exp(mean(trainer - rollout))`` is outside
  ``[seq_ratio_low, seq_ratio_high]`` are rejected whole, the tokens of the others weighted by their (untruncated)
  ratio (NeMo-RL's ``seq-mask-tis``).
- the gate ``seq_error_threshold`` (any option): sequences whose multiplicative probability error
  ``exp(mean(|trainer - rollout|))`` exceeds it are rejected whole (NeMo-RL's ``seq_logprob_error_threshold``).

Pure numpy over one array per sample; the metrics live in ``r3rl.metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from r3rl import metrics as M
from r3rl.config.modes import CORRECTION_NAMES as KINDS

# exp() of a log-ratio beyond this overflows or vanishes in float32 (verl's safety bound, ~[2e-9, 5e8])
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    """The settings of ``correction`` (one ``CorrectionConfig``), as plain values."""

    kind: str = "none"
    ratio_low: float = 0.5
    ratio_high: float = 2.0
    seq_ratio_low: float = 0.999
    seq_ratio_high: float = 1.002
    seq_error_threshold: float | None = None

    @classmethod
    def of(cls, cfg) -> "Correction":
        return cls(cfg.name, cfg.ratio_low, cfg.ratio_high, cfg.seq_ratio_low, cfg.seq_ratio_high,
                   cfg.seq_error_threshold)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"correction.name: must be one of {KINDS}, got {self.kind!r}")

    @property
    def changes_training(self) -> bool:
        """Whether the loss gets weights or masks (``none`` without the gate only logs what a correction would do)."""
        return self.kind != "none" or self.seq_error_threshold is not None


@dataclass
class Corrected:
    weights: list[np.ndarray]  # float32 [R] per sample: multiplies each token's policy-gradient term
    loss_masks: list[np.ndarray]  # float32 [R] per sample: the loss mask with rejected tokens cleared
    metrics: dict[str, float]


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
    seq_error = np.asarray([np.exp(_seq_mean(np.abs(d), m)) for d, m in zip(logr, masks)])

    keep = [np.ones_like(m) for m in masks]
    if c.kind == "none":
        weights = [np.ones_like(r) for r in ratios]
    elif c.kind == "tis":
        weights = [np.minimum(r, c.ratio_high) for r in ratios]
    elif c.kind == "icepop":
        weights = [r.copy() for r in ratios]
        keep = [((r >= c.ratio_low) & (r <= c.ratio_high)).astype(np.float64) for r in ratios]
    else:  # seq_mask_tis
        weights = [r.copy() for r in ratios]
        keep = [np.full_like(m, float(c.seq_ratio_low <= g <= c.seq_ratio_high)) for m, g in zip(masks, seq_geo)]
    if c.seq_error_threshold is not None:
        keep = [k * float(e <= c.seq_error_threshold) for k, e in zip(keep, seq_error)]
    new_masks = [m * k for m, k in zip(masks, keep)]

    # the weights an IS correction would apply: the option's own, the plain ratio where it applies none
    applied = ratios if c.kind == "none" else weights
    if c.kind == "seq_mask_tis":
        high, low = M.fraction_outside_seq(seq_geo, masks, c.seq_ratio_low, c.seq_ratio_high)
    else:
        high, low = M.fraction_outside(ratios, masks, c.ratio_low, c.ratio_high)
    metrics = {
        M.ROLLOUT_IS_MEAN: M.token_masked_mean(applied, masks),
        M.ROLLOUT_IS_ESS: M.eff_sample_size(applied, masks),
        M.ROLLOUT_IS_FRACTION_HIGH: high,
        M.ROLLOUT_IS_FRACTION_LOW: low,
        M.ROLLOUT_RS_MASKED_FRACTION: M.masked_fraction(masks, new_masks),
        M.LOG_PPL_ABS_DIFF: M.log_ppl_abs_diff(trainer_lps, rollout_lps, masks),
        M.ROLLOUT_CORR_K3_KL: M.k3_kl(trainer_lps, rollout_lps, masks),
        M.EXTREME_TOKEN_FRACTION: M.extreme_token_fraction(trainer_lps, rollout_lps, masks),
    }
    if c.seq_error_threshold is not None:
        valid = np.asarray([m.sum() > 0 for m in masks])
        gated = (seq_error > c.seq_error_threshold) & valid
        metrics[M.SEQ_ERROR_GATED_FRACTION] = float(gated.sum() / valid.sum()) if valid.any() else float("nan")
    return Corrected([w.astype(np.float32) for w in weights], [m.astype(np.float32) for m in new_masks], metrics)
