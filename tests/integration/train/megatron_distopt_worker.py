"""One rank of a trainer run with Megatron's distributed optimizer: a GRPO step, a checkpoint, the next step twice
(once straight on, once after loading the checkpoint), and the bytes the rank holds.

Usage: python megatron_distopt_worker.py IN.pkl OUT.pkl CKPT_DIR OVERRIDE...   (rank 0 writes OUT.pkl)
Also imported by the tests for ``held_bytes`` and ``run``.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def held_bytes(trainer) -> dict[str, int]:
    """What this rank's trainer actually holds: parameters, DDP gradient buffers, optimizer master copies and state."""
    from r3rl.train.optim import MegatronOptimizer

    params = sum(_bytes(p) for p in trainer.bare.parameters())
    grads = sum(_bytes(b.grad_data) for b in trainer.model.buffers + trainer.model.expert_parallel_buffers)
    state, masters = 0, 0
    if isinstance(trainer.optimizer, MegatronOptimizer):
        for part in trainer.optimizer._parts():
            inner = part.optimizer
            state += sum(_bytes(v) for s in inner.state.values() for k, v in s.items() if k != "step")
            masters += sum(_bytes(p) for group in getattr(part, "shard_fp32_from_float16_groups", []) for p in group)
    else:
        adam = trainer.optimizer.inner
        state = sum(_bytes(v) for s in adam.optimizer.state.values() for k, v in s.items() if k != "step")
        masters = sum(_bytes(m) for m, p in zip(adam.masters, adam.params) if m is not p)
    return {"weights": params, "gradients": grads, "master weights": masters, "optimizer state": state}


def run(samples, advantages, ckpt: str, overrides: list[str]) -> dict:
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    cfg = compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *overrides])
    trainer = MegatronTrainer(cfg)
    try:
        first = trainer.train_step(samples, advantages, replay=True)
        held = held_bytes(trainer)
        trainer.save_checkpoint(ckpt)
        second = trainer.train_step(samples, advantages, replay=True)
        straight = trainer.logprobs(samples, replay=True).logprobs
        trainer.load_checkpoint(ckpt)
        again = trainer.train_step(samples, advantages, replay=True)
        resumed = trainer.logprobs(samples, replay=True).logprobs
        parts = trainer.optimizer._parts() if hasattr(trainer.optimizer, "_parts") else []
        return {
            "first": first, "second": second, "again": again, "straight": straight, "resumed": resumed,
            "held": held, "optimizers": [type(p).__name__ for p in parts],
            "world_size": trainer.info.world_size, "dp_size": trainer.info.dp_size,
            "local_experts": len(trainer.bare.decoder.layers[0].mlp.experts.local_experts),
        }
    finally:
        trainer.shutdown()


def main() -> None:
    src, dst, ckpt, *overrides = sys.argv[1:]
    with open(src, "rb") as f:
        samples, advantages = pickle.load(f)
    result = run(samples, advantages, ckpt, overrides)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(dst, "wb") as f:
            pickle.dump(result, f)


if __name__ == "__main__":
    main()
