"""Trainer side of vLLM's weight-transfer protocol: the HTTP control plane of every engine at once, and the sender.

One sync (``r3rl.orchestration`` drives it; the trainer only produces buckets):

    engines.pause()                      # /pause?mode=wait: requests in flight finish on the old weights
    sender.send(buckets, version)        # /start_weight_update, then per bucket /update_weights on every engine
                                         # while one broadcast feeds them all, then /finish_weight_update (version)
    engines.reset_prefix_cache()         # cached prefixes hold KV *and routed experts* of the old weights
    engines.resume()

Every call goes to all engines concurrently, so N engines take the time of one. A failure names the engine.
``r3rl.plan.weight_sync_backend`` says which wire a config uses; ``GlooSender`` is the CPU profile's
(``r3rl.rollout.gloo_transfer``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from r3rl.rollout.errors import EngineError
from r3rl.rollout.weights import post_dev_route


class EngineSet:
    """The weight-sync and sleep routes of several vLLM servers, each call sent to all of them at once."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 900.0) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.urls)))
        self._client = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def post_one(self, url: str, path: str, what: str, **kwargs: Any) -> dict[str, Any]:
        resp = post_dev_route(self._client, url, path, what, **kwargs)
        try:
            return resp.json()
        except ValueError:
            return {}

    def submit(self, path: str, what: str, per_engine: Sequence[dict[str, Any]] | None = None, **kwargs: Any):
        """Futures of one POST per engine (``per_engine[i]`` adds keyword arguments for engine i)."""
        return [self._pool.submit(self.post_one, url, path, what, **{**kwargs, **(per_engine[i] if per_engine else {})})
                for i, url in enumerate(self.urls)]

    @staticmethod
    def wait(futures) -> list[dict[str, Any]]:
        """Every answer; the first engine error (in engine order) once all have ended."""
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except EngineError as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return results

    def all(self, path: str, what: str, **kwargs: Any) -> list[dict[str, Any]]:
        return self.wait(self.submit(path, what, **kwargs))

    # -- the routes -------------------------------------------------------------------------------------------
    def world_sizes(self) -> list[int]:
        sizes = []
        for url in self.urls:
            try:
                resp = self._client.get(f"{url}/get_world_size", params={"include_dp": "true"})
                resp.raise_for_status()
            except httpx.HTTPError as err:
                raise EngineError(f"engine {url}: /get_world_size failed: {err}", url=url) from err
            sizes.append(int(resp.json()["world_size"]))
        return sizes

    def pause(self) -> None:
        self.all("/pause", "pause before the weight update", params={"mode": "wait", "clear_cache": "false"})

    def start_weight_update(self) -> None:
        self.all("/start_weight_update", "starting the weight update")

    def finish_weight_update(self, version: int | str) -> None:
        self.all("/finish_weight_update", "finishing the weight update", json={"weight_version": str(version)})

    def reset_prefix_cache(self) -> None:
        for url, ok in zip(self.urls, self.all("/reset_prefix_cache", "resetting the prefix cache")):
            if ok and not ok.get("success", True):
                raise EngineError(f"engine {url}: prefix cache not reset after the weight update ({ok}); cached "
                                  "prefixes would serve KV and routes of the old weights", url=url)

    def resume(self) -> None:
        self.all("/resume", "resume after the weight update")

    def sleep(self, level: int) -> None:
        self.all("/sleep", f"sleep (level {level})", params={"level": level, "mode": "wait"})

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        params = [("tags", t) for t in tags] if tags else None
        self.all("/wake_up", f"wake up ({', '.join(tags) if tags else 'all'})", params=params)

    def alive(self) -> list[bool]:
        out = []
        for url in self.urls:
            try:
                out.append(self._client.get(f"{url}/health", timeout=5.0).status_code == 200)
            except httpx.HTTPError:
                out.append(False)
        return out


@dataclass(frozen=True)
class SendStats:
    version: int | str
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    pack_s: float  # copying buckets into the wire buffer
    wire_s: float  # the broadcasts
    load_s: float  # waiting for the engines to finish loading the last bucket


class GlooSender:
    """Rank 0 of the ``r3rl_gloo`` group; every worker of every engine joins it at ``init``."""

    def __init__(self, engines: EngineSet, master_address: str, master_port: int, timeout_s: float = 600.0,
                 *, shared_memory: bool | None = None, join_timeout_s: float = 60.0):
        from r3rl.rollout.gloo_transfer import open_group, open_store

        self.engines = engines
        self.timeout_s = timeout_s
        sizes = engines.world_sizes()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        # the sender's end first: an address that is not ours or a port taken fails here, before any engine waits
        try:
            self._store = open_store(master_address, master_port, world, join_timeout_s, is_master=True)
        except Exception as err:
            raise RuntimeError(f"weight transfer: the sender cannot listen on {master_address}:{master_port} "
                               f"({type(err).__name__}: {err}); no engine was contacted") from err
        payloads = [{"json": {"init_info": {"master_address": master_address, "master_port": master_port,
                                            "rank_offset": off, "world_size": world, "timeout_s": timeout_s,
                                            "join_timeout_s": join_timeout_s}}}
                    for off in offsets]
        # the workers block in the rendezvous inside /init_weight_transfer_engine until the sender joins
        futures = engines.submit("/init_weight_transfer_engine", "joining the weight-transfer group", payloads)
        self.group = join(futures, engines.urls, join_timeout_s,
                          lambda: open_group(self._store, master_address, 0, world, join_timeout_s))
        self.world_size = world
        self._buf = None  # the warm pack buffer, as large as the largest bucket so far
        # on loopback every engine can map the sender's files: one copy in, one copy out, no sockets
        self.shared_memory = master_address in ("127.0.0.1", "localhost") if shared_memory is None \
            else shared_memory
        shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self._shm_dir = shm_dir
        # two files, rewritten in place sync after sync (their pages stay allocated: a fresh file pays the kernel's
        # page allocation for every 4 KiB, which on a busy host costs more than the copy itself)
        self._shm_files = [shm_dir / f"r3rl-weights-{os.getpid()}-{uuid.uuid4().hex}-{i}" for i in range(2)]
        self._shm_cleanup = weakref.finalize(self, _unlink, list(self._shm_files))

    def _name_failure(self, futures, err: BaseException, what: str) -> None:
        """Turn a transport error into an ``EngineError`` naming the engine at fault (an HTTP failure, or else the
        engine that no longer answers /health)."""
        for f in futures:
            try:
                f.result(timeout=30)
            except EngineError as engine_err:
                raise engine_err from err
            except Exception:
                pass
        dead = [u for u, ok in zip(self.engines.urls, self.engines.alive()) if not ok]
        if dead:
            raise EngineError(f"engine {dead[0]}: {what} failed ({type(err).__name__}: {err}); the engine is gone",
                              url=dead[0]) from err

    def send(self, buckets: Iterable[list[tuple[str, Any]]], version: int | str) -> SendStats:
        """Stream ``buckets`` (lists of ``(hf_name, tensor)``) to every engine; the weights are labelled ``version``.

        Pipelined: while the engines load bucket k (their /update_weights answer), bucket k+1 is produced and packed
        (into the warm broadcast buffer, or a shared-memory file the engines map); at most two buckets are in
        flight. The bucket iterator is always run to its end (the trainer's other ranks take part in producing it).
        """

        from r3rl.rollout.gloo_transfer import broadcast, pack, packed_offsets, write_packed

        start = time.perf_counter()
        it = iter(buckets)
        count = tensors = nbytes = 0
        pack_s = wire_s = 0.0
        pending: list = []
        try:
            self.engines.start_weight_update()
            for bucket in it:
                if not bucket:
                    continue
                names = [n for n, _ in bucket]
                ts = [t.detach().cpu() for _, t in bucket]
                info = {"names": names, "dtype_names": [str(t.dtype).removeprefix("torch.") for t in ts],
                        "shapes": [list(t.shape) for t in ts]}
                t0 = time.perf_counter()
                _, size = packed_offsets(info["dtype_names"], info["shapes"])
                # a small /dev/shm (containers default to 64 MiB) would fail the write: broadcast those buckets
                path = self._shm_files[count % 2]
                held = path.stat().st_size if path.exists() else 0
                shm = self.shared_memory and shutil.disk_usage(self._shm_dir).free + held > 2 * size
                if shm:
                    # the file's previous bucket was answered (at most two in flight), so no engine reads it now
                    write_packed(path, ts, size)
                    buf = None
                    info["shm_path"] = str(path)
                else:
                    buf = pack(ts, self._buf)
                    if self._buf is None or buf.numel() > self._buf.numel():
                        self._buf = buf
                del ts, bucket
                t1 = time.perf_counter()
                futures = self.engines.submit("/update_weights", "receiving weights", json={"update_info": info})
                pending.append(futures)
                if not shm:
                    try:
                        broadcast(self.group, buf, self.timeout_s)
                    except Exception as err:
                        self._name_failure([f for fs in pending for f in fs], err, "the weight transfer")
                        raise
                pack_s, wire_s = pack_s + t1 - t0, wire_s + time.perf_counter() - t1
                # at most two buckets in flight: the engines load one while the next is produced and packed
                while len(pending) > 1:
                    self.engines.wait(pending.pop(0))
                count += 1
                tensors += len(names)
                nbytes += size
            t2 = time.perf_counter()
            for futures in pending:
                self.engines.wait(futures)
            load_tail = time.perf_counter() - t2
            self.engines.finish_weight_update(version)
        except BaseException:
            for _ in it:  # keep the other trainer ranks' sends matched, so the trainer stays usable
                pass
            raise
        return SendStats(version, count, tensors, nbytes, time.perf_counter() - start, pack_s, wire_s, load_tail)

    def close(self) -> None:
        self.group = self._store = self._buf = None
        self._shm_cleanup()


def join(futures: list[Future], urls: Sequence[str], join_timeout_s: float, open_sender_end: Callable[[], Any]):
    """Rendezvous of the sender with every engine worker: ``open_sender_end`` (which blocks until all have joined)
    runs while the engines' /init_weight_transfer_engine requests are watched, so an engine that refuses (not started
    with ``--weight-transfer-config``, a bad init) or dies fails the join at once, naming it, instead of after the
    join timeout. Returns what ``open_sender_end`` returns."""
    pool = ThreadPoolExecutor(max_workers=1)
    mine = pool.submit(open_sender_end)
    pool.shutdown(wait=False)  # a sender end still waiting for peers gives up by itself after join_timeout_s
    pending = set(futures) | {mine}
    while pending:
        done, pending = wait(pending, return_when=FIRST_EXCEPTION)
        for f, url in zip(futures, urls):
            if f in done and f.exception() is not None:
                raise EngineError(f"engine {url} did not join the weight-transfer group: {f.exception()}",
                                  url=url) from f.exception()
        if mine in done and mine.exception() is not None:
            late = [url for f, url in zip(futures, urls) if not f.done()] or list(urls)
            raise EngineError(f"engine {', '.join(late)} did not join the weight-transfer group within "
                              f"{join_timeout_s:.0f} s ({type(mine.exception()).__name__}: {mine.exception()})",
                              url=late[0]) from mine.exception()
    return mine.result()


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
