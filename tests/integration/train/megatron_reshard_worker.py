"""Trainer ranks that continue another layout's checkpoint: load it (or start fresh and step once), log-probs, a GRPO
step, log-probs, save, then one more step straight on (what a run resumed from that save must reproduce).

Usage: python megatron_reshard_worker.py IN.pkl OUT.pkl LOAD_DIR|- SAVE_DIR OVERRIDE...   (rank 0 writes OUT.pkl)
Also imported by the test, which runs the one-rank side in its own process with ``run``.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")


def run(samples, advantages, load: str | None, save: str, overrides: list[str]) -> dict:
    """Without ``load``: a first step from the initial weights (so the saved optimizer has moments). With it: the
    checkpoint's state."""
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    cfg = compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *overrides])
    trainer = MegatronTrainer(cfg)
    try:
        out = {"world_size": trainer.info.world_size,
               "local_experts": len(trainer.bare.decoder.layers[0].mlp.experts.local_experts)}
        if load is None:
            trainer.train_step(samples, advantages, replay=True)
        else:
            out["extra"] = trainer.load_checkpoint(load)
        out["before"] = trainer.logprobs(samples, replay=True).logprobs
        out["step"] = trainer.train_step(samples, advantages, replay=True)
        out["after"] = trainer.logprobs(samples, replay=True).logprobs
        trainer.save_checkpoint(save, extra={"saved_by": trainer.info.world_size})
        out["next"] = trainer.train_step(samples, advantages, replay=True)
        out["next_after"] = trainer.logprobs(samples, replay=True).logprobs
        return out
    finally:
        trainer.shutdown()


def main() -> None:
    src, dst, load, save, *overrides = sys.argv[1:]
    with open(src, "rb") as f:
        samples, advantages = pickle.load(f)
    result = run(samples, advantages, None if load == "-" else load, save, overrides)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(dst, "wb") as f:
            pickle.dump(result, f)


if __name__ == "__main__":
    main()
