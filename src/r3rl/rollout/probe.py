"""Does this engine do what the config asks? Checked at start-up, so a misconfigured server fails before the first
batch instead of after it: the vLLM version, the generate route, the dev-mode routes, and with routing replay one
short request whose routed experts must pass the full contract (rows, layers, top-k, range, distinct, non-zero).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import secrets

import httpx

from r3rl.config.schema import SamplingConfig
from r3rl.models.layers import hf_moe_layers
from r3rl.platform import version_tuple
from r3rl.rollout import auth
from r3rl.rollout.errors import EngineError
from r3rl.rollout.routed_experts import RouteSpec, RoutedExpertsError
from r3rl.rollout.wire import GENERATE_PATH, parse_response, request_body

# R3 over /inference/v1/generate needs vLLM PR #39568 (0.22); earlier builds return routes another way.
MIN_VLLM_VERSION = (0, 22)
PROBE_PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)  # ids every vocabulary has
PROBE_NEW_TOKENS = 4


@dataclass(frozen=True)
class ProbeReport:
    url: str
    version: str
    routing_replay: bool
    tokens: int
    route_rows: int | None
    route_dtype: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def check_engine(url: str, *, spec: RouteSpec | None, timeout_s: float = 120.0) -> ProbeReport:
    """Probe ``url``; ``spec`` None means routing replay is off (no routes required). Raises ``EngineError``."""
    url = url.rstrip("/")
    with httpx.Client(base_url=url, timeout=timeout_s, headers=auth.headers()) as client:
        try:
            resp = client.get("/version")
        except httpx.HTTPError as err:
            raise EngineError(f"engine {url} unreachable: {type(err).__name__}: {err}", url=url) from err
        if resp.status_code != 200:
            raise EngineError(f"engine {url}: /version answered HTTP {resp.status_code}; is it a vLLM server?",
                              url=url)
        version = str(resp.json().get("version", ""))
        if spec is not None and version_tuple(version) < MIN_VLLM_VERSION:
            need = ".".join(map(str, MIN_VLLM_VERSION))
            raise EngineError(f"engine {url}: vLLM {version} is too old for routing replay over {GENERATE_PATH} "
                              f"(needs >= {need})", url=url)
        paused = client.get("/is_paused")
        if paused.status_code == 404:
            raise EngineError(f"engine {url}: /is_paused not found; pause/resume and weight updates need "
                              "VLLM_SERVER_DEV_MODE=1 in the server's environment", url=url)
        if paused.status_code == 200 and paused.json().get("is_paused"):
            raise EngineError(f"engine {url} is paused; resume it (POST /resume) before a rollout", url=url)
        greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=PROBE_NEW_TOKENS, seed=0)
        rid = f"r3rl-probe-{secrets.token_hex(4)}"
        body = request_body(rid, PROBE_PROMPT, greedy, seed=0)
        body["sampling_params"]["ignore_eos"] = True  # a fixed length, whatever the model
        try:
            resp = client.post(GENERATE_PATH, json=body)
        except httpx.HTTPError as err:
            raise EngineError(f"engine {url}: probe request failed: {type(err).__name__}: {err}", url=url) from err
        if resp.status_code == 404:
            raise EngineError(f"engine {url}: {GENERATE_PATH} not found; the server needs --enable-scale-out",
                              url=url)
        if resp.status_code != 200:
            raise EngineError(f"engine {url}: probe request failed with HTTP {resp.status_code}: "
                              f"{resp.text[:1000]}", url=url)
        try:
            sample = parse_response(resp.json(), url=url, index=0, group=0, request_id=rid,
                                    prompt=PROBE_PROMPT, routes=spec)
        except RoutedExpertsError as err:
            raise EngineError(f"engine {url}: probe returned invalid routed experts: {err}", url=url) from err
    routes = sample.routed_experts
    return ProbeReport(url=url, version=version, routing_replay=spec is not None, tokens=sample.num_tokens,
                       route_rows=None if routes is None else int(routes.shape[0]),
                       route_dtype=None if routes is None else str(routes.dtype))


# read-only routes outside vLLM's --api-key guard (which covers /v1, /v2, /inference and /cohere only), plus one
# inside it: r3rl's middleware answers 401 on every one of them, so any other answer means it is not there
UNGUARDED_PROBES = ("/is_paused", "/weight_info", "/is_sleeping", "/version", "/v1/models")


def unguarded_routes(url: str, *, timeout_s: float = 30.0) -> dict[str, int]:
    """The probe routes ``url`` answers without a token (status other than 401: 200, or 404 for a route the server
    lacks, which only a server without r3rl's middleware returns), by path. Empty: the engine is guarded. Every
    probe is a GET with no side effect, so an open engine is found without being touched."""
    url = url.rstrip("/")
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        answers = {path: client.get(path).status_code for path in UNGUARDED_PROBES}
    return {path: status for path, status in answers.items() if status != 401}


def spec_from_checkpoint(model_dir: str | Path) -> RouteSpec | None:
    """Layers / top-k / experts from a local HF checkpoint's config.json; None when it cannot be read."""
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hf = hf.get("text_config", hf)
    experts = hf.get("num_experts", hf.get("num_local_experts", hf.get("n_routed_experts")))
    layers, topk = hf.get("num_hidden_layers"), hf.get("num_experts_per_tok")
    if not all(isinstance(v, int) for v in (layers, topk, experts)):
        return None
    try:
        moe = hf_moe_layers(hf)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return RouteSpec(num_layers=layers, topk=topk, num_experts=experts,
                     dense_layers=tuple(i for i in range(layers) if i not in moe))


def check_launched(url: str, argv: Sequence[str], *, timeout_s: float = 120.0) -> ProbeReport:
    """The start-up check of an engine we launched: its own command line says whether routes are expected, its
    checkpoint says their shape (the client checks again against the trainer's config)."""
    argv = list(argv)
    spec = None
    model = launched_model(argv)
    if "--enable-return-routed-experts" in argv and model is not None:
        spec = spec_from_checkpoint(model)
    return check_engine(url, spec=spec, timeout_s=timeout_s)


def launched_model(argv: Sequence[str]) -> str | None:
    """The checkpoint a server command line loads: ``vllm serve MODEL ...`` or ``... api_server --model MODEL``."""
    argv = list(argv)
    if argv[1:2] == ["serve"] and len(argv) > 2:
        return argv[2]
    if "--model" in argv[:-1]:
        return argv[argv.index("--model") + 1]
    return None
