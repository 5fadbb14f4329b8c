"""The r3rl_gloo wire layout: a bucket packs into one buffer and unpacks to the same tensors, on both sides alike."""

from __future__ import annotations

import pytest
import torch

from r3rl.sync.gloo_engine import ALIGN, GlooUpdateInfo, pack, packed_offsets, unpack


def test_mixed_dtypes_round_trip_exactly_at_aligned_offsets():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16),
               torch.randint(0, 255, (4, 3), generator=gen, dtype=torch.uint8), torch.randn(2, 2, 2, generator=gen)]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    offsets, size = packed_offsets(dtypes, shapes)
    assert all(o % ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    warm = torch.zeros(size + 100, dtype=torch.uint8)
    buf = pack(tensors, warm)
    assert buf.numel() == size and buf.data_ptr() == warm.data_ptr()  # packed into the warm buffer
    out = unpack(buf, ["a", "b", "c", "d"], dtypes, shapes)
    assert [n for n, _ in out] == ["a", "b", "c", "d"]
    for (_, got), want in zip(out, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_update_info_lists_must_agree():
    with pytest.raises(ValueError, match="same length"):
        GlooUpdateInfo(names=["a", "b"], dtype_names=["float32"], shapes=[[1], [2]])


def test_file_layout_equals_the_buffer_layout(tmp_path):
    from r3rl.sync.gloo_engine import write_packed

    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16), torch.arange(5)]
    buf = pack(tensors)
    write_packed(tmp_path / "bucket", tensors, buf.numel())
    data = torch.frombuffer(bytearray((tmp_path / "bucket").read_bytes()), dtype=torch.uint8)
    assert data.numel() == buf.numel()
    dtypes, shapes = [str(t.dtype).removeprefix("torch.") for t in tensors], [list(t.shape) for t in tensors]
    for (_, got), want in zip(unpack(data, ["a", "b", "c"], dtypes, shapes), tensors):
        assert torch.equal(got, want)


def test_file_rewritten_in_place_keeps_its_pages_and_reads_back_the_new_bucket(tmp_path):
    from r3rl.sync.gloo_engine import write_packed

    path = tmp_path / "bucket"
    big = [torch.full((1000,), 7.0), torch.full((300,), 3, dtype=torch.int64)]
    write_packed(path, big, pack(big).numel())
    inode, size = path.stat().st_ino, path.stat().st_size
    small = [torch.arange(20, dtype=torch.float32)]
    n = pack(small).numel()
    write_packed(path, small, n)
    # same file, not shrunk (a reader maps only the bucket's first bytes), and those bytes are the new bucket
    assert path.stat().st_ino == inode and path.stat().st_size == size > n
    data = torch.from_file(str(path), shared=False, size=n, dtype=torch.uint8)
    ((_, got),) = unpack(data, ["a"], ["float32"], [[20]])
    assert torch.equal(got, small[0])
