"""The rollout client's timeout bounds an engine's silence, not a request's time in the engine's queue.

The engine here is a stand-in on loopback (aiohttp): vLLM's queueing of a step that does not fit its KV cache is what
it imitates, answering one request at a time. On the CPU profile a real engine decodes every request of these tests
at once, so the queue behind a full KV cache, a GPU-scale effect, cannot be caused for real here in bounded time.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from r3rl.rollout.client import RolloutClient
from r3rl.rollout.errors import EngineError
from r3rl.rollout.wire import GENERATE_PATH

PACE_S = 0.4  # the stand-in answers one request every PACE_S
TIMEOUT_S = 1.6  # the client's request_timeout_s: 4 paces


async def _serve(answer_every: float | None):
    """A loopback server on GENERATE_PATH answering its requests one after another, ``answer_every`` seconds each
    (None: never answers, a hung engine). Returns (runner, url)."""
    queue = asyncio.Lock()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        async with queue:
            if answer_every is None:
                await asyncio.Event().wait()
            await asyncio.sleep(answer_every)
        return web.Response(body=b"{}")

    app = web.Application()
    app.router.add_post(GENERATE_PATH, generate)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # the hung handler is cancelled at cleanup
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def _post_all(answer_every: float | None, requests: int) -> tuple[list, float]:
    runner, url = await _serve(answer_every)
    client = RolloutClient([url], num_layers=2, topk=2, num_experts=4, routing_replay=False,
                           request_timeout_s=TIMEOUT_S, progress=False)
    sessions = client.sessions()
    start = time.monotonic()
    try:
        results = await asyncio.gather(*(client._post(sessions[url], url, {}, f"sample {i}", f"r{i}")
                                         for i in range(requests)), return_exceptions=True)
        return results, time.monotonic() - start
    finally:
        await sessions[url].close()
        await runner.cleanup()


def test_requests_queued_behind_answered_ones_do_not_time_out():
    """8 requests to an engine that answers one per 0.4 s: the last waits ~3.2 s, twice request_timeout_s, and all
    succeed, because the engine answered something at least every 0.4 s. Fails if the timeout is a request's total
    time again (aiohttp's ClientTimeout(total=...)): the fifth and later requests would end the run."""
    results, elapsed = asyncio.run(_post_all(PACE_S, 8))
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert all(r == b"{}" for r in results)
    assert elapsed > 1.5 * TIMEOUT_S  # the later requests really waited past the timeout


def test_a_silent_engine_fails_after_the_timeout_naming_it():
    """An engine that answers none of its 3 requests: every request fails with an EngineError that names the
    engine, the request and the key, about request_timeout_s after they were sent (not never). Fails if the idle
    clock is never checked or reset by each new request to a busy engine."""
    results, elapsed = asyncio.run(_post_all(None, 3))
    assert all(isinstance(r, EngineError) for r in results), results
    message = str(results[0])
    assert "answered none of its" in message and "rollout.engine.request_timeout_s" in message
    assert "127.0.0.1" in message and "request r0" in message
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5
