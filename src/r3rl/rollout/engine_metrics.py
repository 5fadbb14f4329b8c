"""Counters from a vLLM engine's Prometheus ``/metrics`` (behind the run's engine token, like every other route).

vLLM preempts running requests when its KV cache runs short and recomputes them later. Under in-flight weight
updates a request preempted before an update and resumed after it is recomputed by the newer weights, while the
trainer replays the routes of its first forward: ``vllm:num_preemptions_total`` per batch says whether that could
have happened at all (the preflight refuses settings whose sequences outgrow the KV cache, ``r3rl.memory``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import httpx

from r3rl.rollout import auth
from r3rl.rollout.errors import engine_get

PREEMPTIONS = "vllm:num_preemptions_total"


def counter(text: str, name: str) -> float:
    """The sum of every sample of counter ``name`` (over its label sets) in a Prometheus text exposition; 0 when the
    engine exports none yet (vLLM registers a counter's samples on its first event)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def read_counter(urls: Sequence[str], name: str, *, timeout_s: float = 10.0) -> float:
    """Counter ``name`` summed over the engines at ``urls``; an engine that does not answer is an ``EngineError``
    naming it."""
    total = 0.0
    with httpx.Client(timeout=timeout_s, headers=auth.headers()) as client:
        for url in urls:
            total += counter(engine_get(client, url.rstrip("/"), "/metrics").text, name)
    return total


class PreemptionWindows:
    """The engines' preemptions attributed to the batch whose generation they fell in: the counter is read when a
    batch's generation starts and when it ends (``window``), not once a step. Read once a step, while the next batch
    already generates one step ahead, batch s+1's preemptions were logged at step s, and an eval's at the step after
    it. Where two batches generate at once (in flight, or a stream of groups: ``since_last``) no counter can tell
    whose a preemption was: the batch's count may hold the other's, and ``take`` says the window was shared."""

    def __init__(self, read: Callable[[], float]):
        self.read = read
        self.lock = threading.Lock()
        self.counts: dict[int, float] = {}
        self.open: dict[int, int] = {}  # step -> generations of it running now
        self.shared: set[int] = set()
        self.last = read()  # what an attached engine counted before this run is not this run's

    @contextmanager
    def window(self, step: int) -> Iterator[None]:
        """Around one generation of ``step``'s batch (a dynamic-sampling round adds to the batch's count)."""
        with self.lock:
            others = [s for s in self.open if s != step]
            if others:
                self.shared.update([step, *others])
            self.open[step] = self.open.get(step, 0) + 1
        before = self.read()
        try:
            yield
        finally:
            after = self.read()
            with self.lock:
                self.counts[step] = self.counts.get(step, 0.0) + after - before
                self.open[step] -= 1
                if not self.open[step]:
                    del self.open[step]
                self.last = after

    def since_last(self, step: int) -> None:
        """A stream's step: everything counted since the last reading is this step's, shared with the groups still
        generating (and with an eval point's requests, when one ran since)."""
        now = self.read()
        with self.lock:
            self.counts[step] = self.counts.get(step, 0.0) + now - self.last
            self.shared.add(step)
            self.last = now

    def take(self, step: int) -> tuple[float, bool]:
        """``step``'s preemptions and whether its window was shared with another batch's generation."""
        with self.lock:
            shared = step in self.shared
            self.shared.discard(step)
            return self.counts.pop(step, 0.0), shared
