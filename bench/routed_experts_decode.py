"""Decode + validate time of routed-experts payloads, next to the floor: a plain memory copy of the payload.

    python bench/routed_experts_decode.py [--tokens 1024 8192 32768] [--layers 48] [--topk 8] [--experts 128]
                                          [--numpy-only]

Payloads are what vLLM sends for one sample of T tokens: base64 of a ``uint8 [T-1, L, K]`` ``.npy`` (Qwen3-30B-A3B
shape by default), as the ``str`` the JSON body gives. Timed interleaved on the same payload (median of --repeats):

- memcpy: the payload's bytes copied into a new ``bytes`` (the allocation a decode pays too);
- base64: ``pybase64.b64decode(validate=True)`` alone, the step the old standard-library decode spent ~35 ms on;
- decode: the full ``decode_routed_experts`` (base64, .npy header, shape, ids < E, no all-zero layer, K distinct ids).

The peak Python-heap memory of one decode (tracemalloc) is shown next to the payload's size. The last line is the
ratio for the 32K-token sample (or the largest size given): ``decode/memcpy ratio: X`` (goal <= 5).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np
import pybase64

from r3rl.rollout import route_scan
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
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--numpy-only", action="store_true", help="measure the fallback used without Numba")
    args = parser.parse_args()
    if args.numpy_only:
        route_scan._compiled = {}
    spec = RouteSpec(args.layers, args.topk, args.experts)

    t0 = time.perf_counter()
    decode_routed_experts(payload(16, args.layers, args.topk, args.experts), 16, spec)
    kernel = "numba" if route_scan._numba_kernels() else "numpy"
    print(f"routes: L={args.layers} K={args.topk} E={args.experts} ({spec.dtype}); validation kernel: {kernel} "
          f"(first call incl. compile/cache load {1e3 * (time.perf_counter() - t0):.0f} ms, excluded below); "
          f"pybase64 {pybase64.get_version()}")
    print(f"{'tokens':>7} {'payload MB':>10} {'memcpy ms':>9} {'base64 ms':>9} {'decode ms':>9} "
          f"{'decode MB/s':>11} {'peak MB':>7} {'decode/memcpy':>13}")
    ratios = {}
    for tokens in args.tokens:
        s = payload(tokens, args.layers, args.topk, args.experts, seed=tokens)
        src = memoryview(s.encode("ascii"))
        copy_t, b64_t, decode_t = [], [], []
        for _ in range(args.repeats):
            a = time.perf_counter()
            bytes(src)
            c = time.perf_counter()
            pybase64.b64decode(s, validate=True)
            d = time.perf_counter()
            decode_routed_experts(s, tokens, spec)
            e = time.perf_counter()
            copy_t.append(c - a)
            b64_t.append(d - c)
            decode_t.append(e - d)
        m, b64, dec = (statistics.median(t) for t in (copy_t, b64_t, decode_t))
        mb = len(s) / 1e6
        peak = peak_bytes(lambda: decode_routed_experts(s, tokens, spec)) / 1e6
        ratios[tokens] = dec / m
        print(f"{tokens:>7} {mb:>10.2f} {1e3 * m:>9.2f} {1e3 * b64:>9.2f} {1e3 * dec:>9.2f} "
              f"{mb / dec:>11.0f} {peak:>7.2f} {dec / m:>13.2f}")
    print(f"decode/memcpy ratio: {ratios.get(32768, ratios[max(ratios)]):.2f}")


if __name__ == "__main__":
    main()
