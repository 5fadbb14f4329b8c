"""What an eval point reports per set, as pure functions of the scored samples.

With n samples of every prompt, ``avg@n`` is the mean reward over them. ``pass@k`` is the unbiased estimator of
Chen et al. (2021): with c of a prompt's n samples correct, ``1 - C(n - c, k) / C(n, k)`` is the chance that k
samples drawn without replacement hold a correct one, averaged over prompts. ``pass@n`` (k = n) is only "any of the
n correct"; a set's ``k`` below n logs ``pass@k`` beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from r3rl import metrics as M

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


def overlaps_key(name: str) -> str:
    """The count of set ``name``'s problems left out as training problems (``r3rl.eval.sets``)."""
    return f"eval/{name}/overlaps_removed"


def metric_keys(name: str, n: int, k: int | None = None) -> dict[str, str]:
    """The keys of set ``name`` with ``n`` samples per prompt; ``pass_k`` only when ``k`` is set and below n."""
    base = f"eval/{name}"
    keys = {"avg": f"{base}/avg@{n}", "avg_stderr": f"{base}/avg@{n}_stderr", "pass": f"{base}/pass@{n}",
            "pass_stderr": f"{base}/pass@{n}_stderr",
            "length": f"{base}/response_length_mean", "truncated": f"{base}/truncated_share"}
    if k is not None and k != n:
        keys |= {"pass_k": f"{base}/pass@{k}", "pass_k_stderr": f"{base}/pass@{k}_stderr"}
    return keys


def set_metrics(name: str, n: int, rewards: Sequence[float], groups: Sequence[int], lengths: Sequence[int],
                truncated: Sequence[bool], k: int | None = None,
                problems: Mapping[int, str] | None = None) -> dict[str, float]:
    """The metrics of one set from its samples (``groups[i]``: the prompt of sample i, n samples per prompt;
    ``k``: pass@k's k besides n, None for pass@n only). Each figure is a mean over prompts; its standard error is
    clustered by problem (``problems``: prompt -> normalised problem; without it every prompt is its own), since
    the independent draws are the problems, not the prompts that restate one or the samples of one prompt."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    if not len(r) == len(g) == len(lengths) == len(truncated) or len(r) == 0:
        raise ValueError(f"eval set {name}: rewards, groups, lengths and truncated must be equal and non-empty")
    prompts = np.unique(g)
    clusters = [problems[int(p)] for p in prompts] if problems is not None else list(prompts)
    per_prompt = [r[g == p] for p in prompts]
    if any(len(x) != n for x in per_prompt):
        counts = sorted({len(x) for x in per_prompt})
        raise ValueError(f"eval set {name}: every prompt needs n={n} samples, got {counts}")
    correct = [int((x >= CORRECT).sum()) for x in per_prompt]
    keys = metric_keys(name, n, k)
    out: dict[str, float] = {}
    out[keys["avg"]], out[keys["avg_stderr"]] = M.mean_and_stderr([x.mean() for x in per_prompt], clusters)
    out[keys["pass"]], out[keys["pass_stderr"]] = M.mean_and_stderr([pass_at_k(n, c, n) for c in correct], clusters)
    if "pass_k" in keys:
        out[keys["pass_k"]], out[keys["pass_k_stderr"]] = M.mean_and_stderr(
            [pass_at_k(n, c, k) for c in correct], clusters)
    out[keys["length"]] = float(np.mean(lengths))
    out[keys["truncated"]] = float(np.mean(np.asarray(truncated, dtype=np.float64)))
    return out
