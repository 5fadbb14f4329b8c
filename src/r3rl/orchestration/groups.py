"""The trainer ranks and the vLLM engines as groups of Ray actors placed by ``r3rl.placement``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from r3rl.config.schema import R3RLConfig
from r3rl.orchestration.actors import EngineHost, TrainerActor
from r3rl.plan import LaunchPlan

PG_TIMEOUT_S = 300.0


class PlacementTimeout(RuntimeError):
    pass


def _ready(pg, what: str) -> None:
    try:
        ray.get(pg.ready(), timeout=PG_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise PlacementTimeout(
            f"Ray could not reserve the {what} bundles {pg.bundle_specs} within {PG_TIMEOUT_S:.0f} s: "
            f"cluster resources are {ray.cluster_resources()}"
        ) from None


def plan_nodes(nnodes: int) -> list[str]:
    """IPs of the Ray nodes standing for the plan's nodes 0..nnodes-1: node 0 is the driver's (the head node under
    slurm/ray.sub, where the trainer goes), or the head's when the driver runs outside the cluster; the others in
    sorted order of their addresses."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    ips = {n["NodeManagerAddress"] for n in alive}
    me = ray.util.get_node_ip_address()
    if me not in ips:
        me = next((n["NodeManagerAddress"] for n in alive if "node:__internal_head__" in n["Resources"]), me)
    nodes = [me, *sorted(ips - {me})]
    if len(nodes) < nnodes:
        raise PlacementTimeout(f"parallelism.nnodes={nnodes} but the Ray cluster has {len(nodes)} live node(s): "
                               f"{', '.join(nodes)}")
    return nodes[:nnodes]


def pinned(bundles: list[dict[str, float]], nodes: list[int], ips: list[str] | None) -> list[dict[str, float]]:
    """Bundles held to the plan's nodes through Ray's built-in ``node:<ip>`` resource (a sliver of it), so the
    trainer lands on node 0 and each engine on its node; ``ips`` None (one node) leaves them free."""
    if ips is None:
        return bundles
    return [{**b, f"node:{ips[n]}": 0.001} for b, n in zip(bundles, nodes)]


class TrainerGroup:
    """``parallelism.trainer.num_gpus`` Megatron ranks, one Ray actor each, rank r on trainer bundle r."""

    def __init__(self, cfg: R3RLConfig, plan: LaunchPlan, *, loopback: bool):
        p = plan.placement
        self.node_ips = plan_nodes(cfg.parallelism.nnodes) if cfg.parallelism.nnodes > 1 else None
        bundles = pinned(p.bundles("trainer"), [g.node for g in p.trainer], self.node_ips)
        self.pg = placement_group(bundles, strategy="PACK", name="r3rl-trainer")
        _ready(self.pg, "trainer")
        # Colocated engines share these GPUs: each rank takes half of its GPU's bundle so Ray accounts for both.
        gpus = 0.5 if p.colocated else 1.0
        n = len(p.trainer)
        self.actors = [
            TrainerActor.options(
                num_gpus=gpus, num_cpus=p.trainer_cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote(r, n)
            for r in range(n)
        ]
        self.devices = ray.get([a.devices.remote() for a in self.actors])
        addr, port = ray.get(self.actors[0].address.remote(loopback))
        ray.get([a.setup.remote(cfg, addr, port) for a in self.actors])

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on every rank (collectives need all of them) and return rank 0's answer."""
        return ray.get([a.call.remote(method, *args, **kwargs) for a in self.actors])[0]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` on every rank and return every rank's answer, in rank order."""
        return ray.get([a.call.remote(method, *args, **kwargs) for a in self.actors])

    def open_weight_transfer(self, urls: list[str], *, backend: str, loopback: bool, timeout_s: float,
                             bucket_bytes: int, shared_memory: bool = True) -> None:
        from r3rl.rollout import auth

        endpoint = ray.get([a.open_weight_transfer.remote(urls, backend, loopback, timeout_s, bucket_bytes,
                                                          shared_memory, auth.token())
                            for a in self.actors])[0]
        if endpoint is not None:  # every rank sends its own shards: all join one group with the engine workers
            ray.get([a.join_weight_transfer.remote(endpoint) for a in self.actors])

    def send_weights(self, version: int) -> dict[str, Any]:
        """One transfer to every engine; rank 0's statistics. Rank 0's error first (it names the engine at fault):
        every rank runs the sync to its end whatever failed, so waiting for rank 0 first cannot hang."""
        refs = [a.send_weights.remote(version) for a in self.actors]
        stats = ray.get(refs[0])
        ray.get(refs[1:])
        return stats

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            except Exception:  # a rank that already died has nothing to stop; the kill below still runs
                pass
            ray.kill(actor)
        remove_placement_group(self.pg)


class EngineGroup:
    """The vLLM servers of the plan (or the one attached to), each owned by an ``EngineHost`` actor. They start in
    the background: ``wait_ready`` blocks until all of them answer (the trainer ranks start meanwhile)."""

    def __init__(self, cfg: R3RLConfig, plan: LaunchPlan, log_dir: Path, trainers: TrainerGroup | None):
        from r3rl.rollout import auth
        from r3rl.rollout.engine import VLLMEngine

        self.hosts: list[Any] = []
        self.pg = None
        self.attached = None
        self.info: list[dict[str, Any]] = []
        self.urls: list[str] = []
        self.starting: list[Any] = []  # the hosts' start calls not yet waited for
        self.startup_timeout_s = cfg.rollout.engine.startup_timeout_s
        self.lost: set[str] = set()  # engines found gone: shutdown does not wait on their hosts
        if plan.attach_url:
            self.attached = VLLMEngine.attach(plan.attach_url)
            self.urls = [self.attached.url]
            return
        p = plan.placement
        if p.colocated:
            assert trainers is not None, "colocated engines share the trainer's placement group"
            rank_of = {(g.node, g.local): r for r, g in enumerate(p.trainer)}
            options = []
            for e in plan.engines:
                ranks = [rank_of[(e.node, g)] for g in e.gpus]
                visible = ",".join(trainers.devices[r]["gpu_ids"][0] for r in ranks)
                options.append((dict(num_gpus=0, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    trainers.pg, placement_group_bundle_index=ranks[0])), visible))
        else:
            ips = plan_nodes(cfg.parallelism.nnodes) if cfg.parallelism.nnodes > 1 else None
            bundles = pinned(p.bundles("rollout"), [e.node for e in plan.engines], ips)
            self.pg = placement_group(bundles, strategy="PACK", name="r3rl-rollout")
            _ready(self.pg, "rollout")
            options = [(dict(num_gpus=len(e.gpus), num_cpus=p.cpus_per_bundle,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 self.pg, placement_group_bundle_index=i)), None)
                       for i, e in enumerate(plan.engines)]
        self.hosts = [EngineHost.options(**opts).remote() for opts, _ in options]
        starts = []
        for host, (_, visible), launch in zip(self.hosts, options, plan.engines):
            if visible is None and not p.logical_gpus:
                visible = ",".join(ray.get(host.devices.remote())["gpu_ids"])
            starts.append(host.start.remote(launch, str(log_dir), self.startup_timeout_s,
                                             visible if not p.logical_gpus else None, auth.token()))
        self.starting = starts

    def wait_ready(self) -> None:
        """Until every engine answers; an engine that failed to start raises its error here."""
        if self.starting:
            self.info = ray.get(self.starting)
            self.urls = [i["url"] for i in self.info]
            self.starting = []

    def dead(self, timeout_s: float = 10.0) -> list[str]:
        """The engines whose server process is gone, or whose host actor does not answer (its node is down), each
        named with its URL and node."""
        if self.attached is not None:
            return [] if self.attached.is_alive() else list(self.urls)
        refs = [h.alive.remote() for h in self.hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref, url, info in zip(refs, self.urls, self.info):
            try:
                ok = ref in ready and ray.get(ref)
            except ray.exceptions.RayError:  # the actor died, with its node
                ok = False
            if not ok:
                self.lost.add(url)
                out.append(f"{url} on node {info.get('node', '?')}")
        return out

    def shutdown(self) -> None:
        if self.starting:  # the run failed while the engines started: a server is stopped once its start returned
            ray.wait(self.starting, num_returns=len(self.starting), timeout=self.startup_timeout_s)
        for i, host in enumerate(self.hosts):
            try:
                ray.get(host.shutdown.remote(), timeout=5 if i < len(self.urls) and self.urls[i] in self.lost else 120)
            except Exception:  # the host died with its engine: its process group was killed with it
                pass
            ray.kill(host)
        if self.pg is not None:
            remove_placement_group(self.pg)

