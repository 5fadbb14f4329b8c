"""``r3rl_gloo``: a vLLM weight-transfer engine for the CPU profile (vLLM's NCCL and IPC engines need CUDA).

It speaks vLLM's weight-transfer protocol unchanged (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` per bucket, ``/finish_weight_update``); only the wire is gloo over TCP: one group of every trainer
rank (ranks ``0 .. senders-1``, as vLLM's ``nccl_m2n`` lays its communicator out) and every worker of every engine
(``rank_offset`` onwards). Every trainer rank sends the part of a bucket it owns (its experts, its share of the
dense layers) itself, point to point to each worker, tagged with the bucket's number; no rank gathers another's
shards. A part travels packed in one flat byte buffer (tensors at 64-byte aligned offsets that both sides compute
from its ``names``/``dtype_names``/``shapes``). When the trainer and every engine share a host, each part is a file
in /dev/shm instead, written by its owner, which the engines map and read in place (``shm_paths``).

Loading is vLLM's layerwise reload (start -> ``load_weights`` per bucket -> finish), except for the CPU experts,
whose weights live prepacked for the grouped GEMM: each such layer is loaded into a warm unpacked staging pair and
prepacked straight into its live storage once complete (``cpu_experts.PackedExpertsUpdate``; layers it cannot take
go through ``cpu_experts.MoERepack``). Without either the engine would serve wrong experts after a transfer.

vLLM learns the name from r3rl's ``vllm.general_plugins`` entry point (``register``), which every vLLM process runs.
This module runs inside the engine's worker, so it imports only torch, vLLM and r3rl's worker-side modules.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

BACKEND = "r3rl_gloo"
ALIGN = 64


def register() -> None:
    """vLLM general plugin: make ``--weight-transfer-config '{"backend": "r3rl_gloo"}'`` known (every process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


# ------------------------------------------------------------------------------------------------ wire layout

def packed_offsets(dtype_names: list[str], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a bucket's buffer, and the buffer's size."""
    offsets, size = [], 0
    for dtype_name, shape in zip(dtype_names, shapes):
        size = -(-size // ALIGN) * ALIGN
        offsets.append(size)
        n = 1
        for d in shape:
            n *= d
        size += n * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    return offsets, size


def pack(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One CPU byte buffer holding ``tensors`` at ``packed_offsets`` (in ``out``'s memory when it is large enough:
    a warm buffer copies at memcpy speed, a fresh one pays a page fault per 4 KiB)."""
    offsets, size = packed_offsets([str(t.dtype).removeprefix("torch.") for t in tensors],
                                   [list(t.shape) for t in tensors])
    buf = out[:size] if out is not None and out.numel() >= size else torch.empty(size, dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        buf[off:off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    return buf


def write_packed(path, tensors: list[torch.Tensor], size: int) -> None:
    """``pack`` into a file with plain writes (the kernel copies into page-cache pages it allocates in bulk, far
    cheaper than faulting in a fresh shared mapping page by page). An existing file is overwritten in place and never
    shrunk: its pages stay allocated, so a warm file costs a memcpy, not a page allocation per 4 KiB (readers map the
    first ``size`` bytes). Created 0600 (the weights are the user's; /dev/shm is world-readable by default), and
    never through a symlink."""
    offsets, _ = packed_offsets([str(t.dtype).removeprefix("torch.") for t in tensors],
                                [list(t.shape) for t in tensors])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)  # a file left by an older r3rl (0644) too; someone else's refuses: PermissionError
    with os.fdopen(fd, "r+b") as fh:
        for t, off in zip(tensors, offsets):
            fh.seek(off)
            fh.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        if os.fstat(fh.fileno()).st_size < size:
            fh.truncate(size)


def unpack(buf: torch.Tensor, names: list[str], dtype_names: list[str], shapes: list[list[int]]
           ) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buf`` (no copy), one per tensor."""
    offsets, _ = packed_offsets(dtype_names, shapes)
    out = []
    for name, dtype_name, shape, off in zip(names, dtype_names, shapes, offsets):
        dtype = getattr(torch, dtype_name)
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        out.append((name, buf[off:off + nbytes].view(dtype).view(shape)))
    return out


def local_address_towards(address: str) -> str:
    """This host's address on the route to ``address`` (``address`` itself when it is loopback or our own)."""
    if address in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP connect sends nothing: it only picks the route and the source address
        return probe.getsockname()[0]


def open_store(master_address: str, master_port: int, world_size: int, join_timeout_s: float, *, is_master: bool):
    """The TCPStore the sender hosts (``is_master``, listening on ``master_address`` alone) and every engine worker
    reaches: only the rendezvous uses it, so its timeout is the join timeout."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=join_timeout_s)
    if not is_master:
        return TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    from r3rl.net import listening_fd

    fd, port = listening_fd(master_address, master_port)
    return TCPStore(master_address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                    master_listen_fd=fd)


def open_group(store, master_address: str, rank: int, world_size: int, join_timeout_s: float):
    """A gloo group of its own (never the process's default group: vLLM's workers have theirs). Its own timeout is
    the join timeout, so a peer that never joins fails the rendezvous in seconds; the transfers carry theirs
    (``send``, ``recv``)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=join_timeout_s)
    # gloo's default device follows the machine's hostname, which on a multi-homed node (or a network namespace) can
    # name an address the other side cannot reach: bind to the interface that routes to the sender instead
    options._devices = [ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]
    return ProcessGroupGloo(PrefixStore(BACKEND, store), rank, world_size, options)


def send(group, buf: torch.Tensor, workers: range, tag: int, timeout_s: float) -> None:
    """One trainer rank's part of a bucket to every engine worker (all sends in flight at once), waiting up to
    ``timeout_s``. The tag (the bucket's number) pairs it with the receive of the same bucket whatever order the
    engines take the updates in."""
    works = [group.send([buf], dst, tag) for dst in workers]
    for work in works:
        work.wait(datetime.timedelta(seconds=timeout_s))


def recv(group, buf: torch.Tensor, src: int, tag: int, timeout_s: float) -> None:
    group.recv([buf], src, tag).wait(datetime.timedelta(seconds=timeout_s))


# ------------------------------------------------------------------------------------------------ engine side

from vllm.distributed.weight_transfer.base import (  # noqa: E402  (present wherever this backend runs)
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # this engine's first worker's rank in the group (the trainer ranks come first)
    world_size: int  # every trainer rank + every worker of every engine
    timeout_s: float = 600.0  # one part's transfer
    join_timeout_s: float = 60.0  # the rendezvous: every worker and the sender have joined, or the init fails


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # the bucket's parts in order: [trainer rank that sends it, number of tensors] (``names`` etc. list them all,
    # part after part); one part from rank 0 when omitted
    parts: list[list[int]] | None = None
    # pairs each part's send with its receive (gloo matches point-to-point messages by sender and tag)
    tag: int = 0
    # per part, the shared-memory file its sender wrote (trainer and engines on one host), read in place instead of
    # received, so the bytes are copied once by the sender and once into the model. A sender rewrites its file for a
    # later bucket once this update has answered (``_detach_buffered``)
    shm_paths: list[str | None] | None = None
    # after the last bucket, no tensors: every layer must have arrived whole (``PackedExpertsUpdate.check``)
    last: bool = False

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names and "
                             f"{len(self.shapes)} shapes must have the same length")
        if self.parts is None:
            self.parts = [[0, len(self.names)]]
        if sum(n for _, n in self.parts) != len(self.names):
            raise ValueError(f"update_info: parts {self.parts} list {sum(n for _, n in self.parts)} tensors, "
                             f"names {len(self.names)}")
        if self.shm_paths is not None and len(self.shm_paths) != len(self.parts):
            raise ValueError(f"update_info: {len(self.shm_paths)} shm_paths for {len(self.parts)} parts")


def _detach_buffered(buf: torch.Tensor) -> None:
    """Copy out what vLLM's layerwise reload still holds of ``buf`` (the tensors of a layer that continues in the
    next bucket: the reload loads a layer only once all of it has arrived). The sender rewrites its shared-memory
    files in place once this bucket's /update_weights has answered, and a private mapping sees the file's new bytes
    wherever it has not copied a page yet; so after this call nothing may still read the mapping. At most one layer
    per bucket is copied."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    ptr = buf.untyped_storage().data_ptr()
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    bound.arguments[key] = value.clone()


def abandon_layerwise_reload(model: torch.nn.Module) -> None:
    """After an update failed half way: every layer still waiting in vLLM's layerwise reload gets its live tensors
    back (still the previous weights; the reload had put it on the meta device), so the engine can serve again.
    Layers already processed keep their new weights."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _place_kernel_tensors

    for layer, info in list(LAYERWISE_INFO.items()):
        if info.can_load():
            if info.kernel_tensors is not None:
                _place_kernel_tensors(layer, info)
            info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self._store = None
        self.timeout_s = 600.0
        self._update: tuple[Any, Any] | None = None  # (PackedExpertsUpdate, MoERepack) while an update is open
        self._staging: list[tuple[torch.Tensor, torch.Tensor]] = []  # experts staging pairs, warm across updates
        self.received_tensors = 0
        self.received_from: dict[int, int] = {}  # bytes per trainer rank in the last update
        self.experts_packed_in_place = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self._store = open_store(init_info.master_address, init_info.master_port, init_info.world_size,
                                 init_info.join_timeout_s, is_master=False)
        self.group = open_group(self._store, init_info.master_address, rank, init_info.world_size,
                                init_info.join_timeout_s)
        self.timeout_s = init_info.timeout_s

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from r3rl.sync.cpu_experts import MoERepack, PackedExpertsUpdate

        experts = PackedExpertsUpdate(self.model, self._staging)
        repack = MoERepack(self.model, skip=experts.methods)
        self.received_tensors = self.experts_packed_in_place = 0
        self.received_from = {}
        self._update = (experts, repack)
        try:
            initialize_layerwise_reload(self.model)
            experts.exclude_from_reload()
        except BaseException:
            self._abort()
            raise

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronizes the accelerator after receiving, which raises on a CPU-only host
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._abort()  # vLLM ends the update when this raises: leave the model servable
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        if self._update is None:
            raise RuntimeError(f"{BACKEND}: update_weights before start_weight_update")
        experts, repack = self._update
        if update_info.last:
            experts.check()
            repack.check()
            return
        tensors, mapped, start = [], [], 0
        for i, (src, count) in enumerate(update_info.parts):
            part = slice(start, start + count)
            start += count
            names, dtype_names, shapes = update_info.names[part], update_info.dtype_names[part], update_info.shapes[part]
            _, size = packed_offsets(dtype_names, shapes)
            path = update_info.shm_paths[i] if update_info.shm_paths else None
            if path is not None:
                # private mapping: reading costs no copy
                buf = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
                mapped.append(buf)
            else:
                buf = torch.empty(size, dtype=torch.uint8)
                recv(self.group, buf, src, update_info.tag, self.timeout_s)
            tensors.extend(unpack(buf, names, dtype_names, shapes))
            self.received_from[src] = self.received_from.get(src, 0) + size
        experts.stage(update_info.names)
        self.model.load_weights(tensors)
        experts.loaded()
        for buf in mapped:
            _detach_buffered(buf)
        self.received_tensors += len(update_info.names)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._update is None:
            raise RuntimeError(f"{BACKEND}: finish_weight_update before start_weight_update")
        experts, repack = self._update
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            self._abort()
            raise
        self._update = None
        repack.finish()
        self.experts_packed_in_place = experts.finish()

    def _abort(self) -> None:
        if self._update is not None:
            for part in self._update:
                part.abort()
            self._update = None
        abandon_layerwise_reload(self.model)

    def shutdown(self) -> None:
        self.group = self._store = None
