"""Real W&B offline runs written by WandbLogger and read back by r3rl's own reader."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
from rich.console import Console

from r3rl.config import compose
from r3rl.metrics import STEP_AXES
from r3rl.plan import wandb_naming
from r3rl.tracking import WandbFileError, WandbLogger, print_summary, read_run
from r3rl.tracking.offline_reader import find_run_files, read_records

STEPS = 40  # with ~30 metrics per step the file spans several 32 KiB blocks
BIG_NOTE = "r3 " * 25_000  # a config record longer than a block: stored as FIRST/MIDDLE/LAST chunks
W_ENV = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR")


@pytest.fixture(scope="module")
def cfg():
    return compose(["model=tiny_moe", "parallelism=cpu", "rollout=vllm_r3", "run.name=offline-test",
                    "logger.wandb.tags=[ci]"])


@pytest.fixture(scope="module")
def logged(cfg, tmp_path_factory, make_step_metrics, wandb_processes):
    """One offline run of STEPS steps; yields (run_dir, logger, the metrics logged per step)."""
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        for var in (*W_ENV, "WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME"):
            mp.delenv(var, raising=False)
        naming = wandb_naming(cfg)
        assert naming.mode == "offline"  # the CPU profile's default
        config = {**dataclasses.asdict(cfg), "notes": BIG_NOTE}
        logger = WandbLogger(config, naming, run_dir)
        logged = {step: make_step_metrics(step, r3=True) for step in range(STEPS)}
        for step in (0, STEPS - 1):  # eval points, on the same step numbers as the training rows
            logged[step].update({"eval/arith/avg@4": 0.1 * step, "eval/arith/pass@4": 0.5})
        for step, metrics in logged.items():
            logger.log(metrics, step=step)
        during = wandb_processes()
        logger.finish()
        env_after = {var: os.environ.get(var) for var in W_ENV}
        yield run_dir, logger, logged, during, env_after


def test_reader_gets_every_metric_at_every_step(logged):
    run_dir, logger, metrics, _, _ = logged
    run = read_run(run_dir)
    assert run.steps == list(range(STEPS))  # one history row per step
    for row in run.history:
        expected = metrics[row["_step"]]
        assert {k: row[k] for k in expected} == expected
        # an R3 run logs no r2/ key (and a GRPO run no sft/ key); eval/ only at eval points
        assert {k.split("/", 1)[0] for k in expected} - {"eval"} == set(STEP_AXES) - {"r2", "eval", "sft"}
        for prefix, axis in STEP_AXES.items():
            if any(k.startswith(f"{prefix}/") for k in expected):
                assert row[axis] == row["_step"]  # each prefix's own step axis
            else:
                assert axis not in row
    assert [row["_step"] for row in run.history if "eval/arith/avg@4" in row] == [0, STEPS - 1]
    assert run.metric_step_axes == {f"{p}/*": axis for p, axis in STEP_AXES.items()}
    assert run.summary["train/logprob_abs_diff"] == metrics[STEPS - 1]["train/logprob_abs_diff"]
    assert run.exit_code == 0 and not run.truncated
    assert run.run_id == logger.run_id


def test_reader_gets_config_and_naming(logged, cfg):
    run_dir, _, _, _, _ = logged
    run = read_run(run_dir)
    assert run.config == {**dataclasses.asdict(cfg), "notes": BIG_NOTE}
    assert run.name == "offline-test"
    assert run.group == "tiny_moe-cpu"
    assert run.tags == ("r3:on", "replay:r3", "correction:none", "model:tiny_moe", "parallelism:cpu", "ci")
    assert run.r3 is True
    assert run.project == "r3rl"
    # the framing really was exercised: several blocks, and the config split across chunks
    (path,) = find_run_files(run_dir)
    assert path.stat().st_size > 3 * 32 * 1024


def test_files_stay_under_the_run_folder_and_nothing_is_left_running(logged, wandb_processes):
    run_dir, logger, _, during, env_after = logged
    (path,) = find_run_files(run_dir)
    assert path.name == f"run-{logger.run_id}.wandb"
    assert path.parent.parent == run_dir / "wandb" and path.parent.name.startswith("offline-run-")
    assert (run_dir / "wandb" / "cache").is_dir()
    assert during, "wandb-core should run while the run is open"
    assert wandb_processes() == []  # finish() stopped W&B's service process
    assert env_after == {var: None for var in W_ENV}  # the W&B folders are not left in the environment


def test_resume_writes_into_the_same_run_id(logged, cfg, tmp_path, wandb_processes):
    run_dir, first, metrics, _, _ = logged
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    # the job died after step 39 but its last checkpoint was at step 37: the resumed job redoes 38 and 39
    second = WandbLogger(cfg, wandb_naming(cfg), copy, resume_id=first.run_id)
    assert second.run_id == first.run_id
    redone = {step: {"train/logprob_abs_diff": 1000.0 + step} for step in range(38, 44)}
    for step, m in redone.items():
        second.log(m, step=step)
    second.finish()
    files = find_run_files(copy)
    assert [f.name for f in files] == [f"run-{first.run_id}.wandb"] * 2  # two segments, one run id
    run = read_run(copy)
    assert run.run_id == first.run_id and len(run.files) == 2
    assert run.steps == list(range(44))  # still one row per step
    assert run.series("train/logprob_abs_diff")[1][36:] == [metrics[36]["train/logprob_abs_diff"],
                                                          metrics[37]["train/logprob_abs_diff"],
                                                          *[1000.0 + s for s in range(38, 44)]]
    assert wandb_processes() == []


def test_disabled_writes_nothing(cfg, tmp_path, no_wandb_env):
    naming = dataclasses.replace(wandb_naming(cfg), mode="disabled")
    logger = WandbLogger(cfg, naming, tmp_path / "run", resume_id="keepme1")
    logger.log({"train/loss": 1.0}, step=0)
    logger.finish()
    assert logger.run_id == "keepme1"
    assert logger.history == [{"_step": 0, "train/loss": 1.0}]
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []
    assert all(os.environ.get(var) is None for var in W_ENV)


def test_log_is_once_per_step_with_known_prefixes(cfg, tmp_path, no_wandb_env):
    naming = dataclasses.replace(wandb_naming(cfg), mode="disabled")
    logger = WandbLogger(cfg, naming, tmp_path)
    logger.log({"train/loss": 1.0}, step=3)
    with pytest.raises(ValueError, match="step 3 was already logged"):
        logger.log({"train/loss": 2.0}, step=3)
    with pytest.raises(ValueError, match="'val/acc': keys must start with one of train/, rollout/, r3/, r2/, rollout_corr/, perf/, eval/"):
        logger.log({"val/acc": 1.0}, step=4)
    with pytest.raises(ValueError, match="is a step axis"):
        logger.log({"train/step": 4}, step=4)
    with pytest.raises(TypeError, match="'train/loss': expected a number, got str"):
        logger.log({"train/loss": "high"}, step=4)
    with pytest.raises(ValueError, match="logger.wandb.mode='sometimes'"):
        WandbLogger(cfg, dataclasses.replace(naming, mode="sometimes"), tmp_path)


def test_reader_survives_a_cut_tail_and_rejects_corruption(logged, tmp_path):
    run_dir, _, _, _, _ = logged
    (path,) = find_run_files(run_dir)
    data = path.read_bytes()
    cut = tmp_path / "cut" / path.name
    cut.parent.mkdir()
    cut.write_bytes(data[:-5])  # a crash while writing the last record
    records, truncated = read_records(cut)
    assert truncated and len(records) == len(read_records(path)[0]) - 1
    run = read_run(cut)
    assert run.steps == list(range(STEPS)) and run.truncated

    bad = tmp_path / "bad" / path.name
    bad.parent.mkdir()
    broken = bytearray(data)
    broken[7 + 7 + 2] ^= 0xFF  # inside the first record's payload
    bad.write_bytes(bytes(broken))
    with pytest.raises(WandbFileError, match="checksum mismatch in the chunk at byte 7"):
        read_run(bad)
    with pytest.raises(WandbFileError, match="not a W&B run file"):
        read_run(_write(tmp_path / "other" / "run-x.wandb", b"hello"))


def _write(path, content: bytes):
    path.parent.mkdir()
    path.write_bytes(content)
    return path


def test_summary_table_of_the_logged_history(logged):
    _, logger, metrics, _, _ = logged
    console = Console(record=True, width=160)
    print_summary(logger.history, console=console)
    text = console.export_text()
    assert f"({STEPS} steps)" in text
    assert "train/logprob_abs_diff_no_replay" in text and "r3/routing_flip_rate" in text
    mean = sum(m["train/logprob_abs_diff"] for m in metrics.values()) / STEPS
    assert f"{mean:.4g}" in text
    assert "logprob_abs_diff replay / no replay" in text
