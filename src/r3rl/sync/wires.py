"""The wires of a weight sync, one per ``rollout.weight_sync.backend``; ``make_wire`` is the one place that picks it.

Every wire carries the same bucket stream (``r3rl.train.export.HFBucketStream``) under the same protocol driver
(``r3rl.sync.protocol.TransferSender``); only how a bucket's bytes reach the engine workers differs:

- ``r3rl_gloo`` (CPU profile): r3rl's engine (``r3rl.sync.gloo_engine``); one gloo broadcast per bucket, or on
  one host a shared-memory file the engines map.
- ``nccl`` (GPUs, engines apart from the trainer): vLLM's NCCL engine. The sender is vLLM's trainer side
  (``nccl_common.trainer_init`` opens rank 0 of the group, ``packed_nccl_broadcast_producer`` sends a bucket through
  its double-buffered packed broadcast), driven per bucket instead of once per model so that no rank holds more
  than one bucket.
- ``ipc`` (GPUs, colocated): vLLM's IPC engine. Every trainer rank holds the bucket's packed chunk (vLLM's
  ``pack_tensors``) on its own GPU (rank 0 broadcasts it over the trainer's group) and exports a CUDA IPC handle;
  the handles are gathered by GPU UUID and rank 0 posts them, so each engine worker maps the copy on its GPU.
"""

from __future__ import annotations

import base64
import os
import pickle
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from r3rl.sync.protocol import Update, Wire

GPU_BACKENDS = ("nccl", "ipc")


def make_wire(backend: str, *, master_address: str, master_port: int, bucket_bytes: int, timeout_s: float,
              join_timeout_s: float = 60.0, rank: int = 0, senders: int = 1, shared_memory: bool | None = None
              ) -> Wire:
    """The wire of ``backend`` (``r3rl.plan.weight_sync_backend`` resolved it; ``disk`` has none) for trainer rank
    ``rank`` of ``senders``."""
    if backend == "r3rl_gloo":
        return GlooWire(master_address, master_port, timeout_s, join_timeout_s, rank=rank, senders=senders,
                        shared_memory=shared_memory)
    if backend == "nccl":
        return NcclWire(master_address, master_port, bucket_bytes)
    if backend == "ipc":
        return IpcWire(bucket_bytes)
    raise ValueError(f"rollout.weight_sync.backend={backend!r} has no transfer wire (disk syncs through files)")


def _meta(bucket: list[tuple[str, Any]]) -> dict[str, Any]:
    return {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def _nbytes(bucket: list[tuple[str, Any]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


class GlooWire(Wire):
    """r3rl's CPU wire: every trainer rank is a sender in one gloo group with the engine workers (ranks
    ``0 .. senders-1``, then the workers) and sends the part of each bucket it owns itself; on loopback each part
    goes through shared-memory files its owner writes and the engines map (one copy in, one copy out, no sockets).

    Rank 0 runs ``listen``/``init_info`` and posts the updates (``TransferSender``); every rank runs ``connect`` and,
    per bucket, ``stage`` (its own part) and ``transmit``. ``updates`` is the single-sender form (rank 0 holds the
    whole bucket), for buckets that do not come from the trainer's stream."""

    backend = "r3rl_gloo"
    in_flight = 2
    many_senders = True
    # a part's file is rewritten ``in_flight + 1`` buckets later: by then the update that read it has answered
    slots = in_flight + 1

    def __init__(self, master_address: str, master_port: int, timeout_s: float, join_timeout_s: float,
                 *, shared_memory: bool | None = None, rank: int = 0, senders: int = 1) -> None:
        self.address, self.port = master_address, master_port
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        self.rank, self.senders = rank, senders
        self.shared_memory = master_address in ("127.0.0.1", "localhost") if shared_memory is None \
            else shared_memory
        self.group = self._store = self._buf = None  # _buf: the warm pack buffer, as large as the largest part
        self.world = 0
        self._count = 0  # buckets so far, the same on every rank: the tag of a bucket and its file slot
        shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self._shm_dir = shm_dir
        self._shm_prefix = ""
        self._shm_files: list[Path] = []
        self._shm_cleanup = None

    def endpoint(self) -> dict[str, Any]:
        """What the other trainer ranks need to join (rank 0, after ``listen``)."""
        return {"master_address": self.address, "master_port": self.port, "world_size": self.world,
                "shm_prefix": self._shm_prefix}

    def listen(self, world_size: int) -> None:
        from r3rl.sync.gloo_engine import open_store

        self._set_world(world_size, f"r3rl-weights-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            self._store = open_store(self.address, self.port, world_size, self.join_timeout_s, is_master=True)
        except Exception as err:
            raise RuntimeError(f"weight transfer: the sender cannot listen on {self.address}:{self.port} "
                               f"({type(err).__name__}: {err}); no engine was contacted") from err
        self.port = self._store.port

    def _set_world(self, world_size: int, shm_prefix: str) -> None:
        self.world, self._shm_prefix = world_size, shm_prefix
        # rewritten in place sync after sync: their pages stay allocated (a fresh file pays the kernel's page
        # allocation for every 4 KiB, which on a busy host costs more than the copy itself)
        self._shm_files = [self.shm_file(self.rank, i) for i in range(self.slots)]
        self._shm_cleanup = weakref.finalize(self, _unlink, list(self._shm_files))

    def shm_file(self, rank: int, slot: int) -> Path:
        return self._shm_dir / f"{self._shm_prefix}-r{rank}-{slot}"

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {"master_address": self.address, "master_port": self.port, "rank_offset": rank_offset,
                "world_size": world_size, "timeout_s": self.timeout_s, "join_timeout_s": self.join_timeout_s}

    def connect(self, endpoint: dict[str, Any] | None = None) -> None:
        """Join the group: rank 0 over the store it listens on, the other ranks at rank 0's ``endpoint``."""
        from r3rl.sync.gloo_engine import open_group, open_store

        if endpoint is not None:
            self.address, self.port = endpoint["master_address"], endpoint["master_port"]
            self._set_world(endpoint["world_size"], endpoint["shm_prefix"])
            self._store = open_store(self.address, self.port, self.world, self.join_timeout_s, is_master=False)
        self.group = open_group(self._store, self.address, self.rank, self.world, self.join_timeout_s)

    # -- one bucket, every rank sending its own part ------------------------------------------------------------
    def begin(self) -> None:
        """A new sync: bucket numbers (tags, file slots) restart; every earlier update has answered."""
        self._count = 0

    def stage(self, part: list[tuple[str, Any]]) -> tuple[Any, bool]:
        """Make this rank's part of the next bucket ready (its file written, or its buffer packed); every rank calls
        it once per bucket, with an empty part where it owns nothing. Returns what ``transmit`` sends (None:
        nothing) and whether the part went by file. The file's previous bucket has answered (``slots``)."""
        from r3rl.sync.gloo_engine import pack, packed_offsets, write_packed

        slot, self._count = self._count % self.slots, self._count + 1
        if not part:
            return None, False
        ts = [t.detach().cpu() for _, t in part]
        info = _meta(part)
        _, size = packed_offsets(info["dtype_names"], info["shapes"])
        if self._use_file(slot, size):
            write_packed(self._shm_files[slot], ts, size)
            return None, True
        buf = pack(ts, self._buf)
        if self._buf is None or buf.numel() > self._buf.numel():
            self._buf = buf
        return buf, False

    def _use_file(self, slot: int, size: int) -> bool:
        if not self.shared_memory:
            return False
        path = self._shm_files[slot]
        held = path.stat().st_size if path.exists() else 0
        # a small /dev/shm (containers default to 64 MiB) would fail the write: send those parts
        return shutil.disk_usage(self._shm_dir).free + held > 2 * size

    def part_info(self, parts: list[tuple[int, list[Any]]], by_file: list[bool]) -> dict[str, Any]:
        """The update of the bucket staged last (rank 0), from every part's ``(owner, TensorMeta list)`` and which
        owners wrote theirs to a file (indexed by rank): which rank sends which tensors, or where its file is."""
        slot = (self._count - 1) % self.slots
        names, dtypes, shapes, counts, paths = [], [], [], [], []
        for owner, metas in parts:
            names += [m.name for m in metas]
            dtypes += [m.dtype for m in metas]
            shapes += [list(m.shape) for m in metas]
            counts.append([owner, len(metas)])
            paths.append(str(self.shm_file(owner, slot)) if by_file[owner] else None)
        return {"names": names, "dtype_names": dtypes, "shapes": shapes, "parts": counts,
                "tag": self._count - 1, "shm_paths": paths}

    def transmit(self, staged: Any) -> None:
        """This rank's part of the bucket staged last, to every engine worker (nothing when it went by file)."""
        from r3rl.sync.gloo_engine import send

        if staged is not None:
            send(self.group, staged, range(self.senders, self.world), self._count - 1, self.timeout_s)

    # -- single sender ------------------------------------------------------------------------------------------
    def updates(self, bucket: list[tuple[str, Any]]) -> Iterator[Update]:
        from r3rl.sync.gloo_engine import packed_offsets

        if not bucket:
            return
        staged, by_file = self.stage(bucket)
        info = {**_meta(bucket), "parts": [[self.rank, len(bucket)]], "tag": self._count - 1}
        if by_file:
            info["shm_paths"] = [str(self._shm_files[(self._count - 1) % self.slots])]
            yield Update(info, len(bucket), packed_offsets(info["dtype_names"], info["shapes"])[1])
            return
        yield Update(info, len(bucket), staged.numel(), transmit=lambda: self.transmit(staged))

    def closing(self) -> Iterator[Update]:
        # the engines check that every MoE layer arrived whole: an error here ends the update cleanly in vLLM,
        # where an error in /finish_weight_update would leave it open and the engine refusing the next one
        yield Update({"names": [], "dtype_names": [], "shapes": [], "last": True}, 0, 0)

    def close(self) -> None:
        self.group = self._store = self._buf = None
        if self._shm_cleanup is not None:
            self._shm_cleanup()


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class NcclWire(Wire):
    """vLLM's NCCL engine; rank 0 of its group is the trainer rank the bucket stream gathers to."""

    backend = "nccl"
    in_flight = 2

    def __init__(self, master_address: str, master_port: int, bucket_bytes: int) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_NUM_BUFFERS

        self.address, self.port = master_address, master_port
        # the engines' receive buffers: one bucket each, double-buffered (must agree on both sides: sent at init)
        self.buffer_bytes, self.num_buffers = bucket_bytes, DEFAULT_PACKED_NUM_BUFFERS
        self.group = None
        self._world = 0

    def listen(self, world_size: int) -> None:
        self._world = world_size

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        return worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=self.address, master_port=self.port, rank_offset=rank_offset, world_size=world_size,
            packed=True, packed_buffer_size_bytes=self.buffer_bytes, packed_num_buffers=self.num_buffers))

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": self.address, "master_port": self.port,
                                   "world_size": self._world})

    def updates(self, bucket: list[tuple[str, Any]]) -> Iterator[Update]:
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if not bucket:
            return
        # the stream that received the bucket (the gather's recv and all_gather run on the trainer's current
        # stream without waiting): vLLM's producer packs on its own streams, so it must wait for this one
        source = torch.cuda.current_stream() if torch.cuda.is_available() else None  # None: no streams (CPU tests)

        def transmit() -> None:
            packed_nccl_broadcast_producer(after_stream(source, bucket), self.group, 0, lambda item: item[1],
                                           buffer_size_bytes=self.buffer_bytes, num_buffers=self.num_buffers)

        yield Update(_meta(bucket), len(bucket), _nbytes(bucket), transmit=transmit)

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


def after_stream(source: Any, items: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``items``, each handed out only after the stream current at that moment (the packer's, inside vLLM's
    ``packed_nccl_broadcast_producer``) waits for ``source``: the pack reads a tensor only once the work that
    wrote it on ``source`` is done (vLLM's own trainer example gets this by iterating inside that stream)."""
    import torch

    if source is None:
        yield from items
        return
    for item in items:
        current = torch.cuda.current_stream()
        if current != source:
            current.wait_stream(source)
        yield item


class IpcWire(Wire):
    """vLLM's IPC engine (colocated): the engines read each chunk in place on their own GPU, so the next chunk may
    only be packed once they have answered (``in_flight`` 1). Every trainer rank runs ``updates`` (collective over
    the trainer's default group); only rank 0's are posted."""

    backend = "ipc"
    in_flight = 1

    def __init__(self, bucket_bytes: int) -> None:
        self.buffer_bytes = bucket_bytes

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {"packed": True}  # must agree with how the chunks are encoded; no group to join

    def updates(self, bucket: list[tuple[str, Any]]) -> Iterator[Update]:
        import torch
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        ranks = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if ranks > 1 else 0
        device = torch.cuda.current_device()
        gpu = str(torch.cuda.get_device_properties(device).uuid)
        it = iter(bucket)
        while True:
            chunk = pack_tensors(it, lambda item: item[1], self.buffer_bytes) if rank == 0 else None
            meta = [None if chunk is None else (chunk.names, chunk.shapes,
                                                [str(d).removeprefix("torch.") for d in chunk.dtypes],
                                                chunk.tensor_sizes)]
            if ranks > 1:
                dist.broadcast_object_list(meta, src=0)
            if meta[0] is None:
                return
            names, shapes, dtype_names, sizes = meta[0]
            packed = chunk.packed_tensor if chunk is not None else \
                torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            handles = [{gpu: reduce_tensor(packed)[1]}]
            if ranks > 1:
                dist.broadcast(packed, src=0)  # every colocated GPU gets the chunk (NVLink)
                gathered: list = [None] * ranks
                dist.all_gather_object(gathered, handles[0])
                handles = [{k: v for h in gathered for k, v in h.items()}]
            torch.cuda.current_stream().synchronize()
            info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, "tensor_sizes": sizes,
                    "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles[0])).decode()}
            yield Update(info, len(names), sum(sizes))
            # rank 0 resumes once the engines answered: then no engine reads this chunk and every rank may free it
            if ranks > 1:
                dist.barrier()
            del packed, chunk
            torch.cuda.ipc_collect()


def participate(wire: Wire, buckets) -> None:
    """A trainer rank other than the sender: produce the buckets (collective) and, for a wire whose updates are
    collective (IPC), take part in each."""
    for bucket in buckets:
        if isinstance(wire, IpcWire):
            for _ in wire.updates(bucket):
                pass
