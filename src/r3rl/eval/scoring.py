"""What an eval point reports per set, as pure functions of the scored samples.

``avg@k`` is the mean reward over the k samples of every prompt. ``pass@k`` is the unbiased estimator of Chen et al.
(2021): with n samples of a prompt of which c are correct, ``1 - C(n - c, k) / C(n, k)`` is the chance that k
samples drawn without replacement hold a correct one, averaged over prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# a reward at or above this counts as correct for pass@k (the math reward is 0 or 1)
CORRECT = 0.5


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # the product form of C(n-c, k) / C(n, k): exact in floats for the sizes evaluated (no huge binomials)
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def metric_keys(name: str, k: int) -> dict[str, str]:
    base = f"eval/{name}"
    return {"avg": f"{base}/avg@{k}", "avg_stderr": f"{base}/avg@{k}_stderr", "pass": f"{base}/pass@{k}",
            "pass_stderr": f"{base}/pass@{k}_stderr",
            "length": f"{base}/response_length_mean", "truncated": f"{base}/truncated_share"}


def set_metrics(name: str, k: int, rewards: Sequence[float], groups: Sequence[int], lengths: Sequence[int],
                truncated: Sequence[bool]) -> dict[str, float]:
    """The metrics of one set from its samples (``groups[i]``: the prompt of sample i, k samples per prompt)."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    if not len(r) == len(g) == len(lengths) == len(truncated) or len(r) == 0:
        raise ValueError(f"eval set {name}: rewards, groups, lengths and truncated must be equal and non-empty")
    prompts = np.unique(g)
    per_prompt = [r[g == p] for p in prompts]
    if any(len(x) != k for x in per_prompt):
        counts = sorted({len(x) for x in per_prompt})
        raise ValueError(f"eval set {name}: every prompt needs k={k} samples, got {counts}")
    means = np.asarray([x.mean() for x in per_prompt])
    passes = np.asarray([pass_at_k(k, int((x >= CORRECT).sum()), k) for x in per_prompt])
    keys = metric_keys(name, k)
    return {
        keys["avg"]: float(means.mean()),
        # prompts are the independent draws: the spread of their means, not of single samples
        keys["avg_stderr"]: float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else math.nan,
        keys["pass"]: float(passes.mean()),
        keys["pass_stderr"]: float(passes.std(ddof=1) / math.sqrt(len(passes))) if len(passes) > 1 else math.nan,
        keys["length"]: float(np.mean(lengths)),
        keys["truncated"]: float(np.mean(np.asarray(truncated, dtype=np.float64))),
    }
