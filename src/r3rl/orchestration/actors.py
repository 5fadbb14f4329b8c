"""Ray actors: one per trainer rank (a Megatron process) and one per vLLM engine (it owns the server process)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import ray

from r3rl.config.schema import R3RLConfig
from r3rl.net import free_port
from r3rl.plan import EngineLaunch, with_node_ip


@ray.remote
class TrainerActor:
    """One Megatron rank. Ray sets CUDA_VISIBLE_DEVICES to its GPU, so every rank sees exactly one device."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.trainer = rank, world_size, None
        self.sender = self.wire = None

    def address(self, loopback: bool) -> tuple[str, int]:
        """Rank 0: listen for torch.distributed's rendezvous now (loopback on a one-node local cluster, else this
        node's IP) and say where."""
        from r3rl.train import distributed

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return host, distributed.open_rendezvous(host, self.world_size)

    def devices(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}

    def setup(self, cfg: R3RLConfig, master_addr: str, master_port: int) -> None:
        from r3rl.placement import set_trainer_threads
        from r3rl.train import distributed
        from r3rl.train.trainer import MegatronTrainer

        os.environ.update(distributed.rendezvous_env(self.rank, self.world_size, master_addr, master_port))
        set_trainer_threads(cfg.parallelism, self.rank)
        self.trainer = MegatronTrainer(cfg)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.trainer, method)(*args, **kwargs)

    # weight transfer: the trainer produces HF buckets, rank 0 drives vLLM's protocol (r3rl.sync); on a wire with many
    # senders every rank sends its own part of each bucket, else rank 0 sends what the others gathered to it
    def open_weight_transfer(self, urls: list[str], backend: str, loopback: bool, timeout_s: float,
                             bucket_bytes: int, shared_memory: bool = True, token: str | None = None
                             ) -> dict[str, Any] | None:
        """Open this rank's end; with many senders rank 0 answers where the others join (``join_weight_transfer``).
        ``token``: the engines' (``r3rl.rollout.auth``), which rank 0's protocol calls carry."""
        from r3rl.rollout import auth
        from r3rl.sync.protocol import EngineSet, TransferSender
        from r3rl.sync.wires import make_wire

        if token:
            os.environ[auth.TOKEN_ENV] = token

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        self.wire = make_wire(backend, master_address=host, master_port=free_port(host) if self.rank == 0 else 0,
                              bucket_bytes=bucket_bytes, timeout_s=timeout_s, rank=self.rank,
                              senders=self.world_size, shared_memory=loopback and shared_memory)
        senders = self.world_size if self.wire.many_senders else 1
        if self.rank == 0:
            self.sender = TransferSender(EngineSet(urls, timeout_s), self.wire, senders=senders)
            return self.wire.endpoint() if senders > 1 else None
        return None

    def join_weight_transfer(self, endpoint: dict[str, Any]) -> None:
        """Every rank at once: rank 0 with the engines, the others at rank 0's ``endpoint``."""
        if self.rank == 0:
            self.sender.join_group()
        else:
            self.wire.connect(endpoint)

    def send_weights(self, version: int) -> dict[str, Any]:
        from r3rl.sync.protocol import send_owned
        from r3rl.sync.wires import participate

        stream = self.trainer.weight_stream()
        if self.wire.many_senders:
            stats = send_owned(self.wire, stream, self.sender, version)
            return dataclasses.asdict(stats) if stats is not None else {}
        buckets = stream.stream(dst=0)
        if self.rank != 0:  # the other ranks gather their shards towards rank 0, bucket by bucket (IPC: and more)
            participate(self.wire, buckets)
            return {}
        return dataclasses.asdict(self.sender.send(buckets, version))

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.engines.close()
            self.sender = None
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None


@ray.remote
class EngineHost:
    """Holds an engine's GPUs and runs its vLLM server as a child process group, stopped by PID."""

    def __init__(self) -> None:
        self.engine = None

    def devices(self) -> dict[str, Any]:
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}

    def start(self, launch: EngineLaunch, log_dir: str, startup_timeout_s: float,
              cuda_visible_devices: str | None, token: str | None = None) -> dict[str, Any]:
        """``token``: the run's engine token, which the server demands and this actor's start-up probe sends."""
        from r3rl.rollout import auth
        from r3rl.rollout.engine import VLLMEngine

        if token:
            os.environ[auth.TOKEN_ENV] = token

        # on a multi-node plan the engine binds to, and is reached at, this node's address as Ray knows it
        node_ip = ray.util.get_node_ip_address()
        launch = with_node_ip(launch, node_ip)
        env = dict(launch.env)
        if cuda_visible_devices is not None:
            # the GPUs Ray actually gave this engine (or, colocated, the ones its trainer ranks hold)
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        else:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        self.engine = VLLMEngine.launch(dataclasses.replace(launch, env=env), Path(log_dir), startup_timeout_s)
        # the Slurm node (Ray's workers inherit the raylet's environment, which srun gave it), else the host name
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        return {"url": self.engine.url, "pid": self.engine.pid, "node": node, "node_ip": node_ip,
                "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES")}

    def alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
