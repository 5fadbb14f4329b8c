"""Two hosts on one machine: two network namespaces joined by a veth pair, each with its own address.

Each namespace is a host as far as the network goes (its own interfaces, addresses, loopback and ports); the
filesystem and PID space are shared, so the repository, the venv and munge's socket are seen by both, and the test
can find and stop every process of a host by PID (``ip netns pids``). The addresses live on the veth only, in a
private /24 chosen at random among 10.213.0.0/16; a default route through the veth lets software that asks the
kernel which interface leads off the node (Ray does) find the host's address, and since forwarding is off inside a
new namespace nothing sent there leaves the pair.

    python tests/integration/multihost/twohosts.py      # bring two hosts up, print how to use them, Ctrl-C removes them
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from r3rl.rollout import _proctree

IPROUTE_PACKAGE = "iproute2"


class HostsError(RuntimeError):
    pass


def missing_requirement() -> str | None:
    """Why two hosts cannot be made here (None when they can): it needs root, and `ip` (iproute2) once installed."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None and shutil.which("apt-get") is None:
        return "`ip` (iproute2) is not installed and there is no apt-get to install it"
    return None


def ensure_iproute_installed() -> None:
    """Install Debian's iproute2 (the `ip` command) when it is absent, as the Slurm testbed installs slurm-wlm."""
    if shutil.which("ip"):
        return
    apt = ["apt-get", "-qq", "-o", "DPkg::Lock::Timeout=300"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (apt + ["update"], apt + ["install", "-y", IPROUTE_PACKAGE]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise HostsError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise HostsError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass
class Host:
    name: str  # also the Slurm NodeName of this host
    netns: str
    ip: str
    veth: str

    def exec_prefix(self) -> list[str]:
        """Prefix of a command line that runs it on this host."""
        return ["nsenter", f"--net=/var/run/netns/{self.netns}"]


@dataclass
class TwoHosts:
    names: tuple[str, str] = ("hosta", "hostb")
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        self.subnet = f"10.213.{random.randrange(1, 255)}"
        self.hosts = [
            Host(name=n, netns=f"r3rl-{tag}-{n}", ip=f"{self.subnet}.{i + 1}", veth=f"r3v{tag}{'ab'[i]}")
            for i, n in enumerate(self.names)
        ]

    def up(self) -> TwoHosts:
        a, b = self.hosts
        try:
            for h in self.hosts:
                _ip("netns", "add", h.netns)
            _ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
            for h in self.hosts:
                _ip("link", "set", h.veth, "netns", h.netns)
                _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.veth)
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "link", "set", h.veth, "up")
                _ip("-n", h.netns, "route", "add", "default", "dev", h.veth)
        except BaseException:
            self.down()
            raise
        return self

    def pids(self, host: Host) -> list[int]:
        done = _ip("netns", "pids", host.netns, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def kill_host(self, host: Host) -> list[int]:
        """What a host that loses power looks like to the others: every process on it is gone at once, and so is
        its shared memory (the namespaces share this machine's /dev/shm, so what only the host's processes mapped
        is removed here)."""
        pids = self.pids(host)
        segments = _proctree.shared_memory_segments(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(_proctree.is_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        _proctree.unlink_unmapped(segments)
        return pids

    def down(self, timeout: float = 30) -> list[str]:
        """Stop what still runs in the namespaces (by PID), then delete them (the veth pair goes with them).
        Returns what was still running there and what could not be removed."""
        problems = []
        for h in self.hosts:
            if not Path(f"/var/run/netns/{h.netns}").exists():
                continue
            if found := self.pids(h):
                problems.append(f"processes {found} still ran on {h.name} at tear-down (killed now)")
            deadline = time.monotonic() + timeout
            while (pids := self.pids(h)) and time.monotonic() < deadline:
                self.kill_host(h)
                time.sleep(0.2)
            if pids:
                problems.append(f"processes {pids} still run in {h.netns}")
                continue
            if _ip("netns", "del", h.netns, check=False).returncode != 0:
                problems.append(f"namespace {h.netns} could not be deleted")
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces or veth ends of this pair that still exist."""
        names = set(_ip("netns", "list", check=False).stdout.split())
        links = _ip("-o", "link", "show", check=False).stdout
        return ([h.netns for h in self.hosts if h.netns in names]
                + [h.veth for h in self.hosts if f" {h.veth}@" in links or f" {h.veth}:" in links])

    def __enter__(self) -> TwoHosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def _serve() -> None:
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    with TwoHosts() as hosts:
        for h in hosts.hosts:
            print(f"{h.name}: {h.ip}  ->  {' '.join(h.exec_prefix())} CMD", flush=True)
        while not stop:
            signal.pause()


if __name__ == "__main__":
    if why := missing_requirement():
        sys.exit(why)
    ensure_iproute_installed()
    _serve()
