"""Errors of the rollout side that a recipe is expected to catch and report."""

from __future__ import annotations

import httpx


class EngineError(RuntimeError):
    """A vLLM engine that failed to start, died, timed out or does not do what the config asks.

    The message names the engine URL and, for launched engines, ends with the tail of the server log.
    """

    def __init__(self, message: str, *, url: str | None = None, log_tail: str | None = None) -> None:
        self.url = url
        self.log_tail = log_tail
        text = message
        if log_tail:
            text += "\n--- last lines of the engine log ---\n" + log_tail.rstrip() + "\n--- end of engine log ---"
        super().__init__(text)


def engine_get(client: httpx.Client, url: str, path: str) -> httpx.Response:
    """GET one of an engine's routes; a failed request or a status other than 200 is an ``EngineError`` naming the
    engine and the route."""
    try:
        resp = client.get(f"{url}{path}")
    except httpx.HTTPError as err:
        raise EngineError(f"engine {url}: {path} failed: {err}", url=url) from err
    if resp.status_code != 200:
        raise EngineError(f"engine {url}: {path} answered HTTP {resp.status_code}", url=url)
    return resp
