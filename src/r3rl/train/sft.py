"""SFT: the negative log-likelihood of the tokens the loss mask selects (the responses), as a token sum.

Like the GRPO loss it returns sums; the trainer divides by the loss tokens of the whole batch (all micro batches,
all data-parallel ranks), so the objective is the mean NLL per response token however the batch is split.
"""

from __future__ import annotations

import torch

from r3rl.train.grpo import LossTerms


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> LossTerms:
    """Sum over tokens where ``mask`` is set of ``-logprobs`` (``[B, S]`` each); positions outside the mask (the
    prompt, padding) contribute neither loss nor gradient."""
    mask = mask.to(logprobs.dtype)
    loss = -(logprobs * mask).sum()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return LossTerms(loss=loss, pg=loss.detach(), kl=zero, clipped=zero, ratio=zero, tokens=mask.sum())
