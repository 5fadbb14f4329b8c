"""torch.distributed and Megatron's parallel state for one trainer rank.

Ray actors and torchrun both describe a rank by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (LOCAL_RANK picks
the GPU); a plain process gets world size 1 with an in-process store. Under Ray, rank 0's process listens before any rank
learns the port (``open_rendezvous``), as torchrun's agent does: a port found free and bound seconds later is lost, now
and then, to another process in between. gloo on CPU, NCCL on GPU; gloo groups beside the
NCCL ones on GPU too, because Megatron's optimizer and its distributed-optimizer checkpoints ask for them. Several trainers in
one process (tests build a second one to compare) share the process groups; the last one to leave tears them down.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from r3rl.train import hardware


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    expert_tensor_parallel: int = 1


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    device: torch.device
    dp_rank: int
    dp_size: int
    layout: Layout


_USERS = 0
_LAYOUT: Layout | None = None
_OWNS_PROCESS_GROUP = False
_STORE: torch.distributed.TCPStore | None = None  # rank 0's rendezvous, listening since open_rendezvous


def _device() -> torch.device:
    if hardware.cuda_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        # Ray gives each actor its own CUDA_VISIBLE_DEVICES, so the local index is 0 there
        local = local if local < torch.cuda.device_count() else 0
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def open_rendezvous(host: str, world_size: int, timeout_minutes: int = 30) -> int:
    """Rank 0's process: listen for every rank now, on a port the OS picks, as torchrun's agent does; the ranks then
    join with ``rendezvous_env`` (as clients, rank 0 included, so all of them see the store alike)."""
    global _STORE
    if _STORE is None:
        from r3rl.net import listening_fd

        fd, port = listening_fd(host)
        _STORE = torch.distributed.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(minutes=timeout_minutes), master_listen_fd=fd)
    return _STORE.port


def rendezvous_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment a rank joins with: torch's env:// rendezvous against a store that is already listening."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def init(layout: Layout, seed: int, timeout_minutes: int = 30) -> RankInfo:
    """Join (or start) the process group and Megatron's model-parallel groups; seed Megatron's RNG streams."""
    global _USERS, _LAYOUT, _OWNS_PROCESS_GROUP
    hardware.apply_if_needed()  # first: Megatron's imports warn about TE/Apex, which the CPU profile expects
    from megatron.core import parallel_state as ps

    device = _device()
    if not torch.distributed.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        store = None  # None: the env:// rendezvous at MASTER_ADDR:MASTER_PORT
        if world == 1:
            store = torch.distributed.HashStore()  # one rank meets nobody: no port to lose
        elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world} needs MASTER_ADDR and MASTER_PORT in the environment")
        torch.distributed.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world, store=store,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
        _OWNS_PROCESS_GROUP = True
    world = torch.distributed.get_world_size()
    if not ps.model_parallel_is_initialized():
        hardware.check_supported(layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel)
        model_parallel = layout.tensor_parallel * layout.pipeline_parallel * layout.context_parallel
        expert_model_parallel = layout.expert_parallel * layout.expert_tensor_parallel * layout.pipeline_parallel
        if world % model_parallel or world % expert_model_parallel:
            raise RuntimeError(f"world size {world} does not fit the trainer layout {layout}")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_parallel,
            pipeline_model_parallel_size=layout.pipeline_parallel,
            context_parallel_size=layout.context_parallel,
            expert_model_parallel_size=layout.expert_parallel,
            expert_tensor_parallel_size=layout.expert_tensor_parallel,
            distributed_timeout_minutes=timeout_minutes,
            create_gloo_process_groups=True,
        )
        _LAYOUT = layout
    elif _LAYOUT != layout:
        raise RuntimeError(f"this process already runs trainer layout {_LAYOUT}; cannot add one with {layout}")
    _USERS += 1
    seed_all(seed)
    return RankInfo(
        rank=torch.distributed.get_rank(), world_size=world, device=device,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), layout=layout,
    )


def seed_all(seed: int) -> None:
    """Seed the default generators and Megatron's tracked streams (data, tensor-parallel, expert)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tp, ep, etp = (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                   ps.get_expert_tensor_parallel_rank())
    if not hardware.seed_rng_tracker(seed, tp, ep, etp):
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def release() -> None:
    """Leave the process groups; the last user destroys them (and the process group if this module created it)."""
    global _USERS, _LAYOUT, _OWNS_PROCESS_GROUP, _STORE
    from megatron.core import parallel_state as ps

    _USERS = max(_USERS - 1, 0)
    if _USERS:
        return
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _LAYOUT = None
    if _OWNS_PROCESS_GROUP and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        _OWNS_PROCESS_GROUP = False
        _STORE = None
