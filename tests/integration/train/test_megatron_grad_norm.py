"""The tiny model's gradient stays in scale when the engine samples its padding token (the default run's step-3
grad norm of 4,189 came from that token's zero embedding row divided by sqrt(rms_norm_eps) in the first RMSNorm)."""

from __future__ import annotations

import numpy as np
import torch

from megatron_helpers import build_samples


def grad_norm(trainer, samples, advantages) -> float:
    grads = trainer.gradients(samples, advantages, replay=False)["grads"]
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def test_a_sampled_padding_token_does_not_blow_up_the_gradient(new_trainer):
    trainer = new_trainer()
    pad = 0  # <|endoftext|>, the tiny tokenizer's pad token
    samples = build_samples(4, seed=3, lengths=(8, 6))
    advantages = np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32)
    plain = grad_norm(trainer, samples, advantages)
    samples[1].response_ids = samples[1].response_ids.copy()
    samples[1].response_ids[2] = pad  # a response token, fed as input at the next position
    with_pad = grad_norm(trainer, samples, advantages)
    # one token of 24 changed: the norm stays of the same order (with a zero row it grew ~1000-fold)
    assert with_pad < 5 * plain, (with_pad, plain)
