"""Servers r3rl opens for a rendezvous listen on the address they were given, never on every interface: torch's
TCPStore, left to itself, listens on all of them even when its host is 127.0.0.1."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from r3rl.net import free_port, listening_fd


def listening_on(port: int) -> set[str]:
    """The local addresses listening on TCP ``port``, from the kernel's tables (IPv4 as dotted quads, IPv6 as hex)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(address) == 8
                          else address)
    return found


def store(port: int, **kwargs) -> TCPStore:
    return TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=10), **kwargs)


def test_a_store_on_a_listening_fd_listens_on_loopback_alone():
    fd, port = listening_fd("127.0.0.1")
    s = store(port, master_listen_fd=fd)
    assert listening_on(port) == {"127.0.0.1"}
    client = TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert s.get("k") == b"v"
    del client, s
    # what the fd replaces: a store given only its host listens on every interface
    plain = store(0)
    assert listening_on(plain.port) - {"127.0.0.1"}, listening_on(plain.port)


def test_a_taken_port_fails_before_anyone_is_told_it():
    fd, port = listening_fd("127.0.0.1")
    s = store(port, master_listen_fd=fd)
    with pytest.raises(OSError):
        listening_fd("127.0.0.1", port)
    del s


def test_the_weight_transfer_sender_listens_on_its_address_alone():
    from r3rl.sync.gloo_engine import open_store

    port = free_port()
    sender = open_store("127.0.0.1", port, 2, 10, is_master=True)
    assert sender.port == port and listening_on(port) == {"127.0.0.1"}
