"""The engine's preemption counter (``r3rl.rollout.engine_metrics``), read from the shared real R3 server while its
KV cache runs short."""

from __future__ import annotations

import numpy as np
import pytest

from r3rl.config.schema import SamplingConfig
from r3rl.rollout.engine_metrics import PREEMPTIONS, read_counter

pytestmark = pytest.mark.integration


def test_a_kv_cache_too_small_for_the_sequences_in_flight_preempts_and_the_counter_says_so(
        r3_engine, r3_client_factory):
    """The shared engine holds 64 MiB of float32 KV cache, 256 blocks of 128 tokens of the tiny model (2 KiB a
    token). 128 requests that must run 300 tokens each (``min_tokens``) need 3 blocks each, 384 at once: vLLM
    preempts some
    and recomputes them, and ``vllm:num_preemptions_total`` counts them; 8 short requests preempt nothing. Fails if
    the reader missed the counter (0 whatever happened: the recipe's ``rollout/preemptions`` would always read 0)
    or counted samples of another metric."""
    url = r3_engine.url
    client = r3_client_factory(max_concurrency=128)
    prompts = [np.random.default_rng(i).integers(10, 1000, size=12).tolist() for i in range(128)]
    before = read_counter([url], PREEMPTIONS)
    client.generate_sync(prompts[:8], 1, SamplingConfig(temperature=1.0, max_tokens=8, seed=3), step=0)
    assert read_counter([url], PREEMPTIONS) == before
    long = SamplingConfig(temperature=1.0, max_tokens=320, min_tokens=300, seed=4)
    samples = client.generate_sync(prompts, 1, long, step=1)
    assert all(s.response_length >= 300 for s in samples)
    assert read_counter([url], PREEMPTIONS) > before
