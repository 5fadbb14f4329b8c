"""Expert parallel 2 in two real processes (gloo on 127.0.0.1) against the same run in one process."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import json

import numpy as np
from safetensors.torch import load_file

from megatron_ep_worker import run
from megatron_helpers import build_samples, random_routes, with_routes
from r3rl.train.grpo import group_advantages

WORKER = Path(__file__).with_name("megatron_ep_worker.py")
EP2 = ["parallelism.gpus_per_node=3", "parallelism.trainer.num_gpus=2", "parallelism.trainer.expert_parallel=2"]


def launch(world_size: int, args: list[str], tmp: Path, rendezvous: dict[str, str],
           worker: Path = WORKER) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world_size):
        env = {**os.environ, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "OMP_NUM_THREADS": "1"}
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(worker), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def finish(procs: list[subprocess.Popen], tmp: Path, timeout: float, log_tail: int = 2000) -> None:
    """Wait for the ranks (killed past ``timeout``); a rank that failed fails the test with every rank's log tail."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        stop(procs)
    logs = "\n".join((tmp / f"rank{r}.log").read_text()[-log_tail:] for r in range(len(procs)))
    assert all(p.returncode == 0 for p in procs), logs


def ep2_against_one_process(tmp_path: Path, rendezvous: dict[str, str], common: list[str]) -> tuple[dict, dict]:
    """One batch through ``megatron_ep_worker.run`` on expert parallel 2 (two processes) and in this process, with
    the same ``common`` overrides: (EP 2's rank-0 result, the single process's); with LoRA, each exports its
    adapters after the step."""
    samples = build_samples(8, 31)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=31))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    src, dst = tmp_path / "in.pkl", tmp_path / "out.pkl"
    src.write_bytes(pickle.dumps((samples, adv)))
    procs = launch(2, [str(src), str(dst), *common, *EP2], tmp_path, rendezvous)
    try:
        # the single-process reference runs here while the two ranks run in parallel
        single = run(samples, adv, common, adapter_dir=str(tmp_path / "adapter_single"))
        for p in procs:
            p.wait(timeout=300)
    finally:
        stop(procs)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2))
    assert all(p.returncode == 0 for p in procs), logs
    return pickle.loads(dst.read_bytes()), single


def test_expert_parallel_2_matches_one_process(tmp_path, tiny_model_dir, torchrun_rendezvous):
    ep, single = ep2_against_one_process(tmp_path, torchrun_rendezvous(2), ["trainer.micro_batch_size=2"])
    assert ep["world_size"] == 2 and ep["dp_size"] == 2 and ep["local_experts"] == 4
    assert single["world_size"] == 1 and single["local_experts"] == 8
    assert ep["match"] is True and single["match"] is True
    for key in ("replayed", "live", "after"):
        diff = max(np.abs(a - b).max() for a, b in zip(ep[key], single[key]))
        assert diff < 1e-5, (key, diff)
    assert np.allclose(ep["flips"], single["flips"], atol=0)
    # the routing recorded across both ranks is the single process's routing
    assert all(a.dtype == np.uint8 and a.shape == b.shape for a, b in zip(ep["recorded"], single["recorded"]))
    same = np.mean([np.array_equal(np.sort(x, -1), np.sort(y, -1))
                    for a, b in zip(ep["recorded"], single["recorded"]) for x, y in zip(a.reshape(-1, 2),
                                                                                       b.reshape(-1, 2))])
    assert same > 0.995, same
    for key in ("loss", "pg_loss", "clip_frac", "loss_tokens"):
        assert abs(ep["metrics"][key] - single["metrics"][key]) <= 1e-6 * max(1.0, abs(single["metrics"][key])), key
    assert abs(ep["metrics"]["grad_norm"] - single["metrics"]["grad_norm"]) <= 1e-5 * single["metrics"]["grad_norm"]


def test_expert_parallel_2_streams_buckets_and_no_rank_gathers_the_model(tmp_path, tiny_model_dir,
                                                                         torchrun_rendezvous):
    """Export and sync on EP 2: every rank writes its own experts; the gathered stream (the GPU wires' sender) gets
    each bucket whole with the next one already on its way (the owners' sends of bucket k+1 in flight while bucket k
    is handed out: fails if the gather went back to one bucket at a time); the bytes each rank holds at peak stay
    within one bucket for the export and two for the gathered stream (plus the largest tensor), far below the
    model."""
    procs = launch(2, ["export", str(tmp_path), "rollout.weight_sync.bucket_mb=0.25", *EP2], tmp_path,
                   torchrun_rendezvous(2))
    finish(procs, tmp_path, timeout=300)
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    source = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        source.update(load_file(str(f)))
    total = ranks[0]["total"]
    assert total == sum(t.numel() * t.element_size() for t in source.values())
    assert ranks[0]["buckets"] > 4
    for r in ranks:
        limit = r["bucket_bytes"] + r["largest_item"]
        # the old export gathered everything on rank 0 (peak >= total); here no rank comes near it
        assert 0 < r["export_peak"] <= limit and r["sync_peak"] <= 2 * limit, (r["rank"], r["export_peak"], limit)
        assert r["export_peak"] < total / 4 and r["sync_peak"] < total / 4
        assert r["metadata"] == ranks[0]["metadata"]  # one plan on every rank
    # export: each rank wrote its own files (rank 1 holds experts 4-7), one index maps every tensor
    out = tmp_path / "hf"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map.keys() == source.keys()
    assert {f.split("-bucket")[0] for f in weight_map.values()} == {"model-rank00000", "model-rank00001"}
    assert all("rank00001" in weight_map[f"model.layers.{l}.mlp.experts.{e}.down_proj.weight"]
               for l in range(4) for e in range(4, 8))
    exported = {}
    for f in sorted(set(weight_map.values())):
        exported.update(load_file(str(out / f)))
    assert exported.keys() == source.keys()
    assert all(bool((exported[k] == v).all()) for k, v in source.items())
    assert (out / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    # sync: rank 0 received the whole model bucket by bucket, exactly; rank 1 kept nothing
    assert ranks[0]["received"].keys() == source.keys() and not ranks[1]["received"]
    assert all(bool((ranks[0]["received"][k] == v).all()) for k, v in source.items())
    assert max(ranks[0]["bucket_sizes"]) <= ranks[0]["bucket_bytes"] + ranks[0]["largest_item"]
    # while the caller held a bucket, the next one was already arriving
    assert ranks[0]["sync_peak"] > max(ranks[0]["bucket_sizes"])
