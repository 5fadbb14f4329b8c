"""Megatron's distributed optimizer (the one GPU runs use) on a CPU: expert parallel 2 in two processes, a GRPO
step, a checkpoint save and load, micro batches packed by a token budget; the memory planner's estimate against the
bytes a trainer really holds; token-budget packing leaves log-probs and gradients unchanged."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from megatron_distopt_worker import held_bytes
from megatron_distopt_worker import run as run_ranks_inline
from megatron_helpers import build_samples, random_routes, with_routes
from test_megatron_expert_parallel import EP2, launch, stop
from r3rl.config import compose
from r3rl.memory import estimate
from r3rl.train.grpo import group_advantages

WORKER_NAME = "megatron_distopt_worker.py"
# micro batches packed by a 48-token budget (equal shapes across the two allgather ranks), compared with the single
# process's two samples per micro batch
BUDGET = ["trainer.max_tokens_per_micro_batch=48"]
# the checkpoint in Megatron's no-gather format (each rank's own buffers; the reshardable one has its own test)
DISTOPT = ["trainer.use_distributed_optimizer=true", "trainer.micro_batch_size=2", *BUDGET,
           "trainer.checkpoint.sharding=dp_reshardable"]
MEMORY_PARTS = ("weights", "gradients", "master weights", "optimizer state")


def estimated(overrides: list[str]) -> dict[str, int]:
    cfg = compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *overrides])
    plan = estimate(cfg, "float32", "bfloat16")
    trainer_gpu = plan.gpus[0]
    return {p.name: p.bytes for role, p in trainer_gpu.parts if role == "trainer" and p.name in MEMORY_PARTS}


def assert_within(measured: dict[str, int], expected: dict[str, int], tolerance: float = 0.15) -> None:
    for name in MEMORY_PARTS:
        got, want = measured[name], expected[name]
        if want == 0:
            assert got == 0, (name, got)
        else:
            assert abs(got - want) <= tolerance * want, (name, got, want)
    total_got, total_want = sum(measured.values()), sum(expected.values())
    assert abs(total_got - total_want) <= tolerance * total_want, (total_got, total_want)


@pytest.fixture(scope="module")
def batch():
    samples = build_samples(8, 37)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=37))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    return samples, adv


def test_expert_parallel_2_distributed_optimizer_checkpoint(batch, tmp_path, tiny_model_dir, torchrun_rendezvous):
    from pathlib import Path

    samples, adv = batch
    src, dst = tmp_path / "in.pkl", tmp_path / "out.pkl"
    src.write_bytes(pickle.dumps((samples, adv)))
    worker = Path(__file__).with_name(WORKER_NAME)
    procs = launch(2, [str(src), str(dst), str(tmp_path / "ckpt"), *DISTOPT, *EP2], tmp_path, torchrun_rendezvous(2),
                   worker=worker)
    try:
        # the same steps in one process with the CPU profile's own optimizer, while the two ranks run
        single = run_ranks_inline(samples, adv, str(tmp_path / "ckpt1"), ["trainer.micro_batch_size=2"])
        for p in procs:
            p.wait(timeout=400)
    finally:
        stop(procs)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert all(p.returncode == 0 for p in procs), logs
    ep = pickle.loads(dst.read_bytes())
    assert ep["world_size"] == 2 and ep["dp_size"] == 2 and ep["local_experts"] == 4
    # Megatron's optimizer, not the CPU compat AdamW: one distributed optimizer for dense and one for expert params
    assert ep["optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"], ep["optimizers"]
    assert single["optimizers"] == []
    # both optimizers take the same AdamW steps
    for key in ("first", "second"):
        for metric in ("loss", "grad_norm"):
            assert abs(ep[key][metric] - single[key][metric]) <= 1e-5 * max(1.0, abs(single[key][metric])), \
                (key, metric, ep[key][metric], single[key][metric])
    assert max(np.abs(a - b).max() for a, b in zip(ep["straight"], single["straight"])) < 1e-4
    # loading the checkpoint (sharded Adam moments gathered and scattered again) reproduces the second step exactly
    for result in (ep, single):
        for metric in ("loss", "grad_norm", "lr", "step"):
            assert result["again"][metric] == result["second"][metric], metric
        assert all(np.array_equal(a, b) for a, b in zip(result["resumed"], result["straight"]))
    # the planner's estimate of what an EP 2 rank holds (dense state sharded over 2, experts over 4 local ones)
    assert_within(ep["held"], estimated([*DISTOPT, *EP2]))
    print("\nmemory EP2 rank 0 (bytes) measured", ep["held"], "estimated", estimated([*DISTOPT, *EP2]))


def test_memory_estimate_matches_one_rank(new_trainer, batch):
    samples, adv = batch
    trainer = new_trainer("trainer.micro_batch_size=2")
    trainer.train_step(samples, adv, replay=True)
    measured = held_bytes(trainer)
    expected = estimated(["trainer.micro_batch_size=2"])
    print("\nmemory EP1 (bytes) measured", measured, "estimated", expected)
    assert measured["optimizer state"] > 0 and measured["master weights"] == 0
    assert_within(measured, expected)


def test_token_budget_packing_leaves_logprobs_and_gradients_unchanged(new_trainer, batch):
    samples, adv = batch
    # right-padded micro batches, the layout this budget's plan is for (packed rows: test_megatron_packing)
    by_count = new_trainer("trainer.micro_batch_size=2", "trainer.packing=false")
    by_tokens = new_trainer("trainer.micro_batch_size=2", "trainer.packing=false", *BUDGET)
    mbs = by_tokens._micro_batches(samples, list(range(len(samples))), 2, routes=None)
    longest = max(s.num_tokens - 1 for s in samples)
    # fewer, fuller micro batches, each padded to its own longest sample within the budget
    assert len(mbs) < 4 and all(mb.tokens.numel() <= 48 for mb, _ in mbs)
    assert any(mb.seq_len < longest for mb, _ in mbs)
    a = by_count.logprobs(samples, replay=True)
    b = by_tokens.logprobs(samples, replay=True)
    assert b.replayed_routes_match is True
    assert max(np.abs(x - y).max() for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    ga = by_count.gradients(samples, adv, replay=True, old_logprobs=a.logprobs)
    gb = by_tokens.gradients(samples, adv, replay=True, old_logprobs=a.logprobs)
    assert abs(ga["loss"] - gb["loss"]) < 1e-6
    for name, g in ga["grads"].items():
        assert torch.allclose(g, gb["grads"][name], atol=1e-6, rtol=1e-4), name
