"""Ports for servers and rendezvous: every test, bench and single-node run binds to loopback."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the caller binds it soon after; good enough for tests and rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
