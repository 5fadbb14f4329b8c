"""run.py as a user calls it: bad overrides fail fast with the key named; dry runs print the plan, start nothing."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from r3rl.config import CONF_DIR

REPO = CONF_DIR.parent

# colocated engines leave room for the trainer on the same GPU (the memory plan refuses 0.85 there)
COLOCATED_SHARE = "rollout.engine.gpu_memory_utilization=0.35"


def run_py(*args: str) -> subprocess.CompletedProcess:
    # a timeout, not a timing assertion: a config error must never reach anything that could hang
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.num_layerz=3", "model.num_layerz"),
        ("rollout.temperature=hot", "rollout.temperature"),
        ("rollout.sampling.temperature=hot", "rollout.sampling.temperature"),
        ("parallelism.rollout.tensor_parallel=3", "parallelism.rollout.tensor_parallel"),
        ("rollout=vllm_r4", "vllm_r4"),
    ],
)
def test_bad_override_fails_naming_the_key(override, key):
    out = run_py(override, "run.dry_run=true")
    assert out.returncode != 0
    assert key in out.stderr + out.stdout
    assert "launch plan" not in out.stdout


def test_dry_run_disaggregated_4p4_r3():
    out = run_py("model=qwen3_30b", "rollout=vllm_r3", "parallelism=disaggregated_4p4", "run.dry_run=true")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for rank in range(4):
        assert f"rank {rank}: node 0 GPU {rank}" in text
    assert "engine 0: node 0 GPUs 4,5,6,7" in text
    assert "--tensor-parallel-size 4" in text and "--enable-expert-parallel" in text
    assert "--enable-return-routed-experts" in text
    # the printed command pastes into a shell as it is (no YAML quoting, no folding)
    [line] = [ln for ln in text.splitlines() if ln.strip().startswith("command: ")]
    argv = shlex.split(line.split("command: ", 1)[1])
    assert argv[:2] == ["vllm", "serve"] and json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {
        "backend": "nccl"}
    assert "CUDA_VISIBLE_DEVICES: 4,5,6,7" in text
    assert "moe_enable_routing_replay: true" in text
    assert "r3:on" in text and "group: qwen3_30b-disaggregated_4p4" in text


def test_dry_run_plan_for_cpu_default_has_cpu_profile_only_there():
    cpu = run_py("run.dry_run=true", "parallelism=cpu")
    gpu = run_py("model=qwen3_30b", "parallelism=colocated", COLOCATED_SHARE, "run.dry_run=true")
    assert cpu.returncode == 0 and gpu.returncode == 0, cpu.stderr + gpu.stderr
    assert "TRITON_INTERPRET" in cpu.stdout and "logical_gpus: true" in cpu.stdout
    assert "TRITON_INTERPRET" not in gpu.stdout
    # routed experts need Model Runner V2 on every device
    assert "VLLM_USE_V2_MODEL_RUNNER: '1'" in cpu.stdout and "VLLM_USE_V2_MODEL_RUNNER: '1'" in gpu.stdout


def test_dry_run_starts_nothing_and_writes_nothing(tmp_path):
    out = run_py("run.dry_run=true", "parallelism=cpu", f"run.output_dir={tmp_path}/run")
    assert out.returncode == 0, out.stderr
    assert "launch plan" in out.stdout
    # not even Hydra's .hydra/ and run.log
    assert not (tmp_path / "run").exists()


def test_refused_config_writes_nothing(tmp_path):
    out = run_py("parallelism=cpu", "algorithm.global_batch_size=7", f"run.output_dir={tmp_path}/run")
    assert out.returncode == 2 and "algorithm.global_batch_size" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


def test_parallelism_defaults_to_the_machine_unless_named(monkeypatch):
    """run.py and the doctor add the machine's parallelism group; fails if a named group or experiment were
    overridden, or Hydra's own flags got a group appended."""
    from r3rl import platform

    # No GPU can be made to appear here: stand in for the detection (both answers), the rest is real.
    for found in ("cpu", "disaggregated_4p4"):
        monkeypatch.setattr(platform, "default_parallelism", lambda found=found: found)
        assert platform.with_default_parallelism(["model=tiny_moe"]) == ["model=tiny_moe", f"parallelism={found}"]
    for named in (["parallelism=colocated"], ["experiment=qwen3_30b_r3_4p4"], ["--cfg", "job"]):
        assert platform.with_default_parallelism(named) == named


def test_cpu_profile_is_refused_where_gpus_are_present(compose_cfg):
    from r3rl.launch import check_machine

    cpu = compose_cfg("parallelism=cpu")
    gpu = compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4")
    assert check_machine(cpu, gpus=0) is None and check_machine(gpu, gpus=8) is None
    assert "parallelism=cpu" in check_machine(cpu, gpus=8)
    assert "none are visible" in check_machine(gpu, gpus=0)


def test_gpu_layout_without_gpus_fails_before_starting_anything(tmp_path):
    out = run_py("model=qwen3_30b", "parallelism=colocated", COLOCATED_SHARE, f"run.output_dir={tmp_path}/r")
    assert out.returncode == 2 and "needs GPUs" in out.stderr
    assert not (tmp_path / "r").exists()
