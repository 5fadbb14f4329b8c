"""Errors of the rollout side that a recipe is expected to catch and report."""

from __future__ import annotations


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
