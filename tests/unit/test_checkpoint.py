from __future__ import annotations

import pytest

from r3rl import checkpoint as ckpt


def write(tag):
    def _write(folder):
        (folder / "state.txt").write_text(tag)

    return _write


def test_latest_points_at_newest_and_old_ones_are_pruned(tmp_path):
    assert ckpt.latest(tmp_path) is None
    for step in (1, 2, 3):
        ckpt.save(tmp_path, ckpt.CheckpointMeta(step=step, wandb_run_id="abc", data_state={"pos": step}),
                  write(f"s{step}"), keep=2)
    folder = ckpt.latest(tmp_path)
    assert folder.name == "step_000003" and (folder / "state.txt").read_text() == "s3"
    meta = ckpt.read_meta(folder)
    assert (meta.step, meta.wandb_run_id, meta.data_state) == (3, "abc", {"pos": 3})
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).glob("step_*")) == ["step_000002", "step_000003"]


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tmp_path):
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=1), write("s1"))

    def dies(folder):
        (folder / "half").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, ckpt.CheckpointMeta(step=2), dies)
    assert ckpt.latest(tmp_path).name == "step_000001"
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=2), write("s2"))  # the leftover partial folder is replaced
    assert ckpt.read_meta(ckpt.latest(tmp_path)).step == 2
