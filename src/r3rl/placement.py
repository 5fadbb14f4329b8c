"""Which GPUs each role gets: a pure function of the parallelism config (no Ray, no I/O).

GPUs are numbered node-major: global GPU g is local GPU ``g % gpus_per_node`` of node ``g // gpus_per_node``.
Disaggregated: the trainer takes the first ``trainer.num_gpus`` GPUs and the engines the next ``rollout.num_gpus``.
Colocated: both use the first ``trainer.num_gpus`` GPUs. Each engine takes ``tensor_parallel x data_parallel``
consecutive GPUs that must sit on one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from r3rl.config.schema import ParallelismConfig


class PlacementError(ValueError):
    """The parallelism config cannot be laid out on its GPUs; the message names the key to change."""


@dataclass(frozen=True)
class GPU:
    node: int
    local: int


@dataclass(frozen=True)
class EnginePlacement:
    index: int
    node: int
    gpus: tuple[int, ...]  # local GPU ids on ``node``


@dataclass(frozen=True)
class Placement:
    colocated: bool
    logical_gpus: bool
    trainer: tuple[GPU, ...]  # trainer rank r runs on trainer[r]
    engines: tuple[EnginePlacement, ...]
    cpus_per_bundle: float
    # CPUs each trainer rank reserves (its bundle and its actor): the node's share per GPU, which the CPU Adam of an
    # offloaded optimizer runs on; and the torch threads the rank sets from it (None: ``trainer_threads`` decides)
    trainer_cpus: float = 1.0
    torch_threads: int | None = None

    def bundles(self, role: str) -> list[dict[str, float]]:
        """Ray placement-group bundles of a role: one GPU per trainer rank; one bundle per engine holding all of
        that engine's GPUs (a Ray actor fits in one bundle, and vLLM spawns its TP/DP workers inside it)."""
        if role == "trainer":
            return [{"GPU": 1.0, "CPU": self.trainer_cpus} for _ in self.trainer]
        return [{"GPU": float(len(e.gpus)), "CPU": self.cpus_per_bundle} for e in self.engines]

    def gpus_of(self, role: str) -> list[GPU]:
        if role == "trainer":
            return list(self.trainer)
        return [GPU(e.node, g) for e in self.engines for g in e.gpus]


def place(par: ParallelismConfig) -> Placement:
    total = par.nnodes * par.gpus_per_node
    n_train, n_roll = par.trainer.num_gpus, par.rollout.num_gpus
    if par.colocated:
        if n_roll != n_train:
            raise PlacementError(f"parallelism.rollout.num_gpus: colocated engines share the trainer's GPUs, "
                                 f"so it must equal parallelism.trainer.num_gpus={n_train}, got {n_roll}")
        if n_train > total:
            raise PlacementError(f"parallelism.trainer.num_gpus: {n_train} GPUs exceed nnodes x gpus_per_node={total}")
        rollout_start = 0
    else:
        if n_train + n_roll > total:
            raise PlacementError(f"parallelism.rollout.num_gpus: trainer {n_train} + rollout {n_roll} GPUs exceed "
                                 f"nnodes x gpus_per_node = {par.nnodes} x {par.gpus_per_node} = {total}")
        rollout_start = n_train

    def gpu(g: int) -> GPU:
        return GPU(g // par.gpus_per_node, g % par.gpus_per_node)

    per_engine = par.rollout.tensor_parallel * par.rollout.data_parallel
    if par.rollout.num_engines * per_engine != n_roll:
        raise PlacementError(f"parallelism.rollout.num_engines: {par.rollout.num_engines} engines x {per_engine} GPUs "
                             f"(tensor_parallel x data_parallel) must equal parallelism.rollout.num_gpus={n_roll}")
    engines = []
    for i in range(par.rollout.num_engines):
        members = [gpu(rollout_start + i * per_engine + j) for j in range(per_engine)]
        nodes = {m.node for m in members}
        if len(nodes) != 1:
            raise PlacementError(f"parallelism.rollout.tensor_parallel: engine {i} would span nodes {sorted(nodes)}; "
                                 f"an engine's {per_engine} GPUs must sit on one node of {par.gpus_per_node}")
        engines.append(EnginePlacement(i, members[0].node, tuple(m.local for m in members)))

    cpus_per_bundle = 0.1 if par.device == "cpu" else 1.0
    return Placement(
        colocated=par.colocated,
        logical_gpus=par.device == "cpu",
        trainer=tuple(gpu(g) for g in range(n_train)),
        engines=tuple(engines),
        # Logical GPUs on a small CPU machine: bundles must not reserve whole cores the engines need.
        cpus_per_bundle=cpus_per_bundle,
        trainer_cpus=par.cpus_per_gpu if par.cpus_per_gpu is not None else cpus_per_bundle,
        torch_threads=max(1, int(par.cpus_per_gpu)) if par.cpus_per_gpu is not None else None,
    )


def trainer_threads(p: Placement, rank: int, cores: int) -> int | None:
    """Torch intra-op threads of trainer rank ``rank`` on a node of ``cores`` CPUs: ``parallelism.cpus_per_gpu``'s
    when set; on logical GPUs the node's cores split over the trainer ranks on it (their bundles reserve a tenth
    of a core so the engines fit, but the engines sit idle while the trainer computes: one rank on 2 cores went
    from 3.8 to 2.8 s a GRPO step, and a one-step-off-policy run, where the engine generates meanwhile, from 3.2 to
    3.0 s); otherwise None (torch's default)."""
    if p.torch_threads is not None:
        return p.torch_threads
    if not p.logical_gpus:
        return None
    node = p.trainer[rank].node
    return max(1, cores // sum(g.node == node for g in p.trainer))


def set_trainer_threads(par: ParallelismConfig, rank: int = 0, cores: int | None = None) -> int:
    """In trainer rank ``rank``'s process: torch's intra-op threads (the fused CPU AdamW of an offloaded optimizer
    runs on them, and on logical GPUs all of the rank's math) from ``trainer_threads``, with ``cores`` the CPUs this
    process may run on; unchanged where that gives None. Returns the thread count in effect."""
    import torch

    threads = trainer_threads(place(par), rank, cores if cores is not None else len(os.sched_getaffinity(0)))
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
