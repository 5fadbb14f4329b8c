"""The memory plan: bytes per GPU and role from the config alone, checked against the 80 GiB budget."""

from __future__ import annotations

import subprocess
import sys

import pytest

from r3rl.config import CONF_DIR, ConfigError, compose
from r3rl.memory import GIB, estimate, param_counts, table
from r3rl.plan import build_plan

REPO = CONF_DIR.parent

EXPERIMENTS = ("qwen3_30b_r3_4p4", "qwen3_30b_r3_colocated")


def parts(gpu) -> dict[str, float]:
    return {f"{role}/{p.name}": p.bytes / GIB for role, p in gpu.parts}


def test_30b_parameters_split_as_megatron_shards_them():
    counts = param_counts(compose(["model=qwen3_30b", "parallelism=disaggregated_4p4"]).model)
    total = 48 * (counts.dense_per_layer + counts.experts_per_layer) + counts.embeddings
    assert 30.0e9 < total < 31.0e9  # Qwen3-30B-A3B: 30.5B
    assert counts.experts_per_layer / (counts.dense_per_layer + counts.experts_per_layer) > 0.95


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_shipped_30b_experiments_fit_80_gib(experiment):
    cfg = compose([f"experiment={experiment}"])
    plan = build_plan(cfg).memory
    assert plan.budget_bytes == 80 * GIB and plan.over_budget() == []
    trainer_gpu = plan.gpus[0]
    p = parts(trainer_gpu)
    # offloaded: no master weights or Adam moments on the GPU, all of them in host memory
    assert p["trainer/master weights"] == 0 and p["trainer/optimizer state"] == 0
    assert plan.host_offload_bytes > 40 * GIB
    # bf16 weights and fp32 gradients of this rank's share: EP 4 holds 32 of 128 experts per layer, EP 8 holds 16
    expected_weights = 16.4 if experiment.endswith("4p4") else 9.6
    assert p["trainer/weights"] == pytest.approx(expected_weights, abs=0.1)
    assert p["trainer/gradients"] == pytest.approx(2 * p["trainer/weights"], rel=1e-6)
    if experiment.endswith("colocated"):
        assert trainer_gpu.gpu == "colocated" and trainer_gpu.role_total("rollout") == pytest.approx(0.35 * 80 * GIB,
                                                                                                       rel=1e-6)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_without_offload_the_30b_experiments_are_refused_with_the_keys(experiment):
    with pytest.raises(ConfigError) as info:
        compose([f"experiment={experiment}", "trainer.optimizer_cpu_offload=false"])
    (key, reason), = [(k, r) for k, r in info.value.problems if k == "parallelism.gpu_memory_gib"]
    assert "out of GPU memory" in reason and "trainer.optimizer_cpu_offload=true" in reason
    assert "parallelism.trainer.expert_parallel" in reason


def test_4p4_without_offload_is_the_134_gib_of_the_evidence():
    """gpu-path.md: bf16 weights 16.4 + fp32 grads 32.7 + expert master and Adam 81 + dense share 4.3 GiB."""
    cfg = compose(["experiment=qwen3_30b_r3_4p4", "parallelism.gpu_memory_gib=null",
                   "trainer.optimizer_cpu_offload=false"])
    p = parts(build_plan(cfg).memory.gpus[0])
    state = p["trainer/master weights"] + p["trainer/optimizer state"]
    assert p["trainer/weights"] + p["trainer/gradients"] + state == pytest.approx(134, abs=1.5)


def test_recompute_and_token_budget_shrink_activations():
    base = ["model=qwen3_30b", "parallelism=disaggregated_4p4", "parallelism.gpu_memory_gib=null"]
    full = parts(estimate(compose(base), "bfloat16", "bfloat16").gpus[0])["trainer/activations"]
    none = parts(estimate(compose([*base, "trainer.recompute_granularity=null"]), "bfloat16", "bfloat16").gpus[0])
    small = parts(estimate(compose([*base, "trainer.max_tokens_per_micro_batch=8192",
                                    "rollout.engine.max_model_len=2048"]), "bfloat16", "bfloat16").gpus[0])
    assert none["trainer/activations"] > 5 * full
    assert small["trainer/activations"] == pytest.approx(2 * parts(estimate(compose(
        [*base, "trainer.max_tokens_per_micro_batch=4096", "rollout.engine.max_model_len=2048"]), "bfloat16",
        "bfloat16").gpus[0])["trainer/activations"], rel=1e-6)


def test_engine_weights_must_fit_their_share():
    with pytest.raises(ConfigError) as info:
        compose(["experiment=qwen3_30b_r3_colocated", "rollout.engine.gpu_memory_utilization=0.1"])
    assert "rollout.engine.gpu_memory_utilization" in [k for k, _ in info.value.problems]


def test_cpu_profile_prints_its_table_and_never_refuses_itself():
    cfg = compose(["parallelism=cpu"])
    plan = build_plan(cfg).memory
    assert plan.budget_bytes is None and plan.over_budget() == []
    shown = table(plan)
    assert shown["budget per GPU"] == "not checked" and "trainer GPU (x1)" in shown


def test_dry_run_prints_the_table_in_gib():
    out = subprocess.run([sys.executable, "run.py", "experiment=qwen3_30b_r3_4p4", "run.dry_run=true"],
                         capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "memory_gib_per_gpu:" in out.stdout and "trainer GPU (x4):" in out.stdout
    assert "budget per GPU: 80.0" in out.stdout
    refused = subprocess.run([sys.executable, "run.py", "experiment=qwen3_30b_r3_4p4", "run.dry_run=true",
                              "trainer.optimizer_cpu_offload=false"], capture_output=True, text=True, cwd=str(REPO),
                             timeout=120)
    assert refused.returncode != 0 and "out of GPU memory" in refused.stderr
    assert "trainer.optimizer_cpu_offload=true" in refused.stderr
