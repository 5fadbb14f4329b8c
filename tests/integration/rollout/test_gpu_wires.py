"""The GPU wires' data planes against vLLM's own engine-side decoders (GPU-marked: skipped without CUDA; they also
need vLLM's CUDA build). IPC: a bucket packed by ``IpcWire`` is opened in another process by vLLM's
``packed_ipc_consumer`` from the handle posted in /update_weights' JSON. NCCL: ``NcclWire``'s per-bucket packed
broadcast is received by vLLM's ``packed_nccl_broadcast_consumer`` on a second GPU."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from r3rl.net import free_port
from r3rl.sync.wires import IpcWire, NcclWire

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def bucket(device: str = "cuda") -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(64, 32, generator=gen)),
            ("model.norm.weight", torch.randn(32, generator=gen).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(100, 32, generator=gen))]


def _ipc_engine(info: dict, out) -> None:
    import os

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_consumer

    u = IPCWeightTransferUpdateInfo(**info)
    got = packed_ipc_consumer(u.ipc_handles, u.names, u.shapes, u.dtype_names, u.tensor_sizes, 0)
    out.put([(n, t.cpu()) for n, t in got])


def test_ipc_wire_bucket_is_read_in_place_by_vllms_consumer():
    pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    want = bucket()
    wire = IpcWire(1 << 20)
    updates = wire.updates([(n, t.cuda()) for n, t in want])
    update = next(updates)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_ipc_engine, args=(update.info, out))
    proc.start()
    got = out.get(timeout=300)
    proc.join(60)
    assert next(updates, None) is None  # one chunk: the bucket fits the buffer
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got, want))


def _nccl_engine(port: int, info: dict, out) -> None:
    torch.cuda.set_device(1)
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    group = stateless_init_process_group("127.0.0.1", port, 1, 2, device=1)  # an engine worker at rank_offset 1
    got = []
    meta = [(n, (s, getattr(torch, d))) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])]
    packed_nccl_broadcast_consumer(iter(meta), group, 0, lambda pairs: got.extend((n, t.cpu()) for n, t in pairs),
                                   buffer_size_bytes=1 << 20, num_buffers=2)
    out.put(got)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
def test_nccl_wire_bucket_reaches_vllms_consumer():
    pytest.importorskip("vllm.distributed.weight_transfer.nccl_common")
    want = bucket()
    port = free_port()
    wire = NcclWire("127.0.0.1", port, 1 << 20)
    wire.listen(2)
    (update,) = list(wire.updates([(n, t.cuda()) for n, t in want]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_nccl_engine, args=(port, update.info, out))
    proc.start()
    wire.connect()
    update.transmit()
    got = dict(out.get(timeout=300))
    proc.join(60)
    wire.close()
    assert all(torch.equal(got[n], w) for n, w in want)
