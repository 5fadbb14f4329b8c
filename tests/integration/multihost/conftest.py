"""Fixtures for two-host tests: two network namespaces as hosts (``twohosts.py``), a real Slurm across them
(slurmctld and one slurmd on host A, one slurmd on host B, fake GPUs as gres) and slurm/ray.sub jobs whose Ray head
runs on host A and whose Ray worker runs on host B, joined over the veth addresses.

At the end of the session the fixture itself checks that nothing is left: no namespace, no veth end, no Slurm
daemon and no Ray process of the tests."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "slurm"))

from slurm_testbed import REPO, Launch, Testbed, TestbedError, pids_alive, processes_of_job  # noqa: E402
from twohosts import HostsError, TwoHosts, ensure_iproute_installed, missing_requirement  # noqa: E402



def _processes_with(needle: bytes) -> dict[int, str]:
    """Live processes with `needle` in their environment or command line."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if (needle in cmd or needle in env) and pids_alive([int(d.name)]):
            found[int(d.name)] = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


@pytest.fixture(scope="session")
def hosts():
    if why := missing_requirement():
        pytest.skip(why)
    try:
        ensure_iproute_installed()
    except HostsError as err:
        pytest.skip(f"`ip` (iproute2) could not be installed: {err}")
    pair = TwoHosts()
    try:
        pair.up()
    except HostsError as err:
        pair.down()
        pytest.skip(f"network namespaces cannot be made here: {err}")
    yield pair
    problems = pair.down()
    problems += [f"left behind: {x}" for x in pair.leftovers()]
    assert not problems, problems


@pytest.fixture(scope="session")
def ray_tmp():
    # Ray's socket paths must stay under 108 characters: a short folder in /tmp, not pytest's tmp_path
    path = Path(tempfile.mkdtemp(prefix="r3m-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm2(hosts, ray_tmp, tmp_path_factory):
    """Slurm with NodeName=hosta on host A (with slurmctld) and NodeName=hostb on host B, 2 fake GPUs each."""
    a, b = hosts.hosts
    tb = Testbed(tmp_path_factory.mktemp("slurm2"), nodes=(a.name, b.name), gpus_per_node=2,
                 addrs={a.name: a.ip, b.name: b.ip}, netns={a.name: a.netns, b.name: b.netns})
    try:
        tb.start()
    except TestbedError as err:
        tb.stop()
        pytest.fail(f"the two-host Slurm testbed did not start: {err}")
    yield tb
    tb.stop()
    # nothing of the session may outlive it: daemons by PID, and every process that ran with this Slurm config
    # (jobs, their Ray head and worker, engines) or in this session's Ray folder
    deadline = time.monotonic() + 30
    while True:
        left = {pid: "testbed daemon" for pid in pids_alive(tb.pids())}
        left.update(_processes_with(f"SLURM_CONF={tb.conf}".encode()))
        left.update(_processes_with(str(ray_tmp).encode()))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"still running after the session: {left}"


@dataclass
class Launch2(Launch):
    """Submits slurm/ray.sub from host A, as a user on the cluster's login node would."""

    hosts: TwoHosts

    def assert_nothing_left(self, job: str, timeout: float = 60, dead: str | None = None) -> None:
        """No process of the job on either host (by SLURM_JOB_ID in the environment or its Ray folders in the
        command line), no Ray folder of it (but the one of a `dead` host: nothing there could remove it), and each
        host runs nothing but its slurmd (and A its slurmctld)."""
        marker = f"{self.ray_tmp}/r3rl-ray-{job}-"
        daemons = set(self.slurm.pids())
        # slurmctld's own helper (slurmscriptd) runs beside it on host A
        ctld = self.slurm.procs["slurmctld"].pid
        daemons |= {pid for pid in self.hosts.pids(self.hosts.hosts[0]) if _ppid(pid) == ctld}
        deadline = time.monotonic() + timeout
        while True:
            left = processes_of_job(job, marker)
            for h in self.hosts.hosts:
                left.update({pid: f"on {h.name}: {_cmdline(pid)}" for pid in self.hosts.pids(h)
                             if pid not in daemons and pids_alive([pid])})
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not left, f"processes of job {job} still running: {left}"
        dirs = [d for d in self.ray_tmp.glob(f"r3rl-ray-{job}-*") if d.name != f"r3rl-ray-{job}-{dead}"]
        assert not dirs, f"Ray temp dirs of job {job} left behind: {dirs}"


@pytest.fixture
def launch2(slurm2, hosts, ray_tmp, tmp_path):
    env = {
        # two hosts: Ray may leave loopback (it finds each host's address through the veth's default route)
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "LOG_ROOT": str(tmp_path),
        "RAY_TMP_ROOT": str(ray_tmp),
        "HEAD_START_TIMEOUT": "120",
        "NODE_JOIN_TIMEOUT": "120",
        "R3RL_DATA_DIR": os.environ.get("R3RL_DATA_DIR", str(REPO / "data")),
    }
    yield Launch2(slurm=slurm2, hosts=hosts, root=tmp_path, ray_tmp=ray_tmp, env=env)
    slurm2.cancel_all()
