"""Ports for servers and rendezvous: every test, bench and single-node run binds to loopback."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the caller binds it soon after; good enough for tests and rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_fd(host: str, port: int = 0) -> tuple[int, int]:
    """A TCP socket listening on ``host`` alone, as ``(fd, port)``, for ``TCPStore(master_listen_fd=fd)``, which
    takes the fd over (and closes it). Left to itself the store listens on every interface, loopback runs included.
    A taken port raises ``OSError`` here, before anyone is told to connect."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(1024)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return sock.detach(), bound
