"""torch.distributed's rendezvous for trainer ranks: rank 0 listens before anyone is told the port, and a lone rank
uses no port at all, so no other process can take the port between choosing it and binding it."""

from __future__ import annotations

import socket

import pytest
import torch

from r3rl.train import distributed
from r3rl.train.distributed import Layout


def default_store() -> torch.distributed.Store:
    store = torch.distributed.distributed_c10d._get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    return store


@pytest.fixture
def lone_rank(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    yield
    while torch.distributed.is_initialized():
        distributed.release()


def test_rank_zero_listens_before_the_port_is_handed_out(lone_rank):
    port = distributed.open_rendezvous("127.0.0.1", world_size=2)
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # already listening: the port cannot be taken any more
    assert distributed.open_rendezvous("127.0.0.1", world_size=2) == port  # asked again: the same store
    env = distributed.rendezvous_env(1, 2, "127.0.0.1", port)
    # every rank, rank 0 included, joins as a client of that store (torch's agent-store rendezvous)
    assert env["MASTER_PORT"] == str(port) and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    distributed.init(Layout(), seed=1)
    distributed.release()
    assert distributed._STORE is None


def test_a_lone_rank_meets_nobody_and_binds_no_port(lone_rank):
    distributed.init(Layout(), seed=1)
    assert torch.distributed.get_world_size() == 1
    assert isinstance(default_store(), torch.distributed.HashStore)
