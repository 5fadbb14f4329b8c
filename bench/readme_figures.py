"""The figures the docs quote for the default run (docs/benchmarks.md), from one run of the default recipe (what `make run` runs).

    python bench/readme_figures.py                      # run, print the summary and the docs block
    python bench/readme_figures.py --write-docs       # ... and replace the block in docs/benchmarks.md
    python bench/readme_figures.py [overrides ...]      # another size, e.g. run.num_steps=2

The docs block lies between the two ``readme_figures`` comment lines; it is replaced whole, so the docs never
quote figures this script did not print. Each mismatch figure comes with its standard error over the step's
samples, and what replay removes is the paired figure (replayed - unreplayed per sample, same batch) with its
standard error clustered by prompt; the mean over steps with the standard error of that mean.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # recipes/ lives at the repository root

BEGIN = "<!-- readme_figures:begin (written by bench/readme_figures.py --write-docs; do not edit) -->"
END = "<!-- readme_figures:end -->"


def run_default(out_dir: str, overrides: list[str]) -> tuple[object, list[dict[str, float]], float]:
    from r3rl.config import compose
    from recipes import warm_start
    from recipes.grpo import GRPORecipe

    # run.py's command line for `make run` on a machine without a GPU, in a folder of its own, from the same SFT warm
    # start (run_recipe's first step; cached under data/warm_start/)
    cfg = compose(["parallelism=cpu", f"run.output_dir={out_dir}", "logger.wandb.mode=disabled", *overrides])
    cfg = warm_start.ensure(cfg)
    recipe = GRPORecipe(cfg)
    started = time.perf_counter()
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    return cfg, recipe.history, time.perf_counter() - started


def _pm(value: float, err: float) -> str:
    # two significant digits of the error, at least four decimals: a figure of 0.0002 ± 0.00005 must not print as
    # "0.0002 ± 0.0000"
    digits = max(4, 1 - math.floor(math.log10(err))) if err > 0 and math.isfinite(err) else 4
    return f"{value:.{digits}f} ± {err:.{digits}f}"


def readme_block(cfg, history: list[dict[str, float]], wall_s: float) -> str:
    from r3rl import metrics as M
    from r3rl.tracking.summary import REPLAY_RATIO, replay_removes, summarize

    alg, sampling = cfg.algorithm, cfg.rollout.sampling
    history = [row for row in history if M.LOGPROB_ABS_DIFF in row]  # the eval baseline (step 0) trains nothing
    samples = alg.rollout_batch_size * alg.n_samples_per_prompt
    tokens = [row[M.RESPONSE_LENGTH_MEAN] * samples for row in history]
    stats = summarize(history)
    lines = [
        BEGIN,
        f"Default run (`make run`: {cfg.run.num_steps} steps of {samples} samples = {alg.rollout_batch_size} "
        f"prompts x {alg.n_samples_per_prompt}, at most {sampling.max_tokens} response tokens each, "
        f"{sum(tokens) / len(tokens):.0f} response tokens per step on average; from the SFT warm start"
        f"{'' if cfg.warm_start.enabled else ' (off here)'}; bf16 engine, fp32 trainer, fixed "
        f"seeds). `train/logprob_abs_diff` with replay and without replay on the same batch, ± the standard error "
        f"over the step's samples clustered by prompt; replay removes = minus "
        f"`train/logprob_abs_diff_paired_delta`, ± its standard error clustered by prompt:",
        "",
        "| step | with replay (R3) | without replay | replay removes (paired) | ratio | routing flip rate | "
        "replay mismatch rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in history:
        lines.append(
            f"| {int(row['step'])} | {_pm(row[M.LOGPROB_ABS_DIFF], row[M.LOGPROB_ABS_DIFF_STDERR])} | "
            f"{_pm(row[M.LOGPROB_ABS_DIFF_NO_REPLAY], row[M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR])} | "
            f"{_pm(-row[M.LOGPROB_ABS_DIFF_PAIRED_DELTA], row[M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR])} | "
            f"{row[M.LOGPROB_ABS_DIFF] / row[M.LOGPROB_ABS_DIFF_NO_REPLAY]:.2f} | {row[M.ROUTING_FLIP_RATE]:.2%} | "
            f"{row[M.REPLAY_MISMATCH_ROWS]:.0f} |")
    rep, nrep = stats[M.LOGPROB_ABS_DIFF], stats[M.LOGPROB_ABS_DIFF_NO_REPLAY]
    flips = stats[M.ROUTING_FLIP_RATE]
    removed, removed_se, _ = replay_removes(history)
    lines.append(f"| mean | {_pm(rep['mean'], rep['mean_stderr'])} | {_pm(nrep['mean'], nrep['mean_stderr'])} | "
                 f"{_pm(removed, removed_se)} | {rep['mean'] / nrep['mean']:.2f} | {flips['mean']:.2%} | "
                 f"{stats[M.REPLAY_MISMATCH_ROWS]['max']:.0f} |")
    lines += [
        "",
        f"Replay removes {_pm(removed, removed_se)} of mismatch per sample ({removed / removed_se:.1f} "
        f"standard errors of the paired difference, clustered by prompt; per-step ratio "
        f"{stats[REPLAY_RATIO]['min']:.2f}-{stats[REPLAY_RATIO]['max']:.2f}). The run took {wall_s / 60:.1f} min "
        f"(setup and {cfg.run.num_steps} steps, without the install).",
        END,
    ]
    return "\n".join(lines)


def write_block(path: Path, block: str, begin: str, end: str) -> None:
    """Replace the text from ``begin`` to ``end`` (both lines included) with ``block``, which carries them."""
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no block (the lines {begin!r} ... {end!r}) to replace")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + block + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help="replace the block in docs/benchmarks.md")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (the docs quote the default run)")
    args = parser.parse_args()
    from r3rl.tracking.summary import print_summary

    with tempfile.TemporaryDirectory(prefix="r3rl-figures-") as tmp:
        cfg, history, wall_s = run_default(f"{tmp}/run", args.overrides)
    print_summary(history, console=Console(width=160), title="default run")
    block = readme_block(cfg, history, wall_s)
    print(block)
    if args.write_docs:
        if args.overrides:
            raise SystemExit("--write-docs quotes the default run only: drop the overrides")
        write_block(REPO / "docs/benchmarks.md", block, BEGIN, END)
        print("docs/benchmarks.md: figures replaced")


if __name__ == "__main__":
    main()
