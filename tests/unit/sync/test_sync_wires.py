"""Which wire each backend gets, and that what r3rl's senders put on vLLM's protocol is what vLLM's own engines parse
(the worker-side dataclasses of vLLM 0.32: the same checks an engine runs on /init_weight_transfer_engine and
/update_weights). The data planes themselves run for real: r3rl_gloo in tests/integration/rollout, nccl and ipc in
the GPU-marked tests."""

from __future__ import annotations

import pytest
import torch

from r3rl.sync.wires import GlooWire, IpcWire, NcclWire, make_wire

KW = dict(master_address="127.0.0.1", master_port=29555, bucket_bytes=1 << 20, timeout_s=30.0)


def test_each_backend_gets_its_wire_and_disk_none():
    assert isinstance(make_wire("r3rl_gloo", **KW), GlooWire)
    assert isinstance(make_wire("nccl", **KW), NcclWire)
    assert isinstance(make_wire("ipc", **KW), IpcWire)
    with pytest.raises(ValueError, match="rollout.weight_sync.backend='disk'"):
        make_wire("disk", **KW)
    # a wire whose next update reuses the previous one's buffer lets only one be unanswered
    assert (GlooWire.in_flight, NcclWire.in_flight, IpcWire.in_flight) == (2, 2, 1)


def test_nccl_wire_speaks_vllms_nccl_engine():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    wire = make_wire("nccl", **KW)
    # two engines of two workers each behind the sender (rank 0): the second engine's workers are ranks 3 and 4
    info = NCCLWeightTransferInitInfo(**wire.init_info(3, 5))
    assert (info.master_address, info.master_port, info.rank_offset, info.world_size) == ("127.0.0.1", 29555, 3, 5)
    # packed, with the receive buffers as large as the sender's (must agree on both sides)
    assert info.packed and info.packed_buffer_size_bytes == 1 << 20 and info.packed_num_buffers == wire.num_buffers
    bucket = [("model.embed_tokens.weight", torch.zeros(4, 8)), ("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))]
    (update,) = list(wire.updates(bucket))
    parsed = NCCLWeightTransferUpdateInfo(**update.info)
    assert parsed.names == ["model.embed_tokens.weight", "model.norm.weight"]
    assert parsed.dtype_names == ["float32", "bfloat16"] and parsed.shapes == [[4, 8], [8]]
    assert update.transmit is not None and (update.tensors, update.nbytes) == (2, 4 * 8 * 4 + 8 * 2)


def test_ipc_wire_init_info_is_vllms():
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

    assert IPCWeightTransferInitInfo(**make_wire("ipc", **KW).init_info(1, 2)).packed


def test_gloo_wire_names_the_address_it_cannot_listen_on():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        wire = GlooWire("127.0.0.1", port, 30.0, 5.0)
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            wire.listen(2)
    wire.close()
