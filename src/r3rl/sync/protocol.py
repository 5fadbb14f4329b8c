"""Trainer side of vLLM's weight-transfer protocol: the HTTP control plane of every engine at once, and the sender.

One sync (``r3rl.orchestration`` drives it; the trainer only produces buckets):

    engines.pause()                      # /pause?mode=wait: requests in flight finish on the old weights
    sender.send(buckets, version)        # /start_weight_update, then per bucket /update_weights on every engine
                                         # while one broadcast feeds them all, then /finish_weight_update (version)
    engines.reset_prefix_cache()         # cached prefixes hold KV *and routed experts* of the old weights
    engines.resume()

Every call goes to all engines concurrently, so N engines take the time of one. A failure names the engine.
``TransferSender`` is the protocol, the same for every backend; a ``Wire`` carries the bytes
(``r3rl.sync.wires``: ``make_wire`` picks the one ``r3rl.plan.weight_sync_backend`` names).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from r3rl.rollout import auth
from r3rl.rollout.errors import EngineError
from r3rl.sync.disk import post_dev_route


class EngineSet:
    """The weight-sync and sleep routes of several vLLM servers, each call sent to all of them at once."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 900.0) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.urls)))
        # a fresh connection per call: when a route raises inside vLLM, uvicorn answers 500 and then drops the
        # connection, so a pooled one would fail the next call (a /resume after a failed update) with a reset
        # instead of reaching the engine. A few calls per sync make the extra connects negligible
        self._client = httpx.Client(timeout=timeout_s, headers={"Connection": "close", **auth.headers()})

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

    def pause(self, *, keep: bool = False) -> None:
        """``keep``: the requests in flight freeze with their KV cache and continue on the new weights after the
        resume (an in-flight update: each position computed once, its route row from that forward); otherwise they
        finish on the old weights first."""
        # clear_cache=false for keep too: vLLM 0.32 resets the caches *with* the running requests' KV on a pause
        # that clears them, whatever the mode (EngineCore._finish_pause -> _reset_caches(reset_running_requests)),
        # and the frozen requests would then be recomputed under the new weights
        params = {"mode": "keep" if keep else "wait", "clear_cache": "false"}
        self.all("/pause", "pause before the weight update", params=params)

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


@dataclass(frozen=True)
class Update:
    """One /update_weights of a sync: the engines' ``update_info`` and, for wires that carry the bytes beside the
    HTTP call (a broadcast), ``transmit``, run while the engines' request is in flight."""

    info: dict[str, Any]
    tensors: int
    nbytes: int
    transmit: Callable[[], None] | None = None


class Wire(ABC):
    """The data plane of one backend; ``TransferSender`` drives vLLM's protocol around it, the same for every wire.

    ``listen`` opens the sender's end before any engine is contacted; ``connect`` blocks until every engine worker
    has joined (``join`` watches the engines meanwhile); ``updates`` turns one bucket into the /update_weights calls
    that carry it. ``in_flight``: updates the engines may hold at once (1 when the next update reuses the previous
    one's buffer)."""

    backend: ClassVar[str]
    in_flight: ClassVar[int] = 2
    # every trainer rank sends its own part of each bucket (``send_owned``); else rank 0 sends whole buckets
    many_senders: ClassVar[bool] = False
    senders: int = 1

    def listen(self, world_size: int) -> None:
        """The sender's end of the rendezvous, before any engine waits on it (default: nothing to open)."""

    @abstractmethod
    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        """``init_info`` of /init_weight_transfer_engine for the engine whose first worker has ``rank_offset``."""

    def connect(self) -> None:
        """Join the engine workers (blocks until all have joined; default: no group to join)."""

    @abstractmethod
    def updates(self, bucket: list[tuple[str, Any]]) -> Iterator[Update]:
        """The /update_weights calls of one bucket (none for an empty one); the next is asked for once fewer than
        ``in_flight`` are unanswered."""

    def closing(self) -> Iterator[Update]:
        """The /update_weights calls after the last bucket (default: none)."""
        return iter(())

    def close(self) -> None:
        """Release the wire's group and buffers."""

    def endpoint(self) -> dict[str, Any]:
        """What the other trainer ranks need to join the group (after ``listen``; wires with one sender: nothing)."""
        return {}


class TransferSender:
    """Rank 0 of a weight-transfer group (or, for IPC, the rank that posts): vLLM's protocol over any ``Wire``.

    The group's first ``senders`` ranks are the trainer's (1 unless the wire lets every trainer rank send its own
    shards, ``send_owned``); the engine workers follow. With one sender the group is joined at construction; with
    more, the caller runs ``join_group`` while the other trainer ranks join at ``wire.endpoint()`` (all block until
    everyone has)."""

    def __init__(self, engines: EngineSet, wire: Wire, senders: int = 1):
        self.engines, self.wire = engines, wire
        sizes = engines.world_sizes()
        self._offsets = [senders + sum(sizes[:i]) for i in range(len(sizes))]
        self.world_size = senders + sum(sizes)
        wire.listen(self.world_size)  # a port taken or an address not ours fails here, before any engine waits on us
        if senders == 1:
            self.join_group()

    def join_group(self) -> None:
        payloads = [{"json": {"init_info": self.wire.init_info(off, self.world_size)}} for off in self._offsets]
        # the workers block in the rendezvous inside /init_weight_transfer_engine until the sender joins
        futures = self.engines.submit("/init_weight_transfer_engine", "joining the weight-transfer group", payloads)
        join(futures, self.engines.urls, self.wire.connect)

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

        /start_weight_update, then per update of each bucket /update_weights on every engine (with the wire's
        transmit while it is in flight), then the wire's closing updates, then /finish_weight_update. Pipelined:
        while the engines load one update the next is produced (at most ``wire.in_flight`` unanswered). The bucket
        iterator is always run to its end (the trainer's other ranks take part in producing it).
        """
        start = time.perf_counter()
        it = iter(buckets)
        count = 0
        totals = [0, 0, 0.0, 0.0]  # tensors, bytes, pack seconds, wire seconds
        pending: list = []
        try:
            self.engines.start_weight_update()
            for bucket in it:
                updates = self.wire.updates(bucket)
                del bucket
                self._pipe(updates, pending, totals)
                count += 1
            t2 = time.perf_counter()
            while pending:
                self.engines.wait(pending.pop(0))
            # only now: requests sent at once may reach an engine in either order, and the closing ones check that
            # every bucket arrived
            self._pipe(self.wire.closing(), pending, totals)
            while pending:
                self.engines.wait(pending.pop(0))
            load_tail = time.perf_counter() - t2
            self.engines.finish_weight_update(version)
        except BaseException:
            for _ in it:  # keep the other trainer ranks' sends matched, so the trainer stays usable
                pass
            raise
        tensors, nbytes, pack_s, wire_s = totals
        return SendStats(version, count, tensors, nbytes, time.perf_counter() - start, pack_s, wire_s, load_tail)

    def _pipe(self, updates: Iterator[Update], pending: list, totals: list) -> None:
        """Submit ``updates`` as /update_weights calls, at most ``wire.in_flight`` unanswered at once."""
        while True:
            while len(pending) >= self.wire.in_flight:  # the engines load one while the next is produced
                self.engines.wait(pending.pop(0))
            t0 = time.perf_counter()
            update = next(updates, None)
            if update is None:
                return
            t1 = time.perf_counter()
            pending.append(self.engines.submit("/update_weights", "receiving weights",
                                               json={"update_info": update.info}))
            if update.transmit is not None:
                # an engine joins this transmit only after answering the previous update, so waiting for that answer
                # costs nothing; and an update that failed is raised now, not after a transmit that nobody joins
                # has sat out its timeout
                while len(pending) > 1:
                    self.engines.wait(pending.pop(0))
                try:
                    update.transmit()
                except Exception as err:
                    self._name_failure([f for fs in pending for f in fs], err, "the weight transfer")
                    raise
            totals[0] += update.tensors
            totals[1] += update.nbytes
            totals[2] += t1 - t0
            totals[3] += time.perf_counter() - t1

    def close(self) -> None:
        self.wire.close()


def join(futures: list[Future], urls: Sequence[str], open_sender_end: Callable[[], Any]):
    """Rendezvous of the sender with every engine worker: ``open_sender_end`` (which blocks until all have joined)
    runs while the engines' /init_weight_transfer_engine requests are watched, so an engine that refuses (not started
    with ``--weight-transfer-config``, a bad init) or dies fails the join at once, naming it, instead of after the
    join timeout (after which ``open_sender_end`` gives up by itself). Returns what it returns."""
    mine: Future = Future()

    def run() -> None:
        try:
            mine.set_result(open_sender_end())
        except BaseException as err:  # noqa: BLE001  (handed to the caller through the future)
            mine.set_exception(err)

    # a daemon: after an engine refused, the sender's end may still wait for it until the join timeout, and that
    # wait must not hold the process at exit
    threading.Thread(target=run, name="r3rl-weight-transfer-join", daemon=True).start()
    pending = set(futures) | {mine}
    while pending:
        done, pending = wait(pending, return_when=FIRST_EXCEPTION)
        for f, url in zip(futures, urls):
            if f in done and f.exception() is not None:
                raise EngineError(f"engine {url} did not join the weight-transfer group: {f.exception()}",
                                  url=url) from f.exception()
        if mine in done and mine.exception() is not None:
            late = [url for f, url in zip(futures, urls) if not f.done()] or list(urls)
            raise EngineError(f"engine {', '.join(late)} did not join the weight-transfer group in time "
                              f"({type(mine.exception()).__name__}: {mine.exception()})",
                              url=late[0]) from mine.exception()
    return mine.result()


def send_owned(wire: Any, stream: Any, sender: TransferSender | None = None,
               version: int | str | None = None) -> SendStats | None:
    """One sync in which every trainer rank sends the part of each bucket it owns (run by every rank; rank 0 passes
    its ``sender`` and posts the updates). No rank gathers another's shards.

    ``stream`` is the trainer's ``HFBucketStream``: ``bucket_parts()`` says who owns what (the same on every rank),
    ``stream(dst=None)`` yields each rank its own part. Per bucket: every rank stages its part (``wire.stage``); rank
    0 waits until fewer than ``wire.in_flight`` updates are unanswered; all ranks agree (one small all-reduce: every
    rank still well, and which parts went by file); rank 0 posts the bucket's update naming each part's sender; every
    owner transmits its part. A failure anywhere stops the staging on every rank at the next bucket; the stream is
    still run to its end (its tensor-parallel gathers are collective) and each rank raises its own error after."""
    start = time.perf_counter()
    wire.begin()
    plan = stream.bucket_parts()
    error: BaseException | None = None
    pending: list = []
    totals = [0, 0, 0.0, 0.0]  # tensors, bytes, staging seconds, wire seconds
    count = 0

    def failed(err: BaseException) -> None:
        nonlocal error
        error = error or err

    if sender is not None:
        try:
            sender.engines.start_weight_update()
        except BaseException as err:  # noqa: BLE001  (raised after the other ranks were told)
            failed(err)
    ok, _ = agree(error is None, False, wire.senders)
    for parts, own in zip(plan, stream.stream(dst=None)):
        if not ok:
            continue  # drain: the other ranks' stream collectives stay matched
        t0 = time.perf_counter()
        staged, by_file = None, False
        try:
            staged, by_file = wire.stage(own)
        except BaseException as err:  # noqa: BLE001
            failed(err)
        t1 = time.perf_counter()
        mine = next((metas for owner, metas in parts if owner == wire.rank), [])
        if error is None and [n for n, _ in own] != [m.name for m in mine]:
            failed(RuntimeError(f"weight transfer: trainer rank {wire.rank} produced {[n for n, _ in own][:3]}... "
                                f"where the plan has {[m.name for m in mine][:3]}...; the ranks disagree on the plan"))
        if sender is not None and error is None:
            try:
                while len(pending) >= wire.in_flight:  # the engines load one while the next is staged
                    sender.engines.wait(pending.pop(0))
            except BaseException as err:  # noqa: BLE001
                failed(err)
        ok, files = agree(error is None, by_file, wire.senders)
        if not ok:
            continue
        t2 = time.perf_counter()
        if sender is not None:
            info = wire.part_info(parts, files)
            pending.append(sender.engines.submit("/update_weights", "receiving weights", json={"update_info": info}))
            count += 1
            totals[0] += len(info["names"])
            totals[1] += sum(m.nbytes for _, metas in parts for m in metas)
        try:
            wire.transmit(staged)
        except BaseException as err:  # noqa: BLE001
            if sender is not None:
                try:
                    sender._name_failure([f for fs in pending for f in fs], err, "the weight transfer")
                except EngineError as named:
                    err = named
            failed(err)
        totals[2] += t1 - t0
        totals[3] += time.perf_counter() - t2
    ok, _ = agree(error is None, False, wire.senders)
    if sender is None:
        if error is not None:
            raise error
        return None
    t3 = time.perf_counter()
    try:
        while pending:  # the engines' own errors first: they name the engine
            sender.engines.wait(pending.pop(0))
        if error is not None:
            raise error
        if not ok:
            raise RuntimeError("weight transfer: another trainer rank failed to send its part (its error is raised "
                               "by that rank)")
        sender._pipe(wire.closing(), pending, totals)
        while pending:
            sender.engines.wait(pending.pop(0))
        load_tail = time.perf_counter() - t3
        sender.engines.finish_weight_update(version)
    finally:
        for fs in pending:
            for f in fs:
                f.cancel()
    tensors, nbytes, stage_s, wire_s = totals
    return SendStats(version, count, tensors, nbytes, time.perf_counter() - start, stage_s, wire_s, load_tail)


def agree(ok: bool, by_file: bool, senders: int) -> tuple[bool, list[bool]]:
    """Across the trainer's ranks (its default process group): whether every rank is still well, and per rank
    whether it wrote its part to a file. One all-reduce of ``senders + 1`` numbers."""
    if senders == 1:
        return ok, [by_file]
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flags = torch.zeros(senders + 1, dtype=torch.int32, device=device)
    flags[0] = 0 if ok else 1
    flags[1 + rank] = int(by_file)
    dist.all_reduce(flags)
    flags = flags.tolist()
    return flags[0] == 0, [bool(f) for f in flags[1:]]
