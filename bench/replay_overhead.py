"""Training step time with routing replay vs without, on the same batch of the tiny Qwen3-MoE (CPU or GPU).

    python bench/replay_overhead.py [--steps 15] [--warmup 3] [--samples 8] [--tokens 128] [--threads 1]

Steps alternate between replay and no replay on one trainer (the cost does not depend on the weights), so load on
a shared machine hits both alike; the ratio is the median of the per-pair ratios. Routes are the model's own
recorded routing, so both modes send the same tokens to the same experts and only the replay machinery differs.
Last line: ``replay/no_replay step time ratio: X``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sample (half prompt, half response)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from r3rl.config import compose
    from bench_samples import random_samples
    from r3rl.train.trainer import MegatronTrainer

    cfg = compose(["model=tiny_moe", f"trainer.micro_batch_size={args.micro_batch}",
                   f"algorithm.global_batch_size={args.samples}", "algorithm.rollout_batch_size=1",
                   f"algorithm.n_samples_per_prompt={args.samples}", *args.overrides])
    trainer = MegatronTrainer(cfg)
    rng = np.random.default_rng(0)
    samples = random_samples(args.samples, args.tokens, cfg.model.vocab_size, rng)
    for sample, routes in zip(samples, trainer.record_routes(samples)):
        sample.routed_experts = routes
    advantages = rng.standard_normal(args.samples).astype(np.float32)
    old = trainer.logprobs(samples, replay=True).logprobs

    def timed(replay: bool) -> float:
        start = time.perf_counter()
        trainer.train_step(samples, advantages, replay=replay, old_logprobs=old)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for i in range(args.warmup):
        timed(replay=i % 2 == 0)
    print(f"device={trainer.device} layers={cfg.model.num_layers} experts={cfg.model.num_experts} "
          f"top-k={cfg.model.moe_topk} batch={args.samples}x{args.tokens} micro_batch={args.micro_batch} "
          f"threads={args.threads}")
    print(f"{'step':>4}  {'replay ms':>10}  {'no replay ms':>12}  {'ratio':>6}")
    ratios, with_replay, without = [], [], []
    for step in range(args.steps):
        # alternate which mode goes first, so a slow spell never favours one side
        if step % 2 == 0:
            r, n = timed(True), timed(False)
        else:
            n, r = timed(False), timed(True)
        with_replay.append(r)
        without.append(n)
        ratios.append(r / n)
        print(f"{step:>4}  {r * 1e3:>10.1f}  {n * 1e3:>12.1f}  {r / n:>6.3f}")
    print(f"median   {statistics.median(with_replay) * 1e3:>8.1f}  {statistics.median(without) * 1e3:>12.1f}")
    trainer.shutdown()
    print(f"replay/no_replay step time ratio: {statistics.median(ratios):.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
