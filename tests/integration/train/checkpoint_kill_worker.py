"""A trainer rank that saves run checkpoints (``r3rl.checkpoint`` around ``MegatronTrainer.save_checkpoint``, as the
recipe does) and is killed with SIGKILL in the middle of one: the test then resumes what is left.

Usage: python checkpoint_kill_worker.py RUN_DIR RECORD_DIR POINT
POINT: ``trainer_state`` (the shards and COMPLETE written, the trainer folder not yet renamed), ``pointer`` (the
step folder published, ``latest`` not yet moved), ``resave`` (step 2 saved again: the old folder renamed aside, the
new one not yet in its place), or ``loop`` (saves step after step until the test kills it from outside).
Before each save the log-probs of the state it saves go to RECORD_DIR/step_<n>.pkl (a step's second save to
step_<n>.again.pkl), so whatever ``latest`` names after the kill can be checked against what was saved there.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no handler, no cleanup: what kill -9 or the OOM killer does


def arm(point: str) -> None:
    """Make the process kill itself at ``point`` of its next save."""
    import r3rl.checkpoint as run_ckpt
    import r3rl.train.checkpoint as trainer_ckpt

    if point == "trainer_state":
        trainer_ckpt.sync_tree = lambda folder: die()
    elif point == "pointer":
        real = run_ckpt._fsync
        run_ckpt._fsync = lambda path: die() if Path(path).name == f".{run_ckpt.LATEST}.tmp" else real(path)
    elif point == "resave":
        real_rename = Path.rename

        def rename(self, target):
            out = real_rename(self, target)
            if Path(target).name.endswith(".replaced") and Path(target).name.startswith(".step_"):
                die()
            return out

        Path.rename = rename


def main() -> None:
    run_dir, record_dir, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    from megatron_helpers import build_samples, random_routes, with_routes
    from r3rl import checkpoint
    from r3rl.config import compose
    from r3rl.train.grpo import group_advantages
    from r3rl.train.trainer import MegatronTrainer

    samples = build_samples(4, 45)
    with_routes(samples, random_routes(samples, 4, 2, 8, seed=45))
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    trainer = MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=4"]))

    def save(step: int) -> None:
        trainer.train_step(samples, adv, replay=True)
        record = record_dir / f"step_{step}.pkl"
        if record.exists():  # ``resave``: what the kill leaves is the first save of the step
            record = record.with_suffix(".again.pkl")
        record.write_bytes(pickle.dumps({"step": step, "logprobs": trainer.logprobs(samples, replay=True).logprobs}))
        checkpoint._fsync(record)
        folder = checkpoint.begin(run_dir, step)
        trainer.save_checkpoint(folder / checkpoint.TRAINER_DIR)
        checkpoint.publish(run_dir, folder, checkpoint.CheckpointMeta(step=step), keep=2)
        print(f"saved {step}", flush=True)

    save(1)
    if point == "loop":
        step = 2
        while True:
            save(step)
            step += 1
    if point == "resave":
        save(2)
    arm(point)
    save(2)
    raise SystemExit(f"the save at {point} was not killed")


if __name__ == "__main__":
    main()
