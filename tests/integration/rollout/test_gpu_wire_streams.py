"""The NCCL wire's producer waits for the stream that received the bucket (issue 23 item 2; GPU-marked: skipped
without CUDA). A deliberately slow writer fills the bucket on one stream (as the trainer's gather receives it on
its current stream, without waiting), the packer runs on another (vLLM's ``packed_nccl_broadcast_producer`` packs
on its own cached streams); the bytes that reach the broadcast must equal the source."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s at 2 GHz: the pack would otherwise read the buffers long before the copy


def slow_bucket(writer: torch.cuda.Stream) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    want = [torch.randn(256, 128, generator=gen), torch.randn(4096, generator=gen).to(torch.bfloat16)]
    dst = [torch.zeros(w.shape, dtype=w.dtype, device="cuda") for w in want]
    src = [w.cuda() for w in want]
    torch.cuda.synchronize()
    with torch.cuda.stream(writer):
        torch.cuda._sleep(SLEEP_CYCLES)
        for d, s in zip(dst, src):
            d.copy_(s)
    return [(f"t{i}", d) for i, d in enumerate(dst)], want


class RecordingGroup:
    """Stands for vLLM's PyNcclCommunicator on the sender: keeps what it was asked to broadcast (on the stream
    current at the call, as NCCL would read it)."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self.sent.append(tensor.clone())


def unpack(packed: torch.Tensor, want: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for w in want:
        n = w.numel() * w.element_size()
        out.append(packed[at:at + n].cpu().view(w.dtype).view(w.shape))
        at += n
    return out


def test_after_stream_orders_a_pack_on_another_stream_after_the_writer():
    """Fails if ``r3rl.sync.wires.after_stream`` stops making the packer's stream wait for the source stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from r3rl.sync.wires import after_stream

    writer, packer = torch.cuda.Stream(), torch.cuda.Stream()
    items, want = slow_bucket(writer)
    with torch.cuda.stream(packer):  # what vLLM's producer does: pack inside its own stream's context
        packed = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in after_stream(writer, items)])
    packer.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(unpack(packed, want), want))


def test_nccl_wire_packs_the_bucket_after_it_arrived():
    """Fails if ``NcclWire.updates`` hands vLLM's producer the bucket without waiting on the stream that was current
    when the bucket was handed over (the trainer's recv stream): the first bucket is packed before it arrived."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    from r3rl.sync.wires import NcclWire

    writer = torch.cuda.Stream()
    items, want = slow_bucket(writer)
    wire = NcclWire("127.0.0.1", 1, 1 << 20)
    wire.group = RecordingGroup()
    with torch.cuda.stream(writer):  # the trainer's stream that received the bucket
        update = next(wire.updates(items))
    update.transmit()  # no HTTP round trip in between: the race of the first bucket
    torch.cuda.synchronize()
    assert len(wire.group.sent) == 1
    assert all(torch.equal(g, w) for g, w in zip(unpack(wire.group.sent[0], want), want))
