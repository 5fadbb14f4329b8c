"""What the trainer benches share: a batch of random token samples of one length, half prompt, half response."""

from __future__ import annotations

import numpy as np

from r3rl.sample import Sample, SampleStatus


def random_samples(n: int, tokens: int, vocab_size: int, rng: np.random.Generator) -> list[Sample]:
    """``n`` samples of ``tokens`` random tokens each, one group, every response token trained on."""
    prompt, response = tokens // 2, tokens - tokens // 2
    return [Sample(index=i, group=0, request_id=str(i),
                   prompt_ids=rng.integers(3, vocab_size, prompt).astype(np.int32),
                   response_ids=rng.integers(3, vocab_size, response).astype(np.int32),
                   rollout_logprobs=np.zeros(response, np.float32), loss_mask=np.ones(response, np.float32),
                   finish_reason="length", status=SampleStatus.TRUNCATED) for i in range(n)]
