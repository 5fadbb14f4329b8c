"""The run's engine token on a real vLLM server (``r3rl.rollout.auth``): every route but ``/health`` refuses a request
without it, vLLM's own routes and its RL routes alike, and attaching with a wrong token is one clear error."""

from __future__ import annotations

import httpx
import pytest

from r3rl.rollout import auth
from r3rl.rollout.engine import EngineError, VLLMEngine
from r3rl.rollout.wire import GENERATE_PATH

pytestmark = pytest.mark.integration

# what a stranger on the network would do to a run's engine: pause it, call a worker method, load weights into it,
# generate on its GPUs, read its metrics
REFUSED = (("POST", "/pause", {"params": {"mode": "wait"}}),
           ("POST", "/collective_rpc", {"json": {"method": "r3rl_transfer_stats"}}),
           ("POST", "/update_weights", {"json": {"update_info": {}}}),
           ("POST", "/init_weight_transfer_engine", {"json": {"init_info": {}}}),
           ("POST", GENERATE_PATH, {"json": {"model": "tiny_moe", "token_ids": [1, 2, 3],
                                             "sampling_params": {"max_tokens": 2}}}),
           ("GET", "/metrics", {}),
           ("GET", "/v1/models", {}))


def test_every_route_but_health_refuses_a_request_without_the_token(r3_engine):
    """Fails if the server ran without r3rl's middleware (vLLM's --api-key would leave /pause, /collective_rpc and
    the weight routes open), if the middleware let a request through without the token or with another one, or
    if it guarded /health, which the launcher polls before anything else."""
    assert auth.token(), "the launching process holds the engine's token"
    with httpx.Client(base_url=r3_engine.url, timeout=30) as client:
        for method, path, kwargs in REFUSED:
            for headers in ({}, {"Authorization": "Bearer not-the-token"}):
                reply = client.request(method, path, headers=headers, **kwargs)
                assert reply.status_code == 401, (path, headers, reply.status_code, reply.text[:200])
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models", headers=auth.headers()).status_code == 200
        assert client.get("/is_paused", headers=auth.headers()).json() == {"is_paused": False}


def test_attaching_with_a_wrong_or_missing_token_names_the_variable(r3_engine, monkeypatch):
    """Fails if an attach with the wrong token (or none) went on to fail later at the first rollout, or named
    nothing the user can set."""
    monkeypatch.setenv(auth.TOKEN_ENV, "not-the-token")
    with pytest.raises(EngineError, match=f"not its own. Set {auth.TOKEN_ENV}"):
        VLLMEngine.attach(r3_engine.url)
    monkeypatch.delenv(auth.TOKEN_ENV)
    with pytest.raises(EngineError, match=f"no token \\({auth.TOKEN_ENV} is not set\\)"):
        VLLMEngine.attach(r3_engine.url)


def test_an_engine_guarded_by_vllm_api_key_alone_is_found_open_and_refused_at_attach(r3_cfg, tmp_path):
    """A real vLLM server started the way its docs suggest, with ``--api-key`` and without r3rl's middleware (issue
    59 item 3): ``/v1/models`` refuses a request without the key, yet ``/is_paused`` and ``/weight_info`` answer
    it, and so would ``/pause`` and ``/update_weights``. The probe finds it open and attaching is refused naming
    R3RL_ENGINE_TOKEN and docs/security.md. Fails if the probe (or the doctor's check built on it) asks a /v1 route
    only, or if ``VLLMEngine.attach`` stops probing."""
    import dataclasses

    from r3rl.plan import build_plan
    from r3rl.rollout.engine import engine_token
    from r3rl.rollout.probe import unguarded_routes

    launch = build_plan(r3_cfg).engines[0]
    argv = list(launch.argv)
    at = argv.index("--middleware")
    del argv[at:at + 2]
    launch = dataclasses.replace(launch, argv=(*argv, "--api-key", engine_token()))
    engine = VLLMEngine.launch(launch, tmp_path, r3_cfg.rollout.engine.startup_timeout_s)
    try:
        assert httpx.get(f"{engine.url}/v1/models", timeout=30).status_code == 401  # vLLM's own guard holds there
        found = unguarded_routes(engine.url)
        assert found.get("/is_paused") == 200 and found.get("/weight_info") == 200, found
        with pytest.raises(EngineError, match=rf"answers requests without a token \(/is_paused \(200\).*"
                                              rf"{auth.TOKEN_ENV} here \(docs/security.md\)"):
            VLLMEngine.attach(engine.url)
    finally:
        engine.shutdown()


def test_the_launched_engine_answers_no_probe_without_the_token(r3_engine):
    """The other side of the probe: r3rl's own engine refuses every probe route (nothing unguarded) and attaches.
    Fails if the middleware let one of them through, or if the probe counted a 401 as open."""
    from r3rl.rollout.probe import unguarded_routes

    assert unguarded_routes(r3_engine.url) == {}
    assert VLLMEngine.attach(r3_engine.url).url == r3_engine.url
