"""``POST /inference/v1/generate``: the request body r3rl sends and the response -> ``Sample``.

Status comes from ``finish_reason`` before anything else (an aborted request legitimately lacks routes when it
produced no token); then tokens, log-probs, and with routing replay the routed experts, validated per the contract.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3rl.config.schema import SamplingConfig
from r3rl.rollout.errors import EngineError
from r3rl.rollout.routed_experts import RouteSpec, routes_for_sample
from r3rl.sample import Sample, SampleStatus

GENERATE_PATH = "/inference/v1/generate"
_MISSING = object()

_STATUS = {
    "stop": SampleStatus.COMPLETED,  # EOS or a stop token
    "repetition": SampleStatus.COMPLETED,  # the engine's repetition detector ended it: a real end of the response
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def sample_seed(base_seed: int, step: int, index: int) -> int:
    """Request ``index`` of step ``step`` (conf/rollout/vllm.yaml: ``seed + step * 100003 + index``)."""
    return base_seed + step * 100003 + index


def request_body(request_id: str, prompt: Sequence[int], sampling: SamplingConfig, seed: int,
                 stop_token_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                 n: int = 1, routes_from: int = 0, cache_salt: str | None = None,
                 adapter: str | None = None) -> dict[str, Any]:
    """One request for ``n`` samples of ``prompt``; vLLM seeds its ``j``-th sample with ``seed + j`` (its parallel
    sampling), so the samples are those of ``n`` one-sample requests seeded ``seed .. seed + n - 1``.
    ``routes_from``: the first route row the engine returns (vLLM's ``routed_experts_prompt_start``; a multi-turn
    episode's later turns hold the rows before it already). ``cache_salt``: vLLM shares prefix-cache blocks only
    between requests of the same salt. ``adapter``: the LoRA adapter the engine serves the request with (vLLM's
    ``model``; ``trainer.lora.sync=adapter``), None for its own weights."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens if max_tokens is None else max_tokens,
        "seed": seed,
        # 0: the log-prob of the sampled token only (the rollout log-prob the trainer compares against)
        "logprobs": 0,
        # token ids in, token ids out: no detokenization work on the server
        "detokenize": False,
    }
    if sampling.min_tokens:
        params["min_tokens"] = min(sampling.min_tokens, params["max_tokens"])
    if n > 1:
        params["n"] = n
    if stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if routes_from:
        params["routed_experts_prompt_start"] = int(routes_from)
    body = {"request_id": request_id, "token_ids": [int(t) for t in prompt], "sampling_params": params}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if adapter is not None:
        body["model"] = adapter
    return body


def samples_named(first: int, count: int) -> str:
    """How errors name the samples of one request: ``sample 3`` or ``samples 8-15``."""
    return f"sample {first}" if count == 1 else f"samples {first}-{first + count - 1}"


def status_from_finish_reason(finish_reason: object, *, url: str, index: int, request_id: str) -> SampleStatus:
    status = _STATUS.get(finish_reason) if isinstance(finish_reason, str) else None
    if status is None:
        raise EngineError(f"engine {url}: sample {index} (request {request_id}) finished with finish_reason="
                          f"{finish_reason!r}; expected one of {sorted(_STATUS)}", url=url)
    return status


# the label vLLM gives the weights it started with, before any update was labelled
INITIAL_WEIGHT_LABEL = "default"


def foreign_weight_labels(labels: Mapping[str, object]) -> dict[str, object]:
    """Engine URL -> its weight label, for the engines whose weights some update labelled (anything but vLLM's
    initial label): at a fresh run's start they serve weights that are not the run's checkpoint."""
    return {url: label for url, label in labels.items() if label != INITIAL_WEIGHT_LABEL}


def version_of_label(label: object, url: str, what: str = "weights") -> int | None:
    """The step number of a weight label (``None`` for vLLM's initial label: the checkpoint's weights, version 0).
    Anything else is an error naming the engine: a guessed version would mis-state every sample's staleness."""
    if label == INITIAL_WEIGHT_LABEL:
        return None
    # isdecimal() and ASCII: "²" is a digit to isdigit() but no int; 18 digits: a step count, never a number past
    # Python's int-string limit
    if isinstance(label, str) and label.isascii() and label.isdecimal() and len(label) <= 18:
        return int(label)
    raise EngineError(f"engine {url}: {what} labelled weight version {label!r:.60}; r3rl labels the weights it sends "
                      f"with its step number (or vLLM's {INITIAL_WEIGHT_LABEL!r} before the first update): was the "
                      "engine updated by another process?", url=url)


def _weight_version(spans: object, num_tokens: int, url: str, bad) -> int | None:
    """The oldest weight version that produced a token of the response (``None``: the initial weights)."""
    if num_tokens == 0 and not spans:
        return None
    if not isinstance(spans, list) or not spans or not all(isinstance(s, dict) and "version" in s for s in spans):
        raise bad(f"weight_versions is {spans!r} for {num_tokens} response tokens; expected the spans of the weight "
                  "versions that generated them (vLLM reports them on every finished response)")
    try:
        versions = [version_of_label(s["version"], url, "response tokens") for s in spans]
    except EngineError as err:
        raise bad(str(err).removeprefix(f"engine {url}: ")) from None
    return min((v or 0 for v in versions), default=None) if any(v is not None for v in versions) else None


_MAX_TOKEN_ID = 2 ** 31 - 1  # token ids travel as int32 (Sample.response_ids)


def _token_ids(tokens: object, bad) -> np.ndarray:
    """The response's token ids, each an int in int32's range: NumPy would parse a string, truncate a float and
    raise its own OverflowError past int32, none of which names the sample."""
    if tokens is None:
        tokens = []
    if not isinstance(tokens, list):
        raise bad(f"token_ids is a {type(tokens).__name__}; expected a list of token ids")
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t <= _MAX_TOKEN_ID:
            raise bad(f"response token {i} is {t!r:.40} ({type(t).__name__}); expected a token id in "
                      f"[0, {_MAX_TOKEN_ID}]")
    return np.asarray(tokens, dtype=np.int32)


def _logprobs(content: list, bad) -> np.ndarray:
    """The sampled tokens' log-probs, each a finite number: a missing, null or NaN value would reach the
    importance ratio of the loss unnoticed (NumPy turns ``None`` into NaN and parses strings)."""
    values = []
    for i, entry in enumerate(content):
        value = entry.get("logprob", _MISSING) if isinstance(entry, dict) else _MISSING
        # bool is an int subclass but no log-prob; JSON numbers arrive as float or int
        if type(value) not in (float, int):
            what = ("missing" if value is _MISSING else "null" if value is None
                    else f"{value!r} ({type(value).__name__})")
            raise bad(f"log-prob of response token {i} is {what}; expected a finite number")
        values.append(value)
    # float64 first: an int past float range (JSON allows 10**400) raises OverflowError only when converted one by
    # one, and a value past float32's range becomes inf, caught below
    finite = [v if type(v) is float or abs(v) < 1e300 else float("inf") for v in values]
    out = np.asarray(finite, dtype=np.float64).astype(np.float32)
    bad_at = np.flatnonzero(~np.isfinite(out))
    if bad_at.size:
        i = int(bad_at[0])
        raise bad(f"log-prob of response token {i} is {values[i]!r}; expected a finite number")
    return out


def samples_from_body(raw: bytes, *, url: str, first_index: int, count: int, request_id: str,
                      **kwargs: Any) -> list[Sample]:
    """The raw response body -> ``Sample``s: JSON parsing, then ``parse_choices`` (the CPU-heavy part of a
    response, run in a worker thread by the client when the body is large)."""
    named = samples_named(first_index, count)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bytes that are not UTF-8, integers past the
        # int-string limit, nesting past the recursion limit
        raise EngineError(f"engine {url}: {named} (request {request_id}): response is not JSON ({err}): "
                          f"{raw[:200]!r}", url=url) from None
    if not isinstance(body, dict):
        raise EngineError(f"engine {url}: {named} (request {request_id}): response is a JSON "
                          f"{type(body).__name__}, expected an object", url=url)
    return parse_choices(body, url=url, first_index=first_index, count=count, request_id=request_id, **kwargs)


def parse_response(body: dict[str, Any], *, url: str, index: int, request_id: str, **kwargs: Any) -> Sample:
    """One one-sample ``/inference/v1/generate`` response -> ``Sample``."""
    return parse_choices(body, url=url, first_index=index, count=1, request_id=request_id, **kwargs)[0]


def parse_choices(body: dict[str, Any], *, url: str, first_index: int, count: int, group: int, request_id: str,
                  prompt: Sequence[int], routes: RouteSpec | None, label: str | None = None,
                  routes_from: int = 0) -> list[Sample]:
    """A response to a request for ``count`` samples -> one ``Sample`` per choice: choice ``j`` is sample
    ``first_index + j`` (routes decoded and validated when ``routes``; with ``routes_from``, the rows from that one
    on only)."""
    choices = body.get("choices")
    got = len(choices) if isinstance(choices, list) else None
    indices = [c.get("index") if isinstance(c, dict) else None for c in choices] if got == count else None
    if indices is None or not all(type(j) is int for j in indices) or sorted(indices) != list(range(count)):
        detail = "" if indices is None else f" with indices {indices}"
        raise EngineError(f"engine {url}: {samples_named(first_index, count)} (request {request_id}): expected "
                          f"exactly {count} choice{'s' if count > 1 else ''} indexed 0..{count - 1}, got {got}{detail}",
                          url=url)
    by_index = sorted(choices, key=lambda c: c["index"])
    samples = [_sample_from_choice(c, url=url, index=first_index + j, group=group, request_id=request_id,
                                   prompt=prompt, routes=routes, label=label, routes_from=routes_from)
               for j, c in enumerate(by_index)]
    cached = cached_prompt_tokens(body)
    for s in samples:
        s.extra["cached_tokens"] = cached
    return samples


def cached_prompt_tokens(body: dict[str, Any]) -> int | None:
    """The prompt tokens vLLM took from its prefix cache (``usage.prompt_tokens_details.cached_tokens``, sent by
    an engine started with ``--enable-prompt-tokens-details``); ``None`` when the engine did not say."""
    usage = body.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else None


def _sample_from_choice(choice: dict[str, Any], *, url: str, index: int, group: int, request_id: str,
                        prompt: Sequence[int], routes: RouteSpec | None, label: str | None,
                        routes_from: int = 0) -> Sample:
    def bad(what: str) -> EngineError:
        return EngineError(f"engine {url}: sample {index} (request {request_id}): {what}", url=url)

    status = status_from_finish_reason(choice.get("finish_reason"), url=url, index=index, request_id=request_id)
    response_ids = _token_ids(choice.get("token_ids"), bad)
    logprobs_field = choice.get("logprobs") or {}
    content = (logprobs_field.get("content") if isinstance(logprobs_field, dict) else None) or []
    if not isinstance(content, list) or len(content) != len(response_ids):
        got = len(content) if isinstance(content, list) else type(content).__name__
        raise bad(f"log-probs for {got} tokens, expected {len(response_ids)} (one per response token)")
    logprobs = _logprobs(content, bad)
    routed = None
    if routes is not None:
        routed = routes_for_sample(choice.get("routed_experts"), aborted=status is SampleStatus.ABORTED,
                                   prompt_len=len(prompt), response_len=len(response_ids), spec=routes,
                                   sample_index=index, request_id=request_id, first_row=routes_from)
    # an aborted sample is kept only to be dropped or regenerated: nothing of it is trainable
    mask_value = 0.0 if status is SampleStatus.ABORTED else 1.0
    spans = choice.get("weight_versions")
    return Sample(
        index=index, group=group, request_id=request_id,
        prompt_ids=np.asarray(prompt, dtype=np.int32), response_ids=response_ids,
        rollout_logprobs=logprobs, loss_mask=np.full(len(response_ids), mask_value, dtype=np.float32),
        finish_reason=str(choice.get("finish_reason")), status=status, routed_experts=routed, label=label,
        weight_version=_weight_version(spans, len(response_ids), url, bad),
        extra={"engine": url, "stop_reason": choice.get("stop_reason"), "weight_versions": spans},
    )
