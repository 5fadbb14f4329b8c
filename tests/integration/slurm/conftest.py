"""Fixtures for the Slurm launcher tests: a real Slurm on 127.0.0.1 (two fake nodes of 8 fake GPUs each) and the
environment a job of slurm/ray.sub gets here (loopback-only Ray, ports of its own, folders under the test's tmp)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from slurm_testbed import REPO, Launch, Testbed, TestbedError, pids_alive, processes_of_job

PORT_NAMES = (
    "GCS_PORT", "CLIENT_SERVER_PORT", "DASHBOARD_PORT", "NODE_MANAGER_PORT", "OBJECT_MANAGER_PORT",
    "RUNTIME_ENV_AGENT_PORT", "DASHBOARD_AGENT_GRPC_PORT", "METRICS_EXPORT_PORT", "DASHBOARD_AGENT_LISTEN_PORT",
    "DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT",
)
WORKER_PORTS = 100
# the recipe's vLLM engines, pinned here (rollout.engine.base_port and up) to keep that path tested on two nodes
ENGINE_PORTS = 4


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port_block(size: int) -> int:
    """A base port with `size` free ports after it: the launcher's fixed ports, away from other users' (the
    machine is shared) and from the kernel's ephemeral range."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - size)
        if all(_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError("no block of free ports found between 20000 and 32000")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the Slurm testbed runs slurmctld/slurmd/munged as root and makes device files (CI runs as root)")
    tb = Testbed(tmp_path_factory.mktemp("slurm"))
    try:
        tb.start()
    except TestbedError as err:
        tb.stop()
        pytest.fail(f"the Slurm testbed did not start: {err}")
    yield tb
    tb.stop()
    left = pids_alive(tb.pids())
    assert not left, f"testbed daemons still running after stop: {left}"


@pytest.fixture(scope="session")
def ray_env() -> dict[str, str]:
    """Ray of the jobs stays on 127.0.0.1, writes no token under ~, and uses a block of free ports."""
    base = pick_port_block(len(PORT_NAMES) + WORKER_PORTS + ENGINE_PORTS)
    env = {name: str(base + i) for i, name in enumerate(PORT_NAMES)}
    env["MIN_WORKER_PORT"] = str(base + len(PORT_NAMES))
    env["MAX_WORKER_PORT"] = str(base + len(PORT_NAMES) + WORKER_PORTS - 1)
    # not a launcher setting: tests that run the recipe pass it as rollout.engine.base_port
    env["R3RL_TEST_ENGINE_PORT"] = str(base + len(PORT_NAMES) + WORKER_PORTS)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    return env


@pytest.fixture
def launch(slurm, ray_env, tmp_path):
    # Ray's socket paths must stay under 108 characters: a short folder of its own in /tmp, not pytest's tmp_path.
    ray_tmp = Path(tempfile.mkdtemp(prefix="r3-", dir="/tmp"))
    env = {
        **ray_env,
        "LOG_ROOT": str(tmp_path),
        "RAY_TMP_ROOT": str(ray_tmp),
        # short timeouts: a test that hangs would still fail within the test's own limits
        "HEAD_START_TIMEOUT": "120",
        "NODE_JOIN_TIMEOUT": "120",
        "R3RL_DATA_DIR": os.environ.get("R3RL_DATA_DIR", str(REPO / "data")),
    }
    yield Launch(slurm=slurm, root=tmp_path, ray_tmp=ray_tmp, env=env)
    slurm.cancel_all()
    shutil.rmtree(ray_tmp, ignore_errors=True)
