"""LoRA against full-parameter training on the same batch: step time, what the optimizer and the gradients hold,
and what a weight sync sends, side by side in one process (the tiny Qwen3-MoE on CPU, or a GPU's model).

    python bench/lora_cost.py [--rank 8] [--steps 12] [--warmup 2] [--samples 8] [--tokens 128] [--threads 1]

Two trainers of one config, one with ``trainer.lora.rank``; steps alternate between them, so load on a shared
machine hits both alike, and the time ratio is the median of the per-pair ratios. Bytes are counted from the live
tensors: the optimizer's state (fp32 masters and Adam moments of what trains), the float32 gradient buffers, the
merged weight sync's stream (``sync=merged`` sends every weight, base + B A) and the adapters alone (what
``sync=adapter`` would send). Last line: ``lora/full: step time X, optimizer state Y, gradients Z``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore")


def tensor_bytes(tree) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def optimizer_bytes(trainer) -> int:
    """The optimizer's state after a step: moments and, where the params are not float32, their masters."""
    inner = trainer.optimizer.inner
    state = tensor_bytes(getattr(inner, "optimizer", inner).state_dict().get("state", {}))
    masters = getattr(inner, "masters", None)
    if masters is not None:  # the CPU profile's AdamW: masters that are the params themselves cost nothing extra
        state += sum(m.numel() * m.element_size() for m, p in zip(masters, inner.params) if m is not p)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sample (half prompt, half response)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (both trainers)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from r3rl.config import compose
    from bench_samples import random_samples
    from r3rl.train import lora
    from r3rl.train.trainer import MegatronTrainer

    common = ["model=tiny_moe", "trainer.micro_batch_size=4", f"algorithm.global_batch_size={args.samples}",
              "algorithm.rollout_batch_size=1", f"algorithm.n_samples_per_prompt={args.samples}", *args.overrides]
    trainers = {"full": MegatronTrainer(compose(common)),
                "lora": MegatronTrainer(compose([*common, f"trainer.lora.rank={args.rank}"]))}
    cfg = trainers["full"].cfg
    rng = np.random.default_rng(0)
    samples = random_samples(args.samples, args.tokens, cfg.model.vocab_size, rng)
    for sample, routes in zip(samples, trainers["full"].record_routes(samples)):
        sample.routed_experts = routes
    advantages = rng.standard_normal(args.samples).astype(np.float32)

    def timed(name: str) -> float:
        start = time.perf_counter()
        trainers[name].train_step(samples, advantages, replay=True)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        timed("full"), timed("lora")
    ratios = []
    for i in range(args.steps):
        order = ("full", "lora") if i % 2 == 0 else ("lora", "full")
        got = {name: timed(name) for name in order}
        ratios.append(got["lora"] / got["full"])

    figures = {}
    for name, trainer in trainers.items():
        trained = [p for p in trainer.bare.parameters() if p.requires_grad]
        figures[name] = {
            "trained parameters": sum(p.numel() for p in trained),
            "optimizer state (bytes)": optimizer_bytes(trainer),
            "gradient buffers (bytes)": sum(p.main_grad.numel() * p.main_grad.element_size() for p in trained),
            "weight sync, merged (bytes)": trainer.weight_stream().total_bytes,
            "adapters alone (bytes)": sum(p.numel() * p.element_size() for _, p in lora.adapter_parameters(trainer.bare)),
        }
    print(f"{'':32} {'full':>16} {'lora r' + str(args.rank):>16} {'lora/full':>10}")
    for key in figures["full"]:
        full, low = figures["full"][key], figures["lora"][key]
        ratio = f"{low / full:.4f}" if full else "-"
        print(f"{key:32} {full:>16.6g} {low:>16.6g} {ratio:>10}")
    step = statistics.median(ratios)
    state = figures["lora"]["optimizer state (bytes)"] / figures["full"]["optimizer state (bytes)"]
    grads = figures["lora"]["gradient buffers (bytes)"] / figures["full"]["gradient buffers (bytes)"]
    for trainer in trainers.values():
        trainer.shutdown()
    print(f"lora/full: step time {step:.3f}, optimizer state {state:.4f}, gradients {grads:.4f}")


if __name__ == "__main__":
    main()
