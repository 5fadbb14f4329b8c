"""A checkpoint's RNG files are read as tensors and plain values only (``weights_only=True``, issue 59 item 5)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from r3rl.train.checkpoint import load_rng, rng_file


@dataclasses.dataclass
class Layout:
    tp: int = 1
    pp: int = 1


class Payload:
    """What a crafted checkpoint would hold: an object whose unpickling runs code."""

    def __reduce__(self):
        return (Path.touch, (Path("/tmp/r3rl-rng-file-ran-code"),))


def test_rng_files_load_as_tensors_and_a_pickled_object_is_refused(tmp_path):
    """Fails if ``load_rng`` unpickled arbitrary objects again (the payload would create its marker file), or no
    longer loaded the tensors and plain values a save writes."""
    marker = Path("/tmp/r3rl-rng-file-ran-code")
    marker.unlink(missing_ok=True)
    file = rng_file(tmp_path, 0)
    file.parent.mkdir(parents=True)
    rng = {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.get_rng_state()}, "cuda": None}
    torch.save({"world_size": 1, "layout": dataclasses.asdict(Layout()), "rng": rng}, file)
    loaded = load_rng(tmp_path, 0, 1, Layout())
    assert torch.equal(loaded["torch"], rng["torch"]) and loaded["cuda"] is None
    torch.save({"world_size": 1, "layout": dataclasses.asdict(Layout()), "rng": Payload()}, file)
    with pytest.raises(pickle.UnpicklingError):
        load_rng(tmp_path, 0, 1, Layout())
    assert not marker.exists()
