"""torch.distributed's rendezvous for trainer ranks: rank 0's process listens before anyone is told the port, and a
lone rank uses no port at all, so no other process can take the port between choosing it and binding it. Each case
runs in a fresh interpreter: other tests in this process may already hold a process group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK_ZERO_LISTENS_FIRST = textwrap.dedent("""
    import socket
    from r3rl.train import distributed
    port = distributed.open_rendezvous("127.0.0.1", world_size=2)
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # already listening: the port cannot be taken any more
    from test_net import listening_on
    assert listening_on(port) == {"127.0.0.1"}, listening_on(port)  # on the address given, not every interface
    assert distributed.open_rendezvous("127.0.0.1", world_size=2) == port  # asked again: the same store
    env = distributed.rendezvous_env(1, 2, "127.0.0.1", port)
    # every rank, rank 0 included, joins as a client of that store (torch's agent-store rendezvous)
    assert env["MASTER_PORT"] == str(port) and env["TORCHELASTIC_USE_AGENT_STORE"] == "True", env
    distributed.init(distributed.Layout(), seed=1)
    distributed.release()
    assert distributed._STORE is None  # closed with the process group
""")

LONE_RANK = textwrap.dedent("""
    import torch
    from r3rl.train import distributed
    distributed.init(distributed.Layout(), seed=1)
    store = torch.distributed.distributed_c10d._get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    assert torch.distributed.get_world_size() == 1 and isinstance(store, torch.distributed.HashStore), store
    distributed.release()
""")


def run_fresh(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]


def test_rank_zero_listens_before_the_port_is_handed_out():
    run_fresh(RANK_ZERO_LISTENS_FIRST)


def test_a_lone_rank_meets_nobody_and_binds_no_port():
    run_fresh(LONE_RANK)
