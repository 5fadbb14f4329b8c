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


def test_a_weight_file_is_its_owners_alone_and_never_written_through_a_link(tmp_path):
    """The weights a rank writes for the engines to map (in /dev/shm, world-readable by default) are created 0600, a
    file an older r3rl left 0644 becomes 0600 at its next write, and a symlink planted at the path is refused rather
    than followed (issue 59 item 4). Fails if ``write_packed`` opens with the default mode or follows links."""
    import errno
    import os

    from r3rl.sync.gloo_engine import write_packed

    tensors = [torch.arange(8, dtype=torch.float32)]
    old = os.umask(0o022)
    try:
        write_packed(tmp_path / "fresh", tensors, pack(tensors).numel())
        (tmp_path / "older").write_bytes(b"")
        (tmp_path / "older").chmod(0o644)
        write_packed(tmp_path / "older", tensors, pack(tensors).numel())
    finally:
        os.umask(old)
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "older").stat().st_mode & 0o777 == 0o600
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not yours")
    (tmp_path / "planted").symlink_to(target)
    with pytest.raises(OSError) as info:
        write_packed(tmp_path / "planted", tensors, pack(tensors).numel())
    assert info.value.errno == errno.ELOOP and target.read_bytes() == b"not yours"


def test_update_info_parts_must_cover_the_names_and_each_have_a_file_entry():
    with pytest.raises(ValueError, match="parts"):
        GlooUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1], [2]], parts=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="shm_paths"):
        GlooUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1], [2]], parts=[[0, 1], [1, 1]],
                       shm_paths=["/dev/shm/x"])
    # one part from rank 0 when the update names none (a single sender)
    assert GlooUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[1]]).parts == [[0, 1]]


def test_each_part_is_announced_under_its_owner_with_its_own_file(tmp_path):
    """Two trainer ranks stage their parts of a bucket; rank 0's update names each part's sender, tensors and file,
    and the file holds exactly that rank's tensors. Fails if parts were announced under the wrong rank or slot (the
    engine would read another rank's bytes), or if a part sent over sockets were given a file."""
    from r3rl.sync.gloo_engine import unpack
    from r3rl.sync.wires import GlooWire
    from r3rl.train.export import TensorMeta

    wires = []
    for rank in (0, 1):
        wire = GlooWire("127.0.0.1", 0, 30.0, 5.0, rank=rank, senders=2)
        wire._shm_dir = tmp_path
        wire._set_world(3, "r3rl-test")
        wire.begin()
        wires.append(wire)
    own = {0: [("embed", torch.arange(6, dtype=torch.float32))],
           1: [("e4", torch.full((2, 3), 4.0, dtype=torch.bfloat16)), ("e5", torch.ones(5, dtype=torch.float32))]}
    parts = [(r, [TensorMeta(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in own[r]])
             for r in (0, 1)]
    for bucket in range(4):  # the slot of bucket 0 comes round again at bucket 3
        staged = [wires[r].stage(own[r]) for r in (0, 1)]
        assert all(buf is None and by_file for buf, by_file in staged)
        info = wires[0].part_info(parts, [True, True])
        assert info["parts"] == [[0, 1], [1, 2]] and info["tag"] == bucket
        assert info["names"] == ["embed", "e4", "e5"]
        paths = info["shm_paths"]
        assert paths == [str(tmp_path / f"r3rl-test-r{r}-{bucket % 3}") for r in (0, 1)]
        got = unpack(torch.from_file(paths[1], size=(tmp_path / paths[1]).stat().st_size, dtype=torch.uint8),
                     info["names"][1:], info["dtype_names"][1:], info["shapes"][1:])
        assert all(torch.equal(t, want) for (_, t), (_, want) in zip(got, own[1]))
        GlooUpdateInfo(**{k: v for k, v in info.items()})
    # a part that went over sockets has no file
    assert wires[0].part_info(parts, [True, False])["shm_paths"][1] is None
    for wire in wires:
        wire.close()
    assert not list(tmp_path.iterdir())
