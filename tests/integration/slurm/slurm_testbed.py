"""A real Slurm (Debian slurm-wlm) on this machine, on 127.0.0.1, for the launcher tests.

munged, slurmctld and one slurmd per fake node run in the foreground as children of this process and are stopped
by their PIDs; every file (config, state, spool, logs, munge key and socket, fake GPU devices) lives under one
folder of the caller's, so nothing of the host's own Slurm or munge (if any) is read or touched.

    python tests/integration/slurm/slurm_testbed.py /tmp/tb     # bring it up, print the env to use, Ctrl-C stops it
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from r3rl.net import free_port

REPO = Path(__file__).resolve().parents[3]
SLURM_PACKAGE = "slurm-wlm"
# Slurm 22.05 keeps finished jobs visible to `scontrol show job` for MinJobAge seconds; the tests read the final
# state there because sacct needs slurmdbd + a database.
MIN_JOB_AGE_S = 600
# How long Slurm waits between SIGTERM and SIGKILL when it cancels or times out a job step.
KILL_WAIT_S = 10
FINISHED_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
}


class TestbedError(RuntimeError):
    pass


def ensure_slurm_installed() -> None:
    """Install Debian's slurm-wlm (slurmctld, slurmd, munge, clients) when slurmctld is absent.

    Service start-up by the package scripts is blocked for the duration: the testbed runs its own daemons, and a
    system munged or slurmd left running would outlive the tests.
    """
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged"):
        return
    if os.geteuid() != 0:
        raise TestbedError(f"{SLURM_PACKAGE} is not installed, and installing it needs root")
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\n# added by r3rl's Slurm testbed while it installs slurm-wlm\nexit 101\n")
        policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        # the lock timeout: another apt on the machine (a shared one) must not fail the install
        apt = ["apt-get", "-qq", "-o", "DPkg::Lock::Timeout=300"]
        for cmd in (apt + ["update"], apt + ["install", "-y", SLURM_PACKAGE]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise TestbedError(
                    f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    finally:
        if added_policy:
            policy.unlink(missing_ok=True)


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` prints one line of Key=Value pairs (values may hold spaces only in a few fields)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\S+?)=(.*?)(?=\s+\S+?=|$)", text.strip()):
        out[m.group(1)] = m.group(2)
    return out


@dataclass
class Testbed:
    root: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    gpus_per_node: int = 8
    cpus_per_node: int = 2
    # Where each node's slurmd listens; slurmctld (and every client) on the first node's address. Each address may
    # belong to a network namespace of its own (`netns`: node -> namespace), which then is that node's host.
    addrs: dict[str, str] = field(default_factory=dict)
    netns: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in self.nodes}
        self.first_job_id = random.randrange(100_000, 60_000_000)
        self.addrs = {n: self.addrs.get(n, "127.0.0.1") for n in self.nodes}
        self.ctld_addr = self.addrs[self.nodes[0]]

    def on_node(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run on `node`'s host (inside its network namespace, when it has one)."""
        # nsenter, not `ip netns exec`: that one also mounts a sysfs of its own, without the cgroup mount slurmd reads
        return ["nsenter", f"--net=/var/run/netns/{self.netns[node]}", *argv] if node in self.netns else list(argv)

    def client(self, argv: list[str]) -> list[str]:
        """A Slurm client command as run on the controller's host."""
        return self.on_node(self.nodes[0], argv)

    # ---------------------------------------------------------------- set-up
    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, squeue, scontrol, ...) talking to this testbed."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "state", "log", "dev", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # Slurm only accepts character devices as GPU files; 1:3 is /dev/null's, so nothing can misuse them.
        for i in range(self.gpus_per_node):
            dev = self.root / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
        host = socket.gethostname().split(".")[0]
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr={self.addrs[n]} Port={self.node_ports[n]} "
            f"CPUs={self.cpus_per_node} Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for n in self.nodes
        )
        r = self.root
        self.conf.write_text(f"""\
ClusterName=r3rltest
# job ids of their own, so that two testbeds on one machine never share one (processes are told apart by it)
FirstJobId={self.first_job_id}
SlurmctldHost={host}({self.ctld_addr})
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
{self._listen_conf()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/state/slurmctld.pid
SlurmdPidFile={r}/spool/%n/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
# no systemd and no cgroups here: track job processes through the process tree
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
# a job that waits (its node still completing the previous job) would otherwise start up to 60 s later
SchedulerParameters=sched_interval=1
KillWait={KILL_WAIT_S}
MinJobAge={MIN_JOB_AGE_S}
InactiveLimit=0
{node_lines}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (self.root / "etc" / "gres.conf").write_text(
            f"Name=gpu File={self.root}/dev/nvidia[0-{self.gpus_per_node - 1}]\n"
        )
        # the package's /etc/slurm/plugstack.conf would be read otherwise
        (self.root / "etc" / "plugstack.conf").write_text("")

    def _listen_conf(self) -> str:
        if self.netns:
            # each daemon is alone in its namespace (a veth address and loopback): it listens on all of them, since
            # with NoInAddrAny Slurm binds to what the shared host name resolves to, not to the node's address
            return "# daemons in network namespaces of their own listen on every address there"
        return "# both daemons listen on 127.0.0.1 only\nCommunicationParameters=NoInAddrAny,NoCtldInAddrAny"

    def _spawn(self, name: str, argv: list[str], node: str | None = None) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(
            self.on_node(node, argv) if node else argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, start_new_session=True,
        )
        log.close()

    def _wait(self, what: str, ready, timeout: float, proc: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc and self.procs[proc].poll() is not None:
                raise TestbedError(f"{proc} exited ({self.procs[proc].returncode}) before {what}; see {self.root}/log")
            if ready():
                return
            time.sleep(0.2)
        raise TestbedError(f"timed out after {timeout:.0f}s waiting for {what}; see {self.root}/log")

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        done = subprocess.run(self.client(list(argv)), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise TestbedError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def start(self, timeout: float = 60) -> Testbed:
        ensure_slurm_installed()
        self._write_files()
        r = self.root
        self._spawn("munged", [
            "munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={r}/munge/munge.key",
            f"--pid-file={r}/munge/munged.pid", f"--seed-file={r}/munge/munged.seed", f"--log-file={r}/log/munged.log",
        ])
        self._wait("munged's socket", self.munge_socket.exists, timeout, "munged")
        # -c: a cold start, ignoring any saved state of an earlier testbed in the same folder
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)], self.nodes[0])
        self._wait("slurmctld", lambda: self.run("scontrol", "ping", check=False).returncode == 0, timeout, "slurmctld")
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)], n)
        self._wait("every node idle", self._all_idle, timeout)
        return self

    def _all_idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise TestbedError(f"{name} exited ({p.returncode}); see {self.root}/log")
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    # ---------------------------------------------------------------- jobs
    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        done = subprocess.run(
            self.client(["sbatch", "--parsable", *args]), env={**self.env, **(env or {})}, cwd=cwd,
            capture_output=True, text=True, timeout=60,
        )
        if done.returncode != 0:
            raise TestbedError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of this job id alone (for the id of a job array Slurm lists every task of it)."""
        done = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            info = parse_scontrol(line)
            if info.get("JobId") == job_id:
                return info
        return {}

    def wait_job(self, job_id: str, timeout: float, states=FINISHED_STATES) -> dict[str, str]:
        """Wait until the job reaches one of `states`; returns `scontrol show job` of that moment."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TestbedError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f}s (wanted {sorted(states)})")

    def active_jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def cancel_all(self, timeout: float = 60) -> None:
        jobs = self.active_jobs()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout
        while self.active_jobs() and time.monotonic() < deadline:
            time.sleep(0.5)

    # ---------------------------------------------------------------- tear-down
    def stop(self, timeout: float = 30) -> None:
        """Cancel the testbed's jobs, then stop its daemons by PID: slurmds, slurmctld, munged last."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.cancel_all()
        order = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pids_alive(pids) -> list[int]:
    """The PIDs of `pids` that still run (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def processes_of_job(job_id: str, marker: str | None = None) -> dict[int, str]:
    """Live processes that belong to a Slurm job: SLURM_JOB_ID=<job_id> in their environment, or `marker` (e.g. the
    job's own Ray temp dir) in their command line. Returns {pid: command line}."""
    found: dict[int, str] = {}
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            env = (d / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if (needle in env or (marker and marker in cmd)) and pids_alive([int(d.name)]):
            found[int(d.name)] = cmd
    return found


def _serve(root: Path) -> None:
    """Bring a testbed up for manual use until SIGINT/SIGTERM (a background `&` job ignores SIGINT: use kill)."""
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    with Testbed(root) as tb:
        print(f"export SLURM_CONF={tb.conf}", flush=True)
        print(f"daemons: {', '.join(f'{n}={p.pid}' for n, p in tb.procs.items())}; kill -TERM {os.getpid()} stops them",
              flush=True)
        while not stop:
            signal.pause()


if __name__ == "__main__":
    _serve(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/r3rl-slurm-testbed"))


LAUNCHER = REPO / "slurm" / "ray.sub"


@dataclass
class Launch:
    """Submits slurm/ray.sub like a user does (from the repository root) and collects what a job left behind."""

    slurm: Testbed
    root: Path
    ray_tmp: Path
    env: dict[str, str]

    def submit(self, *sbatch_args: str, overrides: tuple[str, ...] = (), env: dict[str, str] | None = None,
               script: Path = LAUNCHER) -> str:
        return self.slurm.sbatch(
            f"--output={self.root}/slurm-%j.out", *sbatch_args, str(script), *overrides,
            env={**self.env, **(env or {})}, cwd=REPO,
        )

    def log_dir(self, job: str) -> Path:
        return self.root / f"{job}-logs"

    def output(self, job: str) -> str:
        path = self.root / f"slurm-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def launcher_log(self, job: str) -> str:
        path = self.log_dir(job) / "launcher.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_file(self, path: Path, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            state = self.slurm.job(job).get("JobState")
            if state not in (None, "PENDING", "RUNNING", "CONFIGURING"):
                pytest.fail(f"job {job} ended ({state}) before {path} appeared:\n{self.output(job)}")
            if time.monotonic() > deadline:
                pytest.fail(f"{path} did not appear within {timeout:.0f}s:\n{self.output(job)}")
            time.sleep(0.5)

    def assert_nothing_left(self, job: str, timeout: float = 30) -> None:
        """No process of the job runs any more (found by PID: its recorded PIDs, SLURM_JOB_ID in the environment,
        its Ray temp dir in the command line), and its Ray temp dirs are gone."""
        pid_files = list((self.log_dir(job) / "pids").glob("*")) if self.log_dir(job).exists() else []
        pids = [int(p.read_text().split()[0]) for p in pid_files if p.read_text().strip()]
        marker = f"{self.ray_tmp}/r3rl-ray-{job}-"
        deadline = time.monotonic() + timeout
        while True:
            left = {pid: "recorded by the launcher" for pid in pids_alive(pids)}
            left.update(processes_of_job(job, marker))
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not left, f"processes of job {job} still running: {left}"
        dirs = list(self.ray_tmp.glob(f"r3rl-ray-{job}-*"))
        assert not dirs, f"Ray temp dirs of job {job} left behind: {dirs}"
