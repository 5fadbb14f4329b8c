"""One rank of a multi-process trainer run (started by test_megatron_expert_parallel with RANK/WORLD_SIZE set).

Usage: python megatron_ep_worker.py IN.pkl OUT.pkl OVERRIDE...   (rank 0 writes OUT.pkl)
       python megatron_ep_worker.py export DIR OVERRIDE...          (rank r writes DIR/rank{r}.pkl)
       python megatron_ep_worker.py packing IN.pkl DIR OVERRIDE...  (rank r writes DIR/rank{r}.pkl)
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")


def run(samples, advantages, overrides: list[str], adapter_dir: str | None = None) -> dict:
    """One batch: routes recorded, log-probs replayed and live, a step, log-probs after; with LoRA on, the adapters
    after the step exported as a PEFT folder to ``adapter_dir`` and returned (``adapter``)."""
    from safetensors.torch import load_file

    from r3rl.config import compose
    from r3rl.train import peft_adapter
    from r3rl.train.trainer import MegatronTrainer

    trainer = MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *overrides]))
    try:
        recorded = trainer.record_routes(samples)
        replayed = trainer.logprobs(samples, replay=True)
        live = trainer.logprobs(samples, replay=False)
        metrics = trainer.train_step(samples, advantages, replay=True, old_logprobs=replayed.logprobs)
        after = trainer.logprobs(samples, replay=True)
        adapter = None
        if adapter_dir is not None and trainer.cfg.trainer.lora.rank > 0:
            folder = trainer.export_adapter(adapter_dir, {})
            adapter = load_file(folder / peft_adapter.WEIGHTS) if trainer.info.rank == 0 else None
        return {
            "recorded": recorded, "replayed": replayed.logprobs, "live": live.logprobs, "flips": live.flip_per_layer,
            "match": replayed.replayed_routes_match, "metrics": metrics, "after": after.logprobs,
            "world_size": trainer.info.world_size, "dp_size": trainer.info.dp_size,
            "local_experts": len(trainer.bare.decoder.layers[0].mlp.experts.local_experts), "adapter": adapter,
        }
    finally:
        trainer.shutdown()


def packing(samples, advantages, overrides: list[str]) -> dict:
    """The same batch on the same weights, packed and padded: log-probs with and without replay, the loss and this
    rank's gradients; then a packed training step under replay (its routing-map check)."""
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    trainer = MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", *overrides]))
    try:
        out = {"rank": trainer.info.rank}
        for packed in (True, False):
            trainer.packing = packed
            replayed = trainer.logprobs(samples, replay=True)
            live = trainer.logprobs(samples, replay=False)
            grads = trainer.gradients(samples, advantages, replay=True, old_logprobs=replayed.logprobs)
            out["packed" if packed else "padded"] = {
                "replayed": replayed.logprobs, "live": live.logprobs, "flips": live.flip_per_layer,
                "match": replayed.replayed_routes_match, "mismatch_rows": replayed.replay_mismatch_rows,
                "loss": grads["loss"], "loss_tokens": grads["loss_tokens"],
                "grads": {k: v.numpy() for k, v in grads["grads"].items()}}
        trainer.packing = True
        out["rows"] = [mb.seq_len for mb, _ in trainer._micro_batches(samples, list(range(len(samples))),
                                                                      trainer.cfg.trainer.micro_batch_size,
                                                                      routes=None)]
        out["train"] = trainer.train_step(samples, advantages, replay=True)
        return out
    finally:
        trainer.shutdown()


def export(out_dir: str, overrides: list[str]) -> dict:
    """HF export to ``out_dir/hf`` and one streamed sync to rank 0, with the bytes this rank held at peak."""
    from pathlib import Path

    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    trainer = MegatronTrainer(compose(["model=tiny_moe", "parallelism=cpu", "algorithm.global_batch_size=8", *overrides]))
    try:
        trainer.export_hf(Path(out_dir) / "hf")
        stream = trainer.weight_stream()
        export_peak = stream.stats.peak_bytes
        received = {}
        sizes = []
        for bucket in stream.stream(dst=0):
            received.update({n: t.clone() for n, t in bucket})
            sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        return {
            "rank": trainer.info.rank, "export_peak": export_peak, "sync_peak": stream.stats.peak_bytes,
            "total": stream.total_bytes, "largest_item": max(i.nbytes for i in stream.items),
            "bucket_bytes": stream.bucket_bytes, "buckets": len(stream.buckets), "received": received,
            "bucket_sizes": sizes, "metadata": [(m.name, m.shape, m.dtype) for m in stream.metadata()],
        }
    finally:
        trainer.shutdown()


def main() -> None:
    if sys.argv[1] == "packing":
        src, out_dir, *overrides = sys.argv[2:]
        with open(src, "rb") as f:
            samples, advantages = pickle.load(f)
        result = packing(samples, advantages, overrides)
        with open(os.path.join(out_dir, f"rank{result['rank']}.pkl"), "wb") as f:
            pickle.dump(result, f)
        return
    if sys.argv[1] == "export":
        out_dir, *overrides = sys.argv[2:]
        result = export(out_dir, overrides)
        with open(os.path.join(out_dir, f"rank{result['rank']}.pkl"), "wb") as f:
            pickle.dump(result, f)
        return
    src, dst, *overrides = sys.argv[1:]
    with open(src, "rb") as f:
        samples, advantages = pickle.load(f)
    result = run(samples, advantages, overrides, adapter_dir=os.path.join(os.path.dirname(dst), "adapter_ep"))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(dst, "wb") as f:
            pickle.dump(result, f)


if __name__ == "__main__":
    main()
