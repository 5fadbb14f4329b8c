"""Decode + validate throughput of routed-experts payloads, next to the floor: ``base64.b64decode`` alone.

    python bench/routed_experts_decode.py [--tokens 1024 8192 32768] [--layers 48] [--topk 8] [--experts 128]
                                          [--numpy-only]

Payloads are what vLLM sends for one sample of T tokens: base64 of a ``uint8 [T-1, L, K]`` ``.npy`` (Qwen3-30B-A3B
shape by default). For each size the two are timed interleaved on the same payload (median of --repeats), and the
peak Python-heap memory of one decode (tracemalloc: the decoded bytes plus temporaries) is reported next to the
payload's own size. The last line is the worst ratio over the sizes: ``decode/floor ratio: X`` (goal <= 1.5).
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time
import tracemalloc

import numpy as np

from r3rl.rollout import _kernels
from r3rl.rollout.routed_experts import RouteSpec, decode_routed_experts, encode_routed_experts


def payload(tokens: int, layers: int, topk: int, experts: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    # distinct ids per row without a [rows, E] temporary: a random start plus a stride coprime-ish to E
    start = rng.integers(0, experts, size=(tokens - 1, layers, 1))
    arr = ((start + np.arange(topk) * 17) % experts).astype(np.uint8 if experts <= 256 else np.uint16)
    return encode_routed_experts(arr)


def peak_bytes(fn) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--numpy-only", action="store_true", help="measure the fallback used without Numba")
    args = parser.parse_args()
    if args.numpy_only:
        _kernels._compiled = {}
    spec = RouteSpec(args.layers, args.topk, args.experts)

    t0 = time.perf_counter()
    decode_routed_experts(payload(16, args.layers, args.topk, args.experts), 16, spec)
    kernel = "numba" if _kernels._get_swar_compiled() else "numpy"
    print(f"routes: L={args.layers} K={args.topk} E={args.experts} ({spec.dtype}); distinct-ids kernel: {kernel} "
          f"(first call incl. compile/cache load {1e3 * (time.perf_counter() - t0):.0f} ms, excluded below)")
    header = (f"{'tokens':>7} {'payload MB':>10} {'floor ms':>9} {'decode ms':>10} {'floor MB/s':>10} "
              f"{'decode MB/s':>11} {'Mtok/s':>7} {'peak MB':>8} {'floor peak':>10} {'ratio':>6}")
    print(header)
    worst = 0.0
    for tokens in args.tokens:
        s = payload(tokens, args.layers, args.topk, args.experts, seed=tokens)
        floor_t, decode_t = [], []
        for _ in range(args.repeats):
            a = time.perf_counter()
            base64.b64decode(s)
            b = time.perf_counter()
            decode_routed_experts(s, tokens, spec)
            c = time.perf_counter()
            floor_t.append(b - a)
            decode_t.append(c - b)
        f, d = statistics.median(floor_t), statistics.median(decode_t)
        mb = len(s) / 1e6
        peak = peak_bytes(lambda: decode_routed_experts(s, tokens, spec)) / 1e6
        floor_peak = peak_bytes(lambda: base64.b64decode(s)) / 1e6
        ratio = d / f
        worst = max(worst, ratio)
        print(f"{tokens:>7} {mb:>10.2f} {1e3 * f:>9.2f} {1e3 * d:>10.2f} {mb / f:>10.0f} {mb / d:>11.0f} "
              f"{tokens / d / 1e6:>7.2f} {peak:>8.2f} {floor_peak:>10.2f} {ratio:>6.2f}")
    print(f"decode/floor ratio: {worst:.2f}")


if __name__ == "__main__":
    main()
