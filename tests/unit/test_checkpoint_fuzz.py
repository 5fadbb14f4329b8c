"""Checkpoint folders are outside data once a run has died, been copied or edited: whatever the files under
``checkpoints/`` hold, the launch either resumes from a readable checkpoint or refuses naming ``run.resume`` and the
file at fault, before any process starts; never another exception (issue 59). Reproductions first, then Hypothesis
over the three files r3rl reads itself (``latest``, ``meta.json``, ``COMPLETE``) and missing ones. The trainer
state's shards are Megatron's to read: killed saves of them are tests/integration/train/test_megatron_checkpoint_kill.py.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3rl import checkpoint as ckpt

FUZZ = settings(max_examples=300, derandomize=True, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.too_slow])
RUN_DIR = Path(tempfile.mkdtemp(prefix="r3rl-ckpt-fuzz-"))


@functools.cache
def cfg():
    from r3rl.config import compose

    return compose(["model=tiny_moe", "parallelism=cpu", f"run.output_dir={RUN_DIR}"])


def fresh_checkpoint() -> Path:
    """A run folder holding one good checkpoint (step 3) of the tiny model."""
    shutil.rmtree(RUN_DIR / "checkpoints", ignore_errors=True)

    def write(folder):
        (folder / ckpt.TRAINER_DIR).mkdir()
        (folder / ckpt.TRAINER_DIR / ckpt.COMPLETE).write_text(json.dumps(
            {"format": ckpt.TRAINER_FORMAT, "model_name": "tiny_moe", "model_shape": ckpt.model_shape(cfg().model),
             "optimizer_step": 3, "optimizer_state": True, "optimizer_format": "fully_reshardable",
             "freeze_router": False}))

    return ckpt.save(RUN_DIR, ckpt.CheckpointMeta(step=3, data_state={"epoch": 0, "position": 12}), write)


def outcome() -> list[tuple[str, str]]:
    """The one outcome allowed: resume_problems returns (never raises); an empty list means every file reads."""
    from r3rl.preflight import resume_problems

    found = resume_problems(cfg())
    assert all(isinstance(k, str) and isinstance(r, str) for k, r in found)
    if not found:
        folder = ckpt.latest(RUN_DIR)
        ckpt.read_meta(folder)
        ckpt.read_complete(folder / ckpt.TRAINER_DIR)
    return found


@pytest.mark.parametrize("damage, said", [
    (lambda f: (f / ckpt.META).write_text("{"), "meta.json: not valid JSON"),
    (lambda f: (f / ckpt.META).write_text('{"step": 3, "extra": 1}'), "not the meta.json r3rl writes"),
    (lambda f: (f / ckpt.META).write_text("[3]"), "a JSON list"),
    (lambda f: (f / ckpt.META).write_text('{"step": 3, "data_state": {"pending": 5}}'), "data_state.pending"),
    (lambda f: (f / ckpt.TRAINER_DIR / ckpt.COMPLETE).write_bytes(b"\xff\xfe"), "COMPLETE: not valid JSON"),
    (lambda f: (f / ckpt.TRAINER_DIR / ckpt.COMPLETE).unlink(), "no COMPLETE marker"),
    (lambda f: (f.parent / ckpt.LATEST).write_text("../../elsewhere"), "not a step_NNNNNN folder"),
    (lambda f: (f.parent / ckpt.LATEST).write_text("step_000009"), "names step_000009, which has no meta.json"),
    (lambda f: shutil.rmtree(f), "names step_000003, which has no meta.json"),
])
def test_a_damaged_checkpoint_is_refused_before_launch_naming_the_file(damage, said):
    """Each raised JSONDecodeError/TypeError out of the preflight or the recipe's start (or was silently skipped
    by the preflight, to fail after Ray and the trainer ranks started). Fails if ``resume_problems`` swallows an
    unreadable checkpoint again, or a reader lets Python's own exception out."""
    damage(fresh_checkpoint())
    (key, reason), = outcome()
    assert key == "run.resume" and said in reason, reason


TEXT = st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                max_size=4), max_leaves=10)


@st.composite
def meta_records(draw):
    record = {"step": 3, "wandb_run_id": None, "data_state": {"epoch": 0, "position": 12}, "weight_version": 0}
    for key in draw(st.lists(st.sampled_from([*record, "unlogged_metrics", "other"]), max_size=3)):
        record[key] = draw(JSON)
    return json.dumps(record).encode()


@st.composite
def complete_records(draw):
    record = {"format": ckpt.TRAINER_FORMAT, "model_name": "tiny_moe", "model_shape": ckpt.model_shape(cfg().model),
              "optimizer_state": True, "freeze_router": False}
    for key in draw(st.lists(st.sampled_from([*record, "optimizer_format"]), max_size=3)):
        record[key] = draw(JSON)
    return json.dumps(record).encode()


@FUZZ
@given(meta=st.one_of(st.none(), TEXT, meta_records()), complete=st.one_of(st.none(), TEXT, complete_records()),
       latest=st.one_of(st.none(), TEXT, st.sampled_from([b"step_000003", b"step_000003\n", b"step_3", b""])),
       remove=st.sampled_from([None, "meta", "complete", "trainer", "folder"]))
def test_any_checkpoint_files_resume_or_are_refused_naming_them(meta, complete, latest, remove):
    folder = fresh_checkpoint()
    if meta is not None:
        (folder / ckpt.META).write_bytes(meta)
    if complete is not None:
        (folder / ckpt.TRAINER_DIR / ckpt.COMPLETE).write_bytes(complete)
    if latest is not None:
        (folder.parent / ckpt.LATEST).write_bytes(latest)
    if remove == "meta":
        (folder / ckpt.META).unlink()
    elif remove == "complete":
        (folder / ckpt.TRAINER_DIR / ckpt.COMPLETE).unlink()
    elif remove in ("trainer", "folder"):
        shutil.rmtree(folder / ckpt.TRAINER_DIR if remove == "trainer" else folder)
    outcome()


def teardown_module():
    shutil.rmtree(RUN_DIR, ignore_errors=True)
