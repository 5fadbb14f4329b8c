"""Weight updates on the shared real R3 server: after an update the engine serves the new weights exactly
(transformers on the new checkpoint agrees on routes and log-probs), and updating back restores the engine's
weights bit for bit (vLLM's ``/weight_checker``), which vLLM's own CPU reload does not."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_helpers import HFReference, perturbed_checkpoint
from r3rl.config.schema import SamplingConfig
from r3rl.rollout.wire import foreign_weight_labels
from r3rl.sync.disk import update_weights_from_hf, weight_checksums, weight_version

pytestmark = pytest.mark.integration

PROMPTS = [np.random.default_rng(1).integers(10, 1000, size=n).tolist() for n in (6, 11, 23)]


def test_update_serves_new_weights_and_restores_old_ones_exactly(r3_engine, r3_client_factory, hf_reference,
                                                                 tiny_model_dir, tmp_path):
    url = r3_engine.url
    client = r3_client_factory()
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=10, seed=21)
    before = weight_checksums(url)
    old = client.generate_sync(PROMPTS, 2, sampling, step=0)
    new_dir = perturbed_checkpoint(tiny_model_dir, tmp_path / "step1")
    new_hf = HFReference(new_dir)
    try:
        result = update_weights_from_hf(url, new_dir, version=1)
        assert result.workers and result.workers[0]["moe_layers_reprocessed"] == 4
        after = weight_checksums(url)
        changed = {k.split(":")[-1] for k in before if before[k] != after[k]}
        # the packed expert weights are what vLLM's CPU reload corrupts: they must hold the new values now
        assert {f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in range(4) for w in ("w13_weight",
                "w2_weight")} <= changed
        assert weight_version(url) == "1"
        # what a fresh run attached to this engine now finds: weights another run labelled (it sends its own first)
        assert foreign_weight_labels({url: weight_version(url)}) == {url: "1"}
        new = client.generate_sync(PROMPTS, 2, sampling, step=0)
        for sample in new:
            assert sample.weight_version == 1
            diff, agree = new_hf.check_sample(sample)
            assert agree == 1.0 and diff < 1e-4, f"sample {sample.index}: agree {agree:.1%}, diff {diff:.2e}"
        # the same seeds under the old weights: another policy (log-probs of the new tokens under the old model)
        old_diffs = [hf_reference.check_sample(s)[0] for s in new]
        assert max(old_diffs) > 1e-2
        assert any(not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(old, new))
    finally:
        update_weights_from_hf(url, tiny_model_dir, version=2)
    assert weight_checksums(url) == before
    restored = client.generate_sync(PROMPTS, 2, sampling, step=0)
    for a, b in zip(old, restored):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-6)
