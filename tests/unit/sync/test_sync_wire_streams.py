"""``r3rl.sync.wires.after_stream`` on a CPU, with stand-in streams: each item is handed to the packer only after
the packer's current stream was made to wait on the source stream (the GPU race itself is
``tests/integration/rollout/test_gpu_wire_streams.py``)."""

from __future__ import annotations

import torch

from r3rl.sync import wires


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait", self.name, other.name))


def test_every_item_waits_on_the_source_stream_before_it_is_packed(monkeypatch):
    """Fails if ``after_stream`` yields an item before the current (packer) stream waits on the source, or if
    ``NcclWire.transmit`` stops feeding vLLM's producer through it (the wrapped iterator is what reaches the pack)."""
    log: list = []
    source, packers = FakeStream("recv", log), [FakeStream("pack0", log), FakeStream("pack1", log)]
    current = {"s": packers[0]}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: current["s"])
    items = [("a", 1), ("b", 2), ("c", 3)]
    for i, item in enumerate(wires.after_stream(source, items)):
        log.append(("pack", current["s"].name, item[0]))
        current["s"] = packers[(i + 1) % 2]  # vLLM's producer switches buffers and streams between chunks
    assert log == [("wait", "pack0", "recv"), ("pack", "pack0", "a"), ("wait", "pack1", "recv"),
                   ("pack", "pack1", "b"), ("wait", "pack0", "recv"), ("pack", "pack0", "c")]
    # on the source stream itself nothing waits
    log.clear()
    current["s"] = source
    assert list(wires.after_stream(source, items)) == items and log == []


def test_nccl_wire_feeds_vllms_producer_through_after_stream(monkeypatch):
    """Fails if ``NcclWire.updates`` passes the bare bucket to ``packed_nccl_broadcast_producer`` (no wait on the
    stream current when the bucket was handed over) instead of ``after_stream``."""
    import pytest

    packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    log: list = []
    recv, pack = FakeStream("recv", log), FakeStream("pack", log)
    current = {"s": recv}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: current["s"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU cannot be had here: streams are stand-ins

    def producer(iterator, group, src, post_iter_func, **kw):
        current["s"] = pack  # vLLM packs inside its own stream's context
        for item in iterator:
            log.append(("pack", current["s"].name, item[0]))

    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", producer)
    wire = wires.NcclWire("127.0.0.1", 1, 1 << 20)
    update = next(wire.updates([("w", torch.zeros(2)), ("b", torch.zeros(1))]))
    update.transmit()
    assert log == [("wait", "pack", "recv"), ("pack", "pack", "w"), ("wait", "pack", "recv"), ("pack", "pack", "b")]
