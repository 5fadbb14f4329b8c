from __future__ import annotations

import json

import pytest

from r3rl import checkpoint as ckpt


def complete_trainer_state(folder):
    """What a finished trainer save leaves (r3rl.train.checkpoint), without any tensor."""
    (folder / ckpt.TRAINER_DIR).mkdir()
    (folder / ckpt.TRAINER_DIR / ckpt.COMPLETE).write_text(json.dumps({"format": ckpt.TRAINER_FORMAT}))


def write(tag):
    def _write(folder):
        (folder / "state.txt").write_text(tag)
        complete_trainer_state(folder)

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


def test_an_unfinished_trainer_state_is_never_published(tmp_path):
    """An async save publishes its folder only once the trainer ranks finished writing (their COMPLETE). Fails if
    ``publish`` names a checkpoint, and points ``latest`` at it, before that."""
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=1), write("s1"))
    folder = ckpt.begin(tmp_path, 2)
    (folder / ckpt.TRAINER_DIR).mkdir()  # the ranks are still writing
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        ckpt.publish(tmp_path, folder, ckpt.CheckpointMeta(step=2))
    assert ckpt.latest(tmp_path).name == "step_000001"
    (folder / ckpt.TRAINER_DIR / ckpt.COMPLETE).write_text(json.dumps({"format": ckpt.TRAINER_FORMAT}))
    assert ckpt.publish(tmp_path, folder, ckpt.CheckpointMeta(step=2)) == ckpt.latest(tmp_path)


def test_pruning_never_removes_a_step_newer_than_the_one_just_written(tmp_path):
    """A folder that holds a longer run's checkpoints (steps 5-7) and a new save at step 1 (issue 59 item 1): the
    new checkpoint stays and ``latest`` names it, the other run's stay too. Fails if pruning keeps the highest
    numbered folders (it deleted step 1 as it was written, leaving ``latest`` naming nothing)."""
    for step in (5, 6, 7):
        ckpt.save(tmp_path, ckpt.CheckpointMeta(step=step), write(f"s{step}"), keep=3)
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=1), write("new"), keep=2)
    assert ckpt.latest(tmp_path).name == "step_000001"
    assert [p.name for p in ckpt.existing_steps(tmp_path)] == ["step_000001", "step_000005", "step_000006",
                                                                "step_000007"]
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=2), write("new"), keep=2)
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=3), write("new"), keep=2)  # prunes its own run's step 1 only
    assert [p.name for p in ckpt.existing_steps(tmp_path)][:3] == ["step_000002", "step_000003", "step_000005"]


def test_a_step_saved_again_keeps_the_old_folder_until_the_new_one_is_named(tmp_path):
    """What ``kill -9`` leaves between the two renames of a step saved a second time (the old folder aside, the new
    one still partial, ``latest`` naming the step): ``latest`` resolves to the folder aside, and the next save of
    the step replaces both. Fails if ``publish`` removes the old folder before the rename (nothing left to resume)
    or ``latest`` ignores the folder aside. The kill itself, on a real trainer: tests/integration/train/
    test_megatron_checkpoint_kill.py."""
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=2), write("first"))
    final = ckpt.checkpoint_root(tmp_path) / "step_000002"
    final.rename(ckpt.aside_name(final))  # the state the kill leaves
    assert ckpt.latest(tmp_path) == ckpt.aside_name(final)
    assert (ckpt.latest(tmp_path) / "state.txt").read_text() == "first"
    ckpt.save(tmp_path, ckpt.CheckpointMeta(step=2), write("second"))
    assert (ckpt.latest(tmp_path) / "state.txt").read_text() == "second"
    assert not ckpt.aside_name(final).exists()
