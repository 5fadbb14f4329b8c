"""The rollout client: prompts in, validated ``Sample``s out, over one or more vLLM engines.

Requests go to ``/inference/v1/generate`` with bounded concurrency per engine (``max_concurrency`` samples in
flight); a prompt's samples go to the same engine in one request (vLLM's ``n``; they share the prompt's prefix
cache). Seeds are a function of (step, sample index), so a rollout is reproducible whatever the engine count or
the order requests finish in; an aborted sample goes again alone with its own seed.

Ending a rollout early: ``pause_abort()`` pauses every engine with ``mode=abort`` (requests in flight come back
``finish_reason="abort"``) and waits until they are all back; ``resume()`` restarts the engines. Aborted samples
are never returned as trainable: with ``on_abort="regenerate"`` (default) they are sent again after the resume,
with ``on_abort="drop"`` they (and samples not yet sent) are left out of the result.

Weights updated under requests in flight (``r3rl.sync.disk.update_weights_from_hf(in_flight=True)``,
``EngineSet.pause(keep=True)``) leave the prefix cache as it is: its blocks are held by those requests. After such an
update the recipe calls ``serve_version``: every request sent from then on carries the version as its
``cache_salt``, so it never reuses a block computed under older weights, and a sample counts as of the version its
request was sent under when that is older than its tokens' (its prompt may have been prefilled from that version's
blocks).

A request has no deadline of its own: vLLM queues what its KV cache cannot hold, so the last requests of a step
sent at once wait for whole decodes before they start. ``request_timeout_s`` bounds how long an engine with
requests in flight may go without answering any of them: a request fails only when its engine stopped answering.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Sequence
from typing import Literal

import aiohttp
import httpx
from tqdm.auto import tqdm

from r3rl.config.schema import SamplingConfig
from r3rl.rollout import auth
from r3rl.rollout.errors import EngineError
from r3rl.rollout.routed_experts import RouteSpec
from r3rl.rollout.wire import GENERATE_PATH, request_body, sample_seed, samples_from_body, samples_named
from r3rl.sample import Sample, SampleStatus

OnAbort = Literal["regenerate", "drop"]

# A response smaller than this is parsed on the event loop: a worker thread per sample costs more than the parse
# (with 128 short samples in flight the thread hand-offs took a sixth of the client's time, bench/cpu_rollout.py)
_PARSE_INLINE_BYTES = 256 * 1024

# vLLM's _SAMPLING_EPS: a request with a lower temperature is greedy
_GREEDY_BELOW = 1e-5

# Samples finish in bursts (the engine decodes a batch together), so a rate or an ETA taken from the first ones is
# far off (it read 1:23 for a rollout of about 17 s): the bar shows the count and the elapsed time only.
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]"


async def all_or_cancel(coroutines) -> list:
    """The coroutines' results, in order; the first exception cancels the others, and no task outlives the call."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def rollout_bar(total: int, step: int, *, enabled: bool, file=None, desc: str | None = None) -> tqdm:
    """The progress bar of one rollout: samples done out of ``total``, no extrapolation."""
    return tqdm(total=total, desc=desc or f"rollout step {step}", unit="sample", disable=not enabled, leave=False,
                bar_format=_BAR_FORMAT, file=file)


class RolloutClient:
    def __init__(self, urls: Sequence[str], *, num_layers: int, topk: int, num_experts: int, routing_replay: bool,
                 max_concurrency: int = 64, request_timeout_s: float = 600.0, on_abort: OnAbort = "regenerate",
                 progress: bool = True, max_num_seqs: int | None = None, dense_layers: Sequence[int] = ()) -> None:
        if not urls:
            raise ValueError("RolloutClient needs at least one engine URL")
        if on_abort not in ("regenerate", "drop"):
            raise ValueError(f"on_abort={on_abort!r}: expected 'regenerate' or 'drop'")
        self.urls = [u.rstrip("/") for u in urls]
        self.spec = RouteSpec(num_layers=num_layers, topk=topk, num_experts=num_experts,
                              dense_layers=tuple(dense_layers))
        self.routing_replay = routing_replay
        self.max_concurrency = max_concurrency
        # the engines' --max-num-seqs: vLLM refuses a request whose n exceeds it (HTTP 400)
        self.max_num_seqs = max_num_seqs
        self.request_timeout_s = request_timeout_s
        self.on_abort = on_abort
        self.progress = progress
        # request ids must be unique among everything in flight on a server, also across clients and restarts
        self._nonce = secrets.token_hex(3)
        self._running: asyncio.Event | None = None
        self._aborting = False
        self._in_flight = 0
        self._drained: asyncio.Event | None = None
        # per engine: requests in flight, and when it last answered one (or went busy, or was resumed)
        self._busy: dict[str, int] = dict.fromkeys(self.urls, 0)
        self._answered_at: dict[str, float] = dict.fromkeys(self.urls, time.monotonic())
        # the weight version requests are sent under once updates happen in flight (serve_version); None: the
        # engines' prefix cache is reset at every update instead, and requests carry no salt
        self.sent_version: int | None = None
        # the LoRA adapter requests name (trainer.lora.sync=adapter: the engines serve each version's adapters under
        # a name of its own, r3rl.sync.adapter); None: the engines' own weights
        self.adapter: str | None = None

    def serve_version(self, version: int, adapter: str | None = None) -> None:
        """From now on the engines serve weight ``version``, updated in flight or as the LoRA ``adapter`` requests
        name: requests carry it as their ``cache_salt`` and their samples count as no newer than it (see the module
        docstring)."""
        self.sent_version = version
        self.adapter = adapter

    @property
    def cache_salt(self) -> str | None:
        return None if self.sent_version is None else f"r3rl-weights-{self.sent_version}"

    def _as_sent(self, samples: list[Sample], version: int | None) -> list[Sample]:
        """``samples`` counted as no newer than the version their request was sent under (``None``: no salt)."""
        if version is not None:
            for s in samples:
                s.extra["sent_version"] = version
                if s.response_length and (s.weight_version or 0) > version:
                    s.weight_version = version
        return samples

    @classmethod
    def from_config(cls, cfg, urls: Sequence[str], **kwargs) -> RolloutClient:
        """From a validated ``R3RLConfig`` (model shape, rollout.routing_replay, rollout.engine limits)."""
        from r3rl.config.families import dense_layers
        from r3rl.config.modes import engine_concurrency

        m, eng = cfg.model, cfg.rollout.engine
        kwargs.setdefault("max_concurrency", engine_concurrency(cfg))
        kwargs.setdefault("request_timeout_s", eng.request_timeout_s)
        kwargs.setdefault("max_num_seqs", eng.max_num_seqs)
        return cls(urls, num_layers=m.num_layers, topk=m.moe_topk, num_experts=m.num_experts,
                   dense_layers=dense_layers(m), routing_replay=cfg.rollout.routing_replay, **kwargs)

    # -- generation ---------------------------------------------------------------------------------------------
    async def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *, step: int = 0,
                       stop_token_ids: Sequence[int] | None = None, labels: Sequence[str | None] | None = None,
                       max_tokens: Sequence[int] | None = None, progress_label: str | None = None,
                       first_engine: int = 0) -> list[Sample]:
        """``n`` samples per prompt; sample ``i = prompt * n + j`` has ``group = prompt`` and seed
        ``sampling.seed + step * 100003 + i``, and goes to engine ``(first_engine + prompt) % engines``.
        ``max_tokens`` optionally caps each prompt separately; ``progress_label`` names the progress bar (default
        ``rollout step <step>``)."""
        if labels is not None and len(labels) != len(prompts):
            raise ValueError(f"labels: expected {len(prompts)} (one per prompt), got {len(labels)}")
        if max_tokens is not None and len(max_tokens) != len(prompts):
            raise ValueError(f"max_tokens: expected {len(prompts)} (one per prompt), got {len(max_tokens)}")
        self._ensure_loop_state()
        routes = self.spec if self.routing_replay else None
        # aiohttp, not httpx, for the requests of a rollout: with 128 requests in flight httpx's connection pool
        # (a scan of every connection per request) and request building cost more CPU than the engine's decoding,
        # and the engine waited for its requests (bench/cpu_rollout.py: 1294 -> 2939 tokens/s with aiohttp)
        clients = self.sessions()
        # One request per prompt for its n samples (vLLM seeds sample j with seed + j, the seeds of one-sample
        # requests): 8x fewer requests than one per sample, whose handling in the API server and here kept the CPU
        # engine waiting (bench/cpu_rollout.py). A request holds at most max_concurrency samples.
        # vLLM refuses n > 1 for a greedy request (temperature below its _SAMPLING_EPS): those go one by one; and
        # n above the engine's max_num_seqs: those go in chunks it takes (the seeds are the same either way)
        chunk = 1 if sampling.temperature < _GREEDY_BELOW else \
            max(1, min(n, self.max_concurrency, self.max_num_seqs or n))
        gates = {u: asyncio.Semaphore(max(1, self.max_concurrency // chunk)) for u in self.urls}
        bar = rollout_bar(len(prompts) * n, step, enabled=self.progress, desc=progress_label)

        async def request(group: int, start: int, count: int, attempt: int) -> list[Sample]:
            """Samples ``start .. start + count - 1`` of ``group``; aborted ones again one by one, or dropped."""
            url = self.urls[(first_engine + group) % len(self.urls)]
            prompt = prompts[group]
            first = group * n + start
            while True:
                if self._aborting and self.on_abort == "drop":
                    return []
                assert self._running is not None
                await self._running.wait()
                rid = self.request_id(f"s{step}-{first}{f'x{count}' if count > 1 else ''}-a{attempt}")
                async with gates[url]:
                    if not self._running.is_set():
                        continue  # paused while waiting for a slot: never send into a paused engine
                    sent = self.sent_version
                    body = request_body(rid, prompt, sampling, sample_seed(sampling.seed, step, first),
                                        stop_token_ids, None if max_tokens is None else max_tokens[group], n=count,
                                        cache_salt=self.cache_salt, adapter=self.adapter)
                    raw = await self._post(clients[url], url, body, samples_named(first, count), rid)
                break
            # A long response off the event loop: a 32K-token one is a 17 MB JSON string (~20 ms to parse) plus
            # ~4 ms of routes decode; in a worker thread the loop keeps reading other responses (the decode
            # releases the GIL, and the parse yields it every switch interval instead of holding the loop).
            parse = functools.partial(samples_from_body, raw, url=url, first_index=first, count=count, group=group,
                                      request_id=rid, prompt=prompt, routes=routes,
                                      label=None if labels is None else labels[group])
            samples = self._as_sent(await asyncio.to_thread(parse) if len(raw) > _PARSE_INLINE_BYTES else parse(),
                                    sent)
            kept = [s for s in samples if s.status is not SampleStatus.ABORTED]
            bar.update(len(kept))
            aborted = [s.index - group * n for s in samples if s.status is SampleStatus.ABORTED]
            if not aborted or self.on_abort == "drop":
                return kept
            again = await all_or_cancel(request(group, j, 1, attempt + 1) for j in aborted)
            return kept + [s for batch in again for s in batch]

        try:
            batches = await all_or_cancel(request(p, start, min(chunk, n - start), 0)
                                           for p in range(len(prompts)) for start in range(0, n, chunk))
            return sorted((s for batch in batches for s in batch), key=lambda s: s.index)
        finally:
            bar.close()
            await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

    # -- one request of a multi-turn episode (r3rl.env.episodes drives the turns) ---------------------------------
    def request_id(self, name: str) -> str:
        """A request id unique among everything in flight on the servers: this client's nonce and ``name``."""
        return f"r3rl-{self._nonce}-{name}"

    def sessions(self) -> dict[str, aiohttp.ClientSession]:
        """One HTTP session per engine for the requests of a rollout or a batch of episodes; the caller closes
        them."""
        self._ensure_loop_state()
        # no total: a request may wait in the engine's queue for as long as the engine answers others (_post)
        timeout = aiohttp.ClientTimeout(total=None, connect=30.0)
        return {u: aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                                         headers=auth.headers())
                for u in self.urls}

    async def turn(self, sessions: dict[str, aiohttp.ClientSession], url: str, context: Sequence[int],
                   sampling: SamplingConfig, *, seed: int, index: int, group: int, request_id: str,
                   max_tokens: int, routes_from: int = 0, stop_token_ids: Sequence[int] | None = None) -> Sample:
        """One turn of sample ``index``: ``context`` (every token so far, as ids) in, one validated ``Sample`` out,
        whose routes are the rows from ``routes_from`` on (``None`` when the engine aborted it before any token).
        Waits while the engines are paused; an aborted turn comes back with status ``ABORTED``."""
        assert self._running is not None
        await self._running.wait()  # never send into a paused engine
        sent = self.sent_version
        body = request_body(request_id, context, sampling, seed, stop_token_ids, max_tokens, routes_from=routes_from,
                            cache_salt=self.cache_salt, adapter=self.adapter)
        raw = await self._post(sessions[url], url, body, f"sample {index}", request_id)
        parse = functools.partial(samples_from_body, raw, url=url, first_index=index, count=1, group=group,
                                  request_id=request_id, prompt=context,
                                  routes=self.spec if self.routing_replay else None, routes_from=routes_from)
        (sample,) = self._as_sent(await asyncio.to_thread(parse) if len(raw) > _PARSE_INLINE_BYTES else parse(), sent)
        return sample

    def generate_sync(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig,
                      **kwargs) -> list[Sample]:
        """``generate`` from synchronous code (runs its own event loop)."""
        self._running = None  # the events belong to a loop; a new loop gets new ones
        try:
            return asyncio.run(self.generate(prompts, n, sampling, **kwargs))
        finally:
            self._running = None

    async def _post(self, client: aiohttp.ClientSession, url: str, body: dict, named: str, rid: str) -> bytes:
        self._in_flight += 1
        if self._busy[url] == 0:  # the engine's idle clock starts when it gets work
            self._answered_at[url] = time.monotonic()
        self._busy[url] += 1
        try:
            status, content = await self._answer_or_engine_idle(client, url, body, named, rid)
        except asyncio.TimeoutError as err:  # aiohttp's connect timeout
            raise EngineError(f"engine {url}: {named} (request {rid}) could not connect within 30s "
                              f"({type(err).__name__})", url=url) from err
        except aiohttp.ClientError as err:
            raise EngineError(f"engine {url} failed during {named} (request {rid}): "
                              f"{type(err).__name__}: {err or 'connection lost'} (did the server die?)",
                              url=url) from err
        finally:
            self._busy[url] -= 1
            self._in_flight -= 1
            if self._in_flight == 0 and self._drained is not None:
                self._drained.set()
        if status == 404:
            raise EngineError(f"engine {url}: {GENERATE_PATH} not found; the server needs --enable-scale-out "
                              "(r3rl.plan adds it)", url=url)
        if status != 200:
            raise EngineError(f"engine {url}: {named} (request {rid}) failed with HTTP {status}: "
                              f"{content[:2000].decode(errors='replace')}", url=url)
        return content

    async def _answer_or_engine_idle(self, client: aiohttp.ClientSession, url: str, body: dict, named: str,
                                     rid: str) -> tuple[int, bytes]:
        """The request's (status, body), or EngineError once ``url`` has answered none of its requests in flight for
        ``request_timeout_s`` (the request is cancelled: vLLM aborts a request whose connection closes)."""

        async def send() -> tuple[int, bytes]:
            async with client.post(f"{url}{GENERATE_PATH}", json=body) as resp:
                return resp.status, await resp.read()

        task = asyncio.create_task(send())
        try:
            while True:
                idle = time.monotonic() - self._answered_at[url]
                if idle >= self.request_timeout_s:
                    raise EngineError(f"engine {url}: {named} (request {rid}) got no answer, and the engine answered "
                                      f"none of its {self._busy[url]} request(s) in flight for {idle:.0f}s "
                                      f"(rollout.engine.request_timeout_s={self.request_timeout_s:g}): is it hung?",
                                      url=url)
                done, _ = await asyncio.wait({task}, timeout=self.request_timeout_s - idle)
                if done:
                    answer = task.result()
                    self._answered_at[url] = time.monotonic()
                    return answer
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # -- ending a rollout early ---------------------------------------------------------------------------------
    def _ensure_loop_state(self) -> None:
        if self._running is None:
            self._running = asyncio.Event()
            self._running.set()
            self._drained = asyncio.Event()

    async def pause_abort(self) -> None:
        """Pause every engine with ``mode=abort`` and wait until the requests in flight have come back."""
        self._ensure_loop_state()
        assert self._running is not None and self._drained is not None
        self._aborting = True
        self._running.clear()
        self._drained.clear()
        if self._in_flight == 0:
            self._drained.set()
        await self._control("/pause", params={"mode": "abort"})
        # A request that reached a server just after its pause is held there until /resume; abort those too
        # (they come back aborted with no tokens), or the drain would wait forever.
        while True:
            try:
                await asyncio.wait_for(self._drained.wait(), timeout=1.0)
                return
            except asyncio.TimeoutError:
                await self._control("/abort_requests", json={})

    async def resume(self) -> None:
        """Resume every engine; regenerated samples go out again."""
        self._ensure_loop_state()
        assert self._running is not None
        await self._control("/resume")
        self._aborting = False
        self._answered_at = dict.fromkeys(self.urls, time.monotonic())  # a paused engine was not idle
        self._running.set()

    async def _control(self, path: str, params: dict | None = None, json: dict | None = None) -> None:
        async with httpx.AsyncClient(timeout=60.0, headers=auth.headers()) as client:
            for url in self.urls:
                try:
                    resp = await client.post(f"{url}{path}", params=params, json=json)
                except httpx.HTTPError as err:
                    raise EngineError(f"engine {url}: {path} failed: {type(err).__name__}: {err}", url=url) from err
                if resp.status_code != 200:
                    raise EngineError(f"engine {url}: {path} answered HTTP {resp.status_code} ({resp.text[:500]}); "
                                      "pause/resume need VLLM_SERVER_DEV_MODE=1", url=url)

    # -- start-up check -----------------------------------------------------------------------------------------
    async def check_engines(self, *, timeout_s: float = 120.0) -> list[dict]:
        """Probe every engine (version, and with routing replay one request with valid routes); raises EngineError."""
        from r3rl.rollout.probe import check_engine

        spec = self.spec if self.routing_replay else None
        reports = await asyncio.gather(*(asyncio.to_thread(check_engine, url, spec=spec, timeout_s=timeout_s)
                                         for url in self.urls))
        return [r.as_dict() for r in reports]

    def check_engines_sync(self, *, timeout_s: float = 120.0) -> list[dict]:
        return asyncio.run(self.check_engines(timeout_s=timeout_s))
