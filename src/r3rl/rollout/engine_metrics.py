"""Counters from a vLLM engine's Prometheus ``/metrics`` (behind the run's engine token, like every other route).

vLLM preempts running requests when its KV cache runs short and recomputes them later. Under in-flight weight
updates a request preempted before an update and resumed after it is recomputed by the newer weights, while the
trainer replays the routes of its first forward: ``vllm:num_preemptions_total`` per step says whether that could
have happened at all (the preflight refuses settings whose sequences outgrow the KV cache, ``r3rl.memory``).
"""

from __future__ import annotations

from collections.abc import Sequence

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
