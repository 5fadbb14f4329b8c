"""Full activation recompute with REPLAY_BACKWARD: same gradients as without recompute, queue drained."""

from __future__ import annotations

import numpy as np
import torch

from megatron_helpers import build_samples, random_routes, with_routes


def test_recompute_with_replay_backward_gives_the_same_gradients(new_trainer):
    """Fails if the recomputed forward in backward routed live (the gradients would differ), left replay targets
    queued, or was counted by the route probe as a second forward (train/replayed_rows doubled)."""
    plain = new_trainer("trainer.micro_batch_size=2")
    recompute = new_trainer("trainer.micro_batch_size=2", "trainer.recompute_granularity=full")
    assert recompute.model.config.recompute_granularity == "full"
    samples = build_samples(8, 11)
    # routes unlike the model's own: a recompute that routed live instead of replaying would visibly differ
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=11))
    adv = np.linspace(-1.0, 1.0, len(samples))
    old = plain.logprobs(samples, replay=True).logprobs

    base = plain.gradients(samples, adv, replay=True, old_logprobs=old)
    again = recompute.gradients(samples, adv, replay=True, old_logprobs=old)
    assert base["grads"].keys() == again["grads"].keys()
    for name, grad in base["grads"].items():
        assert torch.equal(grad, again["grads"][name]), name
    assert any(float(g.abs().sum()) > 0 for n, g in base["grads"].items() if n.endswith("router.weight"))
    # every target queued by a forward was popped by its recomputed forward in backward, and nothing is left
    assert again["replay_backward_unconsumed"] == 0
    assert again["replay_queue_after"] == 0 and recompute.replay.pending() == 0

    # control: the same recompute without REPLAY_BACKWARD re-routes live in backward, and the gradients change
    driver = recompute.replay
    original = driver.after_forward
    driver.after_forward = lambda backward_follows: original(backward_follows=False)
    try:
        live_backward = recompute.gradients(samples, adv, replay=True, old_logprobs=old)
    finally:
        driver.after_forward = original
    assert any(not torch.equal(g, live_backward["grads"][n]) for n, g in base["grads"].items())
    assert recompute.replay.pending() == 0

    metrics = recompute.train_step(samples, adv, replay=True, old_logprobs=old)
    assert metrics["replay_backward_unconsumed"] == 0 and metrics["replay_queue_after_step"] == 0
    # the route probe counts each training forward once: the recompute in backward runs the routers again, and a
    # probe still armed then would count every row twice (train/replayed_rows doubled, issue 58)
    once = plain.train_step(samples, adv, replay=True, old_logprobs=old)
    assert metrics["replayed_rows"] == once["replayed_rows"] > 0 and metrics["replay_mismatch_rows"] == 0
