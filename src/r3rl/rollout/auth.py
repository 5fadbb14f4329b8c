"""The run's engine token: every route of an r3rl-launched vLLM server but ``/health`` answers 401 without it (a
WebSocket handshake, 403).

vLLM's own ``--api-key`` guards only the paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``); the RL routes that pause the engine and load weights into
it, and ``/collective_rpc``, stay open to anyone who reaches the port. ``EngineTokenMiddleware`` is handed to the
server with ``--middleware`` and guards every path.

The token is made per run at launch (``new_token``) and travels in the environment (``R3RL_ENGINE_TOKEN``) of the
processes that talk to the engines and of the servers themselves, and in one file of the run folder readable by
its user alone (``write_token_file``): never in the config, the plan, a log, ``processes.json``, W&B or a
checkpoint. Every client of the engines sends ``headers()``. This module is imported by the vLLM server process:
it keeps to the standard library (the refusal is written as raw ASGI messages).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

TOKEN_ENV = "R3RL_ENGINE_TOKEN"
MIDDLEWARE = "r3rl.rollout.auth.EngineTokenMiddleware"
TOKEN_FILE = "engine_token"
# what a load balancer or the launcher polls before it has the token (it reveals only that the server is up)
OPEN_PATHS = frozenset({"/health"})


def new_token() -> str:
    # hex, not urlsafe base64: one token in 64 of those starts with '-', which a command line (vLLM's --api-key)
    # reads as an option
    return secrets.token_hex(32)


def token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def headers() -> dict[str, str]:
    """What every request to an engine carries: this process's engine token, when it has one."""
    value = token()
    return {"Authorization": f"Bearer {value}"} if value else {}


def write_token_file(folder: Path, value: str) -> Path:
    """``folder/engine_token``, created readable and writable by its owner alone (0600) before the token is written."""
    path = Path(folder) / TOKEN_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return path


class EngineTokenMiddleware:
    """ASGI middleware: a request to any path but ``/health`` needs ``Authorization: Bearer <R3RL_ENGINE_TOKEN>``.
    A server started without the variable refuses everything but ``/health``: it fails closed."""

    def __init__(self, app):
        self.app = app
        value = os.environ.get(TOKEN_ENV) or ""
        self.expected = f"Bearer {value}".encode() if value else None

    async def __call__(self, scope, receive, send):
        # HTTP and WebSocket alike (vLLM serves /v1/realtime over WebSocket); lifespan events carry no request
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or []).get(b"authorization", b"")
        if self.expected is not None and hmac.compare_digest(sent, self.expected):
            return await self.app(scope, receive, send)
        why = (f"this engine was started without {TOKEN_ENV}: it answers /health only" if self.expected is None
               else f"missing or wrong engine token (Authorization: Bearer ${TOKEN_ENV})")
        if scope["type"] == "websocket":  # closed before the handshake is accepted: the server answers HTTP 403
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
            return
        body = json.dumps({"error": why}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
