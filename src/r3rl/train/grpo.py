"""GRPO: group-normalised advantages and the clipped policy loss (token-level mean over the loss mask).

The loss functions return token *sums*; the trainer divides by the number of loss tokens of the whole global batch
(all micro batches, all data-parallel ranks), which makes the objective a token-level mean (DAPO-style) however the
batch is split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def group_advantages(rewards: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray,
                     normalize_std: bool, eps: float = 1e-6) -> np.ndarray:
    """Per-sample advantage: reward minus its group's mean, divided by the group's std when ``normalize_std``.

    A group whose rewards are all equal gets zero advantages (no signal, and no division by ~0).
    """
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and groups {g.shape} must be 1-D and of equal length")
    if not np.isfinite(r).all():
        raise ValueError(f"non-finite rewards at samples {np.flatnonzero(~np.isfinite(r)).tolist()}")
    out = np.zeros_like(r)
    for group in np.unique(g):
        members = g == group
        centred = r[members] - r[members].mean()
        if normalize_std:
            std = r[members].std(ddof=1) if members.sum() > 1 else 0.0
            centred = centred / (std + eps) if std > eps else np.zeros_like(centred)
        out[members] = centred
    return out.astype(np.float32)


def per_token_advantages(advantages: Sequence[np.ndarray | float] | np.ndarray,
                         response_lengths: Sequence[int]) -> list[np.ndarray]:
    """Scalar per sample (GRPO) or an array per response token -> one ``float32[R]`` per sample."""
    if len(advantages) != len(response_lengths):
        raise ValueError(f"{len(advantages)} advantages for {len(response_lengths)} samples")
    out = []
    for i, (a, n) in enumerate(zip(advantages, response_lengths)):
        a = np.asarray(a, dtype=np.float32)
        if a.ndim == 0:
            a = np.full(n, float(a), dtype=np.float32)
        if a.shape != (n,):
            raise ValueError(f"sample {i}: advantages of shape {a.shape} for {n} response tokens")
        out.append(a)
    return out


@dataclass
class LossTerms:
    """Token sums over one micro batch (loss tokens only)."""

    loss: torch.Tensor  # differentiable: sum of per-token losses
    pg: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor
    tokens: torch.Tensor


# GSPO's cap on a sequence's log-ratio before the exponential (verl's ``compute_policy_loss_gspo``)
MAX_SEQUENCE_LOG_RATIO = 10.0


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                       sequences: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """GSPO's per-token log-ratio (GSPO-token, arXiv 2507.18071 §4.3, as verl's ``loss_mode=gspo``): every token of a
    sequence carries the sequence's length-normalised log-ratio, mean over its loss tokens of log pi - log pi_old,
    as a constant, plus its own log-prob minus the same detached: the value is the sequence's, the gradient each
    token's. ``sequences`` says which sequence each position holds (any layout: right-padded rows or packed ones),
    as an id in ``[0, num_sequences)``: the size comes from the host, so nothing waits on the device."""
    ids = sequences.flatten().long()
    weighted = ((logprobs - old_logprobs) * mask).flatten().detach()
    count = torch.zeros(num_sequences, dtype=weighted.dtype, device=weighted.device)
    total = count.clone().scatter_add_(0, ids, weighted)
    count.scatter_add_(0, ids, mask.flatten().to(weighted.dtype))
    per_sequence = (total / count.clamp(min=1.0))[ids].view_as(logprobs)
    return torch.clamp(logprobs - logprobs.detach() + per_sequence, max=MAX_SEQUENCE_LOG_RATIO)


def sequence_mean_weights(masks: Sequence[np.ndarray], global_batch_size: int) -> list[np.ndarray]:
    """Per-token weights that turn the trainer's token mean into GSPO's sequence mean of token means (verl's
    ``seq-mean-token-mean``, the paper's 1/G sum_i 1/|y_i| sum_t): within each optimizer mini-batch of
    ``global_batch_size`` consecutive samples holding ``T`` loss tokens in ``S`` sequences that have any, a token of
    a sequence with ``n`` of them weighs ``T / (S n)``. The trainer then divides the weighted sum by ``T``, as for
    every loss. Host arithmetic on the masks every rank holds: no collective, no device sync."""
    out = []
    for start in range(0, len(masks), global_batch_size):
        chunk = [np.asarray(m, dtype=np.float64) for m in masks[start:start + global_batch_size]]
        counts = [float((m > 0).sum()) for m in chunk]
        total, sequences = sum(counts), sum(c > 0 for c in counts)
        out += [np.full(m.shape, total / (sequences * c) if c else 0.0, dtype=np.float32)
                for m, c in zip(chunk, counts)]
    return out


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, clip_low: float, clip_high: float, ref_logprobs: torch.Tensor | None = None,
                kl_coef: float = 0.0, is_weights: torch.Tensor | None = None,
                sequences: torch.Tensor | None = None, num_sequences: int = 0,
                loss_weights: torch.Tensor | None = None) -> LossTerms:
    """PPO-clip surrogate with asymmetric clipping (``1-clip_low``, ``1+clip_high``) plus an optional k3 KL to a
    reference policy, summed over tokens where ``mask`` is set.

    ``is_weights``: the rollout correction's per-token weights (``r3rl.train.correction``), constants multiplying
    each token's policy-gradient term (pi_old / pi_rollout, the gap PPO's ratio does not see).
    ``sequences`` (GSPO, ``algorithm.loss=gspo``): the sequence of each position, ids below ``num_sequences``; the
    ratio clipped is then the sequence's (``sequence_log_ratio``) rather than each token's. GSPO's mean over each
    sequence's tokens, then over sequences, comes from the trainer's per-token weights
    (``sequence_mean_weights``), passed as ``loss_weights``: they multiply each token's whole loss, the KL term with
    the policy term, so both are the same mean (verl aggregates its KL loss with the policy loss's
    ``loss_agg_mode``; a KL left a token mean would weigh long sequences more)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs if sequences is None else \
        sequence_log_ratio(logprobs, old_logprobs, mask, sequences, num_sequences)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    pg_token = per_token
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref): unbiased, non-negative, low variance
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    if loss_weights is not None:
        weights = loss_weights.detach().to(per_token.dtype)
        per_token, pg_token, kl = per_token * weights, pg_token * weights, kl * weights
    with torch.no_grad():
        was_clipped = (clipped > unclipped).to(mask.dtype)
    return LossTerms(
        loss=(per_token * mask).sum(),
        pg=(pg_token * mask).sum().detach(),
        kl=(kl * mask).sum().detach(),
        clipped=(was_clipped * mask).sum(),
        ratio=(ratio.detach() * mask).sum(),
        tokens=mask.sum(),
    )
