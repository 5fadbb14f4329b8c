"""``scripts/check_gpu_driver.sh``, which ``make venv`` runs in the gpu profile before installing (issue 23 item 7):
vLLM 0.32.0's torch 2.13.0 is a CUDA 13 build, so drivers older than 580 are refused with what the stack needs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_gpu_driver.sh"


def check(*args: str, env_version: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "R3RL_DRIVER_VERSION"}
    if env_version is not None:
        env["R3RL_DRIVER_VERSION"] = env_version
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("version", ["575.51", "575.51.03", "550.163.01", "99"])
def test_drivers_older_than_580_are_refused_with_what_the_gpu_stack_needs(version):
    """Fails if the check lets a pre-CUDA-13 driver through (``MIN_DRIVER`` lowered, the comparison made on the
    string or on the last field instead of the major version) or stops saying what is needed: driver >= 580 for CUDA
    13, the torch 2.13.0 that vLLM 0.32.0 pins, and TransformerEngine's build needs (CUDA 13 toolkit, cuDNN)."""
    for run in (check(version), check(env_version=version)):
        assert run.returncode == 1, run
        msg = run.stderr
        assert version in msg and ">= 580" in msg and "CUDA 13" in msg
        assert "torch 2.13.0" in msg and "vLLM 0.32.0" in msg
        assert "TransformerEngine" in msg and "nvcc" in msg and "cuDNN" in msg
        assert "PROFILE=cpu" in msg


@pytest.mark.parametrize("version", ["580.65", "580.65.06", "590.48.01", "1000.1"])
def test_drivers_from_580_on_are_accepted(version):
    """Fails if a CUDA 13 driver is refused (the bound raised, or the version parsed so that 580.65 or a four-digit
    major reads as older)."""
    for run in (check(version), check(env_version=version)):
        assert run.returncode == 0, run
        assert f"driver {version} >= 580" in run.stdout


@pytest.mark.parametrize("version", ["abc", "580.x", "-1"])
def test_an_unreadable_version_is_an_error_not_a_pass(version):
    """Fails if a version the script cannot parse (nvidia-smi's error text, an empty line) passes the check."""
    run = check(version)
    assert run.returncode == 2 and "cannot read the NVIDIA driver version" in run.stderr


def test_make_venv_runs_the_check_first_in_the_gpu_profile_only():
    """Fails if the Makefile's gpu branch stops calling the check before its first install, or the cpu branch calls
    it (CPU machines have no driver)."""
    text = (REPO / "Makefile").read_text()
    text = text[text.index("$(STAMP):"):]  # the venv recipe
    cpu, gpu = re.search(r"ifeq \(\$\(PROFILE\),cpu\)\n(.*?)\nelse\n(.*?)\nendif", text, re.S).groups()
    assert "check_gpu_driver" not in cpu
    commands = [line.strip() for line in gpu.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert commands[0] == "scripts/check_gpu_driver.sh"
    assert all("pip install" in c for c in commands[1:])
