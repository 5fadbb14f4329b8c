"""Engine side of a weight update: after each training step the engine must serve the trainer's new weights.

``update_weights_from_hf`` drains the engine (``/pause?mode=wait``: requests in flight finish on the old weights),
has every worker load the HF safetensors folder through r3rl's worker extension (which re-runs the layers'
post-load processing; see ``worker_extension``), drops the prefix cache (its KV *and routed experts* were computed
by the old weights), labels the weights with ``version`` (responses report it per token span) and resumes.
``in_flight=True`` updates under the requests in flight instead (``/pause?mode=keep``: they freeze with their KV
cache and continue on the new weights after ``/resume``, each position computed once); the prefix cache then
cannot be reset (those requests hold its blocks), and new requests keep off the older blocks by their
``cache_salt`` (``r3rl.rollout.client``: the version they were sent under).
``weight_checksums`` (vLLM's ``/weight_checker``) proves what the engine holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from r3rl.rollout import auth
from r3rl.rollout.errors import EngineError, engine_get

UPDATE_METHOD = "r3rl_update_weights_from_hf"


@dataclass(frozen=True)
class WeightUpdate:
    url: str
    version: int
    workers: list[dict[str, Any]]  # per worker: tensors loaded, MoE layers re-processed
    seconds: float


def post_dev_route(client: httpx.Client, url: str, path: str, what: str, *,
                   needs: str = "VLLM_SERVER_DEV_MODE=1", **kwargs: Any) -> httpx.Response:
    """POST to one of vLLM's dev routes; any failure is an EngineError naming the engine and what was being done
    (``needs``: what the server must have been started with for ``path`` to exist)."""
    try:
        resp = client.post(f"{url}{path}", **kwargs)
    except httpx.HTTPError as err:
        raise EngineError(f"engine {url}: {what} failed: {type(err).__name__}: {err}", url=url) from err
    if resp.status_code == 404:
        raise EngineError(f"engine {url}: {path} not found; {what} needs {needs} on the server", url=url)
    if resp.status_code != 200:
        raise EngineError(f"engine {url}: {what} failed with HTTP {resp.status_code}: {resp.text[:2000]}", url=url)
    return resp


def update_weights_from_hf(url: str, hf_dir: Path, version: int, *, timeout_s: float = 900.0,
                           in_flight: bool = False) -> WeightUpdate:
    """Load ``hf_dir`` (HF-format ``*.safetensors`` of the served architecture) into the engine at ``url``
    (``in_flight``: under the requests in flight; see the module docstring)."""
    import time

    hf_dir = Path(hf_dir).resolve()
    if not any(hf_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"update_weights_from_hf: no *.safetensors in {hf_dir}")
    url = url.rstrip("/")
    start = time.perf_counter()
    with httpx.Client(timeout=timeout_s, headers=auth.headers()) as client:
        # keep: never clear_cache, which in vLLM 0.32 also drops the frozen requests' KV (EngineSet.pause)
        post_dev_route(client, url, "/pause", "pause before the weight update",
                       params={"mode": "keep", "clear_cache": False} if in_flight else
                       {"mode": "wait", "clear_cache": True})
        try:
            resp = post_dev_route(client, url, "/collective_rpc", "loading the new weights",
                         json={"method": UPDATE_METHOD, "args": [str(hf_dir)], "timeout": timeout_s})
            workers = resp.json().get("results") or []
            if not workers or not all(isinstance(w, dict) and w.get("tensors", 0) > 0 for w in workers):
                raise EngineError(f"engine {url}: weight update from {hf_dir} loaded nothing: {workers}", url=url)
            ok = {"success": True} if in_flight else \
                post_dev_route(client, url, "/reset_prefix_cache", "resetting the prefix cache").json()
            if not ok.get("success", False):
                raise EngineError(f"engine {url}: prefix cache not reset after the weight update ({ok}); cached "
                                  "prefixes would serve KV and routes of the old weights", url=url)
            post_dev_route(client, url, "/update_weight_version", "labelling the weight version",
                  json={"new_version": str(version)})
        finally:
            post_dev_route(client, url, "/resume", "resume after the weight update")
    return WeightUpdate(url=url, version=version, workers=workers, seconds=time.perf_counter() - start)


def weight_checksums(url: str, *, timeout_s: float = 300.0) -> dict[str, str]:
    """sha256 per parameter as the engine holds it (``{"dp0:pp0:pcp0:tp0:<name>": digest}``)."""
    url = url.rstrip("/")
    with httpx.Client(timeout=timeout_s, headers=auth.headers()) as client:
        resp = post_dev_route(client, url, "/weight_checker", "computing weight checksums", json={"action": "checksum"})
    return dict(resp.json()["checksums"])


def weight_version(url: str, *, timeout_s: float = 30.0) -> str | None:
    """The label the engine reports for its current weights (``"default"`` until the first update)."""
    url = url.rstrip("/")
    with httpx.Client(timeout=timeout_s, headers=auth.headers()) as client:
        resp = engine_get(client, url, "/weight_info")
    return resp.json().get("weight_version")
