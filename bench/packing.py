"""Training step time with packed micro batches vs right-padded ones, on one batch of long-tailed lengths.

    python bench/packing.py [--steps 6] [--warmup 1] [--samples 64] [--budget 4096] [--threads 1] [OVERRIDE ...]

The batch: ``--samples`` samples of the tiny Qwen3-MoE, prompts of 32-96 tokens, responses log-normal with a median
of 128 tokens and sigma 1.0, clipped to 8..2048 (p90 ~460, p99 ~1,300: the long tail of long-CoT rollouts, where a
few responses run 10x the median). Both layouts train under the same token budget per micro batch
(``trainer.max_tokens_per_micro_batch``): padded, a micro batch takes samples longest first while samples x its
longest fit (slime's dynamic batch size); packed, samples go end to end into rows of at most the budget.

One trainer, one set of weights: the log-probs of both layouts are compared first (replayed routes, the model's own
recorded routing), then GRPO steps with replay alternate between the layouts (which goes first alternates too), so
load on a shared machine hits both alike; the ratio is the median of the per-pair ratios.
Last line: ``packing: packed/padded train time <r>, max |dlogp| <x>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore")


def lengths(n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(32, 97, n)
    responses = np.clip(rng.lognormal(np.log(128), 1.2, n), 8, 3072).astype(int)
    return prompts, responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed pairs (packed + padded)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4096, help="trainer.max_tokens_per_micro_batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    from r3rl.config import compose
    from r3rl.sample import Sample, SampleStatus
    from r3rl.train.trainer import MegatronTrainer

    cfg = compose(["model=tiny_moe", f"trainer.max_tokens_per_micro_batch={args.budget}",
                   f"algorithm.global_batch_size={args.samples}", "algorithm.rollout_batch_size=1",
                   f"algorithm.n_samples_per_prompt={args.samples}", *args.overrides])
    trainer = MegatronTrainer(cfg)
    rng = np.random.default_rng(0)
    prompts, responses = lengths(args.samples, 1)
    samples = [Sample(index=i, group=0, request_id=str(i),
                      prompt_ids=rng.integers(3, cfg.model.vocab_size, p).astype(np.int32),
                      response_ids=rng.integers(3, cfg.model.vocab_size, r).astype(np.int32),
                      rollout_logprobs=np.zeros(r, np.float32), loss_mask=np.ones(r, np.float32),
                      finish_reason="length", status=SampleStatus.TRUNCATED)
               for i, (p, r) in enumerate(zip(prompts, responses))]
    for sample, routes in zip(samples, trainer.record_routes(samples)):
        sample.routed_experts = routes
    advantages = rng.standard_normal(args.samples).astype(np.float32)

    indices = list(range(args.samples))
    shapes = {}
    for packed in (True, False):
        trainer.packing = packed
        mbs = trainer._micro_batches(samples, indices, cfg.trainer.micro_batch_size, routes=None)
        shapes[packed] = (len(mbs), sum(mb.tokens.numel() for mb, _ in mbs))
    real = sum(s.num_tokens - 1 for s in samples)
    logprobs = {}
    for packed in (True, False):
        trainer.packing = packed
        logprobs[packed] = trainer.logprobs(samples, replay=True).logprobs
    dlogp = max(float(np.abs(a - b).max()) for a, b in zip(logprobs[True], logprobs[False]))

    def timed(packed: bool) -> float:
        trainer.packing = packed
        start = time.perf_counter()
        trainer.train_step(samples, advantages, replay=True, old_logprobs=logprobs[packed])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for i in tqdm(range(args.warmup), desc="warm-up", leave=False):
        timed(packed=i % 2 == 0)
    print(f"device={trainer.device} layers={cfg.model.num_layers} experts={cfg.model.num_experts} "
          f"top-k={cfg.model.moe_topk} threads={args.threads} budget={args.budget} tokens/micro batch")
    print(f"batch: {args.samples} samples, fed tokens per sample median {int(np.median(prompts + responses - 1))}, "
          f"p90 {int(np.percentile(prompts + responses - 1, 90))}, max {int((prompts + responses - 1).max())}; "
          f"{real} real tokens")
    for packed in (False, True):
        count, tokens = shapes[packed]
        print(f"  {'packed' if packed else 'padded'}: {count} micro batches, {tokens} tokens fed, padding share "
              f"{1 - real / tokens:.3f}")
    print(f"{'pair':>4}  {'packed s':>9}  {'padded s':>9}  {'ratio':>6}")
    ratios = []
    for step in tqdm(range(args.steps), desc="timed pairs", leave=False):
        if step % 2 == 0:
            p, u = timed(True), timed(False)
        else:
            u, p = timed(False), timed(True)
        ratios.append(p / u)
        print(f"{step:>4}  {p:>9.3f}  {u:>9.3f}  {p / u:>6.3f}", flush=True)
    trainer.shutdown()
    print(f"max |log-prob packed - padded| over {int(responses.sum())} response "
          f"tokens (replayed routes): {dlogp:.3g}")
    print(f"packing: packed/padded train time {statistics.median(ratios):.3f}, max |dlogp| {dlogp:.3g}")


if __name__ == "__main__":
    main()
