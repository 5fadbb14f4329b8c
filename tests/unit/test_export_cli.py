"""``python -m r3rl.export``'s refusals: each is reported (exit 2, one line naming what is wrong) before anything
starts. The export itself runs in tests/integration/recipe/test_export_command.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r3rl import checkpoint
from r3rl.export import main


def fake_checkpoint(run_dir: Path, step: int, *, latest: bool = True) -> Path:
    """A checkpoint folder as the recipe leaves it (meta.json, trainer/COMPLETE), without any tensor."""
    folder = checkpoint.checkpoint_root(run_dir) / checkpoint.step_dir_name(step)
    (folder / "trainer").mkdir(parents=True)
    (folder / "trainer" / "COMPLETE").write_text(json.dumps({"format": checkpoint.TRAINER_FORMAT, "world_size": 1}))
    (folder / checkpoint.META).write_text(json.dumps({"step": step}))
    if latest:
        (checkpoint.checkpoint_root(run_dir) / checkpoint.LATEST).write_text(folder.name + "\n")
    return folder


@pytest.fixture
def no_start(monkeypatch):
    """Anything that would start Ray or the trainer ranks fails the test."""
    import r3rl.export as cli

    def refuse(*args, **kwargs):
        raise AssertionError("the export started something")

    monkeypatch.setattr(cli, "export", refuse)


def refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_a_missing_run_folder_is_named(tmp_path, capsys, no_start):
    """Fails if a mistyped run folder is not reported as such (e.g. the export starts, or says 'no checkpoint')."""
    err = refused(capsys, str(tmp_path / "nope"), "--out", str(tmp_path / "hf"))
    assert "no such run folder" in err and str(tmp_path / "nope") in err


def test_a_run_without_checkpoint_is_refused(tmp_path, capsys, no_start):
    """Fails if a run folder without a complete checkpoint (none yet, or only a partial one a crash left) is not
    refused with where the checkpoints should be."""
    run_dir = tmp_path / "run"
    (checkpoint.checkpoint_root(run_dir) / ".step_000002.partial").mkdir(parents=True)
    err = refused(capsys, str(run_dir), "--out", str(tmp_path / "hf"))
    assert "has no checkpoint" in err and "checkpoints" in err


def test_a_step_without_checkpoint_lists_the_steps_there(tmp_path, capsys, no_start):
    """Fails if ``--step N`` of a pruned or never-saved step is not refused with the steps that can be exported (an
    incomplete one, without its trainer state, is not listed)."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 4, latest=False)
    fake_checkpoint(run_dir, 6)
    (fake_checkpoint(run_dir, 8, latest=False) / "trainer" / "COMPLETE").unlink()
    err = refused(capsys, str(run_dir), "--step", "5", "--out", str(tmp_path / "hf"))
    assert "no checkpoint of step 5" in err and "steps available: 4, 6" in err


def test_a_non_empty_out_folder_is_never_written_into(tmp_path, capsys, no_start):
    """Fails if ``--out`` naming a folder with files (or a file) is accepted: the export would replace it."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 3)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = refused(capsys, str(run_dir), "--out", str(out))
    assert "not empty" in err and str(out) in err
    assert (out / "keep.txt").read_text() == "mine"
    err = refused(capsys, str(run_dir), "--out", str(out / "keep.txt"))
    assert "not a folder" in err


def test_a_folder_without_the_runs_config_is_not_a_run(tmp_path, capsys, no_start):
    """Fails if a checkpoint folder without the config run.py writes (``.hydra/config.yaml``) gets past the checks:
    the export could not know the run's model and parallelism."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 1)
    empty = tmp_path / "hf"
    empty.mkdir()  # an empty --out is fine
    err = refused(capsys, str(run_dir), "--out", str(empty))
    assert ".hydra/config.yaml" in err


def test_the_latest_checkpoint_is_the_default_step(tmp_path):
    """Fails if no ``--step`` picks another checkpoint than the one ``latest`` names (the one a resume would take)."""
    from r3rl.export import find_checkpoint

    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 6)
    fake_checkpoint(run_dir, 4)  # written after: latest names it
    assert find_checkpoint(run_dir, None).step == 4
    assert find_checkpoint(run_dir, 6).folder == checkpoint.checkpoint_root(run_dir.resolve()) / "step_000006"


def test_a_checkpoint_in_the_old_per_rank_format_is_refused_by_name(tmp_path, capsys, no_start):
    """r3rl's earlier trainer state (one torch.save file per rank, COMPLETE holding the rank count) is refused before
    anything starts, in one line naming the format change. Fails if ``check_format`` lets it through (every rank
    would fail deep inside Megatron's loader after Ray and the ranks started)."""
    from omegaconf import OmegaConf

    from r3rl.config import compose

    run_dir = tmp_path / "run"
    folder = fake_checkpoint(run_dir, 2)
    (folder / "trainer" / "COMPLETE").write_text("2")
    (run_dir / ".hydra").mkdir()
    cfg = compose(["parallelism=cpu", f"run.output_dir={run_dir}"])
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    err = refused(capsys, str(run_dir), "--out", str(tmp_path / "hf"))
    assert "old per-rank format" in err and "saved by 2 ranks" in err and checkpoint.TRAINER_FORMAT in err


def test_nothing_to_write_and_an_adapter_of_a_full_parameter_run_are_refused(tmp_path, capsys, no_start):
    """Fails if an export without ``--out`` or ``--adapter`` started anything, or if ``--adapter`` on a run that
    trained no adapters got past the checks (the trainer ranks would start, load the checkpoint, and find no
    adapter to write)."""
    from omegaconf import OmegaConf

    from r3rl.config import compose

    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 2)
    err = refused(capsys, str(run_dir))
    assert "--out" in err and "--adapter" in err
    (run_dir / ".hydra").mkdir()
    cfg = compose(["parallelism=cpu", f"run.output_dir={run_dir}"])
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    err = refused(capsys, str(run_dir), "--adapter", str(tmp_path / "peft"))
    assert "trainer.lora.rank=0" in err
    err = refused(capsys, str(run_dir), "--out", str(tmp_path / "x"), "--adapter", str(tmp_path / "x"))
    assert "same folder" in err
