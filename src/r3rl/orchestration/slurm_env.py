"""Ray cluster checks for the Slurm launcher (``slurm/ray.sub``), run with the job's Python.

    python -m r3rl.orchestration.slurm_env wait --address HOST:PORT --nodes N --gpus-per-node G --timeout S
    python -m r3rl.orchestration.slurm_env probe [--address HOST:PORT]        # what a driver of the job would see

``wait`` returns once N nodes are alive in the cluster, then runs one task per node holding all of that node's GPUs
and records what it saw (``CUDA_VISIBLE_DEVICES``, Ray's GPU ids, the Slurm node): a node whose Ray GPU count is not
the one Slurm gave, or a node that never joins, is an error with a message that names it, so a job fails at start-up
instead of hanging in placement-group creation later. Exit codes: 0 ready, 3 nodes missing, 4 GPU mismatch,
5 Ray not reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

EXIT_MISSING_NODES = 3
EXIT_GPU_MISMATCH = 4
EXIT_UNREACHABLE = 5


def _log(msg: str) -> None:
    print(f"[r3rl {time.strftime('%H:%M:%S')} slurm_env] {msg}", flush=True)


def _connect(address: str | None) -> None:
    import ray

    ray.init(address=address or "auto", log_to_driver=False, logging_level="ERROR", configure_logging=True)


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def _node_view() -> dict[str, Any]:
    import ray

    return {
        "hostname": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
    }


def probe_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One task per node, pinned there and holding every GPU of it: what a GPU actor on that node gets."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    view = ray.remote(_node_view)
    refs = []
    for n in nodes:
        gpus = n["Resources"].get("GPU", 0)
        refs.append(view.options(
            num_cpus=0, num_gpus=gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
        ).remote())
    out = []
    for n, seen in zip(nodes, ray.get(refs)):
        out.append({
            "node_ip": n["NodeManagerAddress"],
            "ray_gpus": int(n["Resources"].get("GPU", 0)),
            "ray_cpus": n["Resources"].get("CPU", 0),
            **seen,
        })
    return out


def wait_for_nodes(address: str, nodes: int, timeout: float, gpus_per_node: int | None, probe: bool,
                   report: Path | None) -> int:
    t0 = time.monotonic()
    try:
        _connect(address)
    except Exception as err:  # ray raises ConnectionError, RuntimeError, TimeoutError depending on where it stops
        _log(f"error: cannot connect to the Ray head at {address}: {err}")
        return EXIT_UNREACHABLE
    import ray

    alive: list[dict[str, Any]] = []
    last = -1
    while True:
        alive = _alive_nodes()
        if len(alive) != last:
            _log(f"{len(alive)}/{nodes} Ray nodes joined: {', '.join(sorted(n['NodeManagerAddress'] for n in alive))}")
            last = len(alive)
        if len(alive) >= nodes:
            break
        if time.monotonic() - t0 > timeout:
            _log(f"error: only {len(alive)} of {nodes} nodes joined the Ray cluster within {timeout:.0f}s "
                 f"(joined: {', '.join(sorted(n['NodeManagerAddress'] for n in alive)) or 'none'}); "
                 "see the ray-worker-<node>.log files in the job's logs folder")
            return EXIT_MISSING_NODES
        time.sleep(1.0)
    joined_s = time.monotonic() - t0
    result: dict[str, Any] = {
        "address": address,
        "expected_nodes": nodes,
        "expected_gpus_per_node": gpus_per_node,
        "seconds_to_join": round(joined_s, 1),
        "cluster_resources": ray.cluster_resources(),
        "nodes": probe_nodes(alive) if probe else [
            {"node_ip": n["NodeManagerAddress"], "ray_gpus": int(n["Resources"].get("GPU", 0))} for n in alive
        ],
    }
    rc = 0
    for n in result["nodes"]:
        _log(f"node {n.get('slurm_node') or n['node_ip']}: {n['ray_gpus']} GPUs in Ray"
             + (f", CUDA_VISIBLE_DEVICES={n['cuda_visible_devices']}" if probe else ""))
        if gpus_per_node is not None and n["ray_gpus"] != gpus_per_node:
            _log(f"error: node {n.get('slurm_node') or n['node_ip']} has {n['ray_gpus']} GPUs in Ray but Slurm "
                 f"gave {gpus_per_node} per node")
            rc = EXIT_GPU_MISMATCH
    if report is not None:
        report.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    ray.shutdown()
    return rc


def probe(address: str | None, report: Path | None) -> int:
    """The view of a driver attached to the job's cluster (used by attach scripts and tests)."""
    try:
        _connect(address)
    except Exception as err:
        _log(f"error: cannot connect to the Ray cluster at {address or os.environ.get('RAY_ADDRESS', 'auto')}: {err}")
        return EXIT_UNREACHABLE
    import ray

    result = {
        "driver": {"hostname": socket.gethostname(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "slurm_job_id": os.environ.get("SLURM_JOB_ID")},
        "cluster_resources": ray.cluster_resources(),
        "nodes": probe_nodes(_alive_nodes()),
    }
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text, flush=True)
    if report is not None:
        report.write_text(text + "\n")
    ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m r3rl.orchestration.slurm_env", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="wait until every node of the job joined the Ray cluster, then check its GPUs")
    w.add_argument("--address", required=True, help="HOST:PORT of the Ray head (GCS)")
    w.add_argument("--nodes", type=int, required=True, help="number of nodes that must join")
    w.add_argument("--gpus-per-node", type=int, default=None, help="GPUs Slurm gave each node (checked if given)")
    w.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the nodes")
    w.add_argument("--no-probe", action="store_true", help="skip the per-node GPU task")
    w.add_argument("--report", type=Path, default=None, help="write what was found here as JSON")
    p = sub.add_parser("probe", help="print what a driver attached to the cluster sees (JSON)")
    p.add_argument("--address", default=None, help="HOST:PORT of the Ray head (default: RAY_ADDRESS)")
    p.add_argument("--report", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.cmd == "wait":
        return wait_for_nodes(args.address, args.nodes, args.timeout, args.gpus_per_node, not args.no_probe,
                              args.report)
    return probe(args.address, args.report)


if __name__ == "__main__":
    sys.exit(main())
