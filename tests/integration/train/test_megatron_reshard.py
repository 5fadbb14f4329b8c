"""Checkpoints in Megatron's distributed format resume under another parallel layout: expert parallel 1 -> 2 with
Megatron's distributed optimizer, then back to one rank with the CPU profile's AdamW, model and Adam state
resharded each time; a crash while saving leaves the previous checkpoint in place; formats a trainer cannot read are
refused by name."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from megatron_helpers import build_samples, random_routes, with_routes
from megatron_reshard_worker import run
from test_megatron_expert_parallel import EP2, finish, launch
from r3rl.train.grpo import group_advantages

WORKER = Path(__file__).with_name("megatron_reshard_worker.py")
DISTOPT = ["trainer.use_distributed_optimizer=true", "trainer.micro_batch_size=2",
           "trainer.max_tokens_per_micro_batch=48"]


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def same_step(got: dict, want: dict) -> None:
    for metric in ("loss", "grad_norm"):
        assert abs(got[metric] - want[metric]) <= 1e-5 * max(1.0, abs(want[metric])), (metric, got, want)
    for metric in ("lr", "step"):
        assert got[metric] == want[metric], (metric, got[metric], want[metric])


def test_checkpoint_reshards_between_expert_parallel_1_and_2(tmp_path, tiny_model_dir, torchrun_rendezvous):
    """One rank (8 local experts) saves; two expert-parallel ranks (4 each) load it, step and save; one rank with the
    CPU profile's AdamW loads that (the optimizers share the fully reshardable keys). Each side's first log-probs
    equal the saving side's last ones (1e-5), and its next step equals the saving run's own next step: loss, grad
    norm, lr, step count, and the log-probs after it (1e-4, the EP 1/EP 2 numerics).
    Fails if an expert lands on the wrong rank or index (log-probs), if the Adam moments or masters are not
    resharded (zeros or another expert's moments move the step elsewhere), if the optimizer step count is lost
    (lr, step), or if a layout check refuses the other layout."""
    samples = build_samples(8, 41)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=41))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    one = run(samples, adv, None, str(tmp_path / "ep1"), DISTOPT)
    assert one["local_experts"] == 8
    info = json.loads((tmp_path / "ep1" / "COMPLETE").read_text())
    assert info["layout"]["expert_parallel"] == 1 and info["world_size"] == 1 and info["optimizer_step"] == 2

    src, dst = tmp_path / "in.pkl", tmp_path / "out.pkl"
    src.write_bytes(pickle.dumps((samples, adv)))
    procs = launch(2, [str(src), str(dst), str(tmp_path / "ep1"), str(tmp_path / "ep2"), *DISTOPT, *EP2], tmp_path,
                   torchrun_rendezvous(2), worker=WORKER)
    finish(procs, tmp_path, timeout=400, log_tail=3000)
    two = pickle.loads(dst.read_bytes())
    assert two["world_size"] == 2 and two["local_experts"] == 4 and two["extra"] == {"saved_by": 1}
    assert max_diff(two["before"], one["after"]) < 1e-5
    same_step(two["step"], one["next"])
    assert max_diff(two["after"], one["next_after"]) < 1e-4

    back = run(samples, adv, str(tmp_path / "ep2"), str(tmp_path / "ep1_again"), ["trainer.micro_batch_size=2"])
    assert back["extra"] == {"saved_by": 2}
    assert max_diff(back["before"], two["after"]) < 1e-5
    same_step(back["step"], two["next"])
    assert max_diff(back["after"], two["next_after"]) < 1e-4


def test_a_crash_while_saving_leaves_the_previous_checkpoint(new_trainer, tmp_path, monkeypatch):
    """A save that dies halfway (here: Megatron's writer raising, as a full disk would) leaves the earlier
    checkpoint under its name, loadable, and only a ``.partial`` folder beside it. Fails if the save writes into
    the final folder before it is complete, or removes the old one first."""
    from megatron.core import dist_checkpointing

    samples = build_samples(4, 43)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=43))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    trainer = new_trainer("algorithm.global_batch_size=4")
    trainer.train_step(samples, adv, replay=True)
    folder = trainer.save_checkpoint(tmp_path / "ckpt", extra={"n": 1})
    saved = trainer.logprobs(samples, replay=True).logprobs
    trainer.train_step(samples, adv, replay=True)

    real_save = dist_checkpointing.save

    def dies_midway(state, directory, **kwargs):
        (Path(directory) / "__0_0.distcp").write_bytes(b"half")  # a shard on disk, then the fault
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dist_checkpointing, "save", dies_midway)  # a fault this machine cannot cause on demand
    with pytest.raises(OSError, match="No space"):
        trainer.save_checkpoint(tmp_path / "ckpt", extra={"n": 2})
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    assert (tmp_path / ".ckpt.partial").is_dir()
    assert trainer.load_checkpoint(folder) == {"n": 1}
    assert max_diff(trainer.logprobs(samples, replay=True).logprobs, saved) == 0.0


def test_the_old_per_rank_format_is_refused_by_name(new_trainer, tmp_path):
    """A folder of r3rl's earlier format (rank00000.pt files, COMPLETE holding the rank count) gets an error naming
    the format change instead of a deep Megatron failure. Fails if ``read_complete`` stops telling the formats
    apart."""
    from r3rl.checkpoint import CheckpointFormatError

    old = tmp_path / "old"
    old.mkdir()
    (old / "COMPLETE").write_text("1")
    trainer = new_trainer()
    with pytest.raises(CheckpointFormatError, match="old per-rank format.*megatron_dist"):
        trainer.load_checkpoint(old)


def test_a_dp_reshardable_checkpoint_is_refused_under_another_optimizer(new_trainer, tmp_path):
    """Megatron's dp_reshardable optimizer state (each rank's flat buffers) only fits the distributed optimizer of
    the same layout; loading it anywhere else is refused naming trainer.checkpoint.sharding, before Megatron's
    loader fails on missing keys. Fails if ``_check_optimizer_format`` stops checking."""
    samples = build_samples(4, 44)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=44))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    saver = new_trainer("algorithm.global_batch_size=4", *DISTOPT, "trainer.checkpoint.sharding=dp_reshardable")
    saver.train_step(samples, adv, replay=True)
    folder = saver.save_checkpoint(tmp_path / "ckpt")
    assert json.loads((folder / "COMPLETE").read_text())["optimizer_format"] == "dp_reshardable"
    with pytest.raises(ValueError, match="trainer.checkpoint.sharding=dp_reshardable.*without the distributed"):
        new_trainer("algorithm.global_batch_size=4").load_checkpoint(folder)


def test_an_async_save_holds_the_state_of_its_step_while_training_goes_on(new_trainer, tmp_path):
    """trainer.checkpoint.async_save: the save returns before the files are written, the next step changes every
    weight meanwhile, and the finished checkpoint still holds the weights and Adam state of the step it was taken
    at (the next step after loading equals the one taken straight after the save). Fails if the background writer
    reads live tensors instead of their state at the save, if the folder gets its name before every shard is
    written, or if finalizing is skipped."""
    samples = build_samples(4, 45)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=45))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    trainer = new_trainer("algorithm.global_batch_size=4", "trainer.checkpoint.async_save=true")
    trainer.train_step(samples, adv, replay=True)
    at_save = trainer.logprobs(samples, replay=True).logprobs
    folder = trainer.save_checkpoint(tmp_path / "ckpt", extra={"n": 1})
    straight = trainer.train_step(samples, adv, replay=True)  # while the writer runs
    assert max_diff(trainer.logprobs(samples, replay=True).logprobs, at_save) > 1e-4
    trainer.finish_saves()
    assert trainer.poll_saves() and (folder / "COMPLETE").is_file() and not (tmp_path / ".ckpt.partial").exists()

    resumed = new_trainer("algorithm.global_batch_size=4")
    assert resumed.load_checkpoint(folder) == {"n": 1}
    assert max_diff(resumed.logprobs(samples, replay=True).logprobs, at_save) == 0.0
    again = resumed.train_step(samples, adv, replay=True)
    for metric in ("loss", "grad_norm", "lr", "step"):
        assert again[metric] == straight[metric], metric
