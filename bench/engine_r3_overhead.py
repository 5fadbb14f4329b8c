"""Engine throughput with and without ``--enable-return-routed-experts``, side by side on the same runner.

    python bench/engine_r3_overhead.py [--prompts 16] [--prompt-len 64] [--max-tokens 64] [--repeats 6]
                                       [override ...]   # Hydra overrides, e.g. rollout.engine.dtype=float32

Both engines come from the same plan (``rollout=vllm_r3`` and ``rollout=vllm``; both run Model Runner V2, see
``r3rl.plan.engine_env``), one at a time on a free port, with the same prompts and per-sample seeds. Each
serves one warm-up request, then the batch --repeats times through ``RolloutClient`` (so the R3 figure includes
decoding and validating the routes). Tokens/s = generated tokens / wall time of the batch (median over repeats).
The last line: ``r3/no_r3 throughput ratio: X``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from r3rl.config import compose
from r3rl.config.schema import SamplingConfig
from r3rl.models.tiny_moe import ensure_checkpoint
from r3rl.net import free_port
from r3rl.plan import build_plan
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import VLLMEngine


def measure(rollout: str, overrides: list[str], prompts: list[list[int]], sampling: SamplingConfig,
            repeats: int, log_dir: Path) -> dict:
    cfg = compose(["model=tiny_moe", f"rollout={rollout}", f"rollout.engine.base_port={free_port()}", *overrides])
    ensure_checkpoint(cfg.model)
    launch = build_plan(cfg).engines[0]
    start = time.perf_counter()
    with VLLMEngine.launch(launch, log_dir, cfg.rollout.engine.startup_timeout_s) as engine:
        startup = time.perf_counter() - start
        client = RolloutClient.from_config(cfg, [engine.url], progress=False,
                                           max_concurrency=len(prompts))
        client.generate_sync(prompts[:1], 1, SamplingConfig(temperature=1.0, max_tokens=4, seed=0))
        rates, tokens = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            samples = client.generate_sync(prompts, 1, sampling)
            wall = time.perf_counter() - t0
            n = sum(s.response_length for s in samples)
            rates.append(n / wall)
            tokens = [s.response_ids.tolist() for s in samples]
    return {"rollout": rollout, "dtype": build_plan(cfg).engine_dtype, "startup_s": startup,
            "tok_s": statistics.median(rates), "runs": rates, "tokens": tokens,
            "generated": sum(len(t) for t in tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both engines")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1234)
    with tempfile.TemporaryDirectory(prefix="r3rl-bench-") as tmp:
        results = [measure(r, args.overrides, prompts, sampling, args.repeats, Path(tmp)) for r in ("vllm_r3", "vllm")]
    r3, base = results
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, up to {args.max_tokens} new tokens each, "
          f"all in flight, {args.repeats} timed runs per engine; engine dtype {r3['dtype']}")
    print(f"{'engine':>10} {'start-up s':>10} {'generated':>9} {'tokens/s (median)':>18}  runs")
    for r in results:
        runs = ", ".join(f"{x:.1f}" for x in r["runs"])
        print(f"{r['rollout']:>10} {r['startup_s']:>10.1f} {r['generated']:>9} {r['tok_s']:>18.1f}  [{runs}]")
    print(f"same tokens in both engines: {'yes' if r3['tokens'] == base['tokens'] else 'no'}")
    print(f"r3/no_r3 throughput ratio: {r3['tok_s'] / base['tok_s']:.3f}")


if __name__ == "__main__":
    main()
