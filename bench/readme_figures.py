"""The figures the docs quote for the default run, from one run of the default recipe (what `make run` runs).

    python bench/readme_figures.py                      # run, print the summary and the docs blocks
    python bench/readme_figures.py --write-docs       # ... and replace the blocks in the pages that quote them
    python bench/readme_figures.py [overrides ...]      # another size, e.g. run.num_steps=2

Two blocks: the step-by-step table (``readme_figures``, docs/benchmarks.md) and the summary every other page quotes
(``default_run``: README.md, docs/quickstart-cpu.md, docs/training.md, docs/benchmarks.md), each between its two
comment lines and replaced whole, with the machine and date it was measured on, so no page quotes a figure of the
default run this script did not print. Each mismatch figure comes with its standard error over the step's
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
SUMMARY_BEGIN = "<!-- default_run:begin (written by bench/readme_figures.py --write-docs; do not edit) -->"
SUMMARY_END = "<!-- default_run:end -->"
# the pages that quote the default run's summary
SUMMARY_PAGES = ("README.md", "docs/quickstart-cpu.md", "docs/training.md", "docs/benchmarks.md")


def machine() -> str:
    """The machine a figure was measured on, as a reader compares it with theirs: CPU model and cores."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def measured() -> str:
    """``<machine>, <date>``: what stands beside every block this script writes."""
    import datetime

    return f"{machine()}, {datetime.date.today().isoformat()}"


def run_default(out_dir: str, overrides: list[str]) -> tuple[object, list[dict[str, float]], float, float | None]:
    from r3rl.config import compose
    from recipes import warm_start
    from recipes.grpo import GRPORecipe

    # run.py's command line for `make run` on a machine without a GPU, in a folder of its own, from the same SFT warm
    # start (run_recipe's first step; cached under data/warm_start/)
    cfg = compose(["parallelism=cpu", f"run.output_dir={out_dir}", "logger.wandb.mode=disabled", *overrides])
    from r3rl.warm_start import applies, is_cached

    began = time.perf_counter()
    cold = applies(cfg) and not is_cached(cfg)
    cfg = warm_start.ensure(cfg)
    warm_start_s = time.perf_counter() - began if cold else None
    recipe = GRPORecipe(cfg)
    started = time.perf_counter()
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    return cfg, recipe.history, time.perf_counter() - started, warm_start_s


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
        f"(setup and {cfg.run.num_steps} steps, without the install). Measured on {measured()}.",
        END,
    ]
    return "\n".join(lines)


def summary_block(cfg, history: list[dict[str, float]], wall_s: float, warm_start_s: float | None) -> str:
    """The default run in three figures and its time, as every page but the table's quotes it."""
    from r3rl import metrics as M
    from r3rl.tracking.summary import REPLAY_RATIO, replay_removes, summarize

    history = [row for row in history if M.LOGPROB_ABS_DIFF in row]
    stats = summarize(history)
    removed, removed_se, _ = replay_removes(history)
    rep, nrep = stats[M.LOGPROB_ABS_DIFF]["mean"], stats[M.LOGPROB_ABS_DIFF_NO_REPLAY]["mean"]
    warm = (f"; its SFT warm start, once per machine, took {warm_start_s / 60:.1f} min more" if warm_start_s else "")
    return "\n".join([
        SUMMARY_BEGIN,
        f"The default run (`make run`, {cfg.run.num_steps} steps; `python bench/readme_figures.py` on {measured()}): "
        f"replay removes {_pm(removed, removed_se)} of `train/logprob_abs_diff` per sample "
        f"({removed / removed_se:.1f} se, paired on the same batch, clustered by prompt); the replayed mismatch is "
        f"{rep / nrep:.2f}x the unreplayed (per step {stats[REPLAY_RATIO]['min']:.2f}-"
        f"{stats[REPLAY_RATIO]['max']:.2f}), the routing flip rate {stats[M.ROUTING_FLIP_RATE]['mean']:.2%}, and "
        f"{stats[M.REPLAY_MISMATCH_ROWS]['max']:.0f} replay mismatch rows on every step. It took "
        f"{wall_s / 60:.1f} min from start to summary{warm}.",
        SUMMARY_END,
    ])


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
        cfg, history, wall_s, warm_start_s = run_default(f"{tmp}/run", args.overrides)
    print_summary(history, console=Console(width=160), title="default run")
    block = readme_block(cfg, history, wall_s)
    summary = summary_block(cfg, history, wall_s, warm_start_s)
    print(block)
    print(summary)
    if args.write_docs:
        if args.overrides:
            raise SystemExit("--write-docs quotes the default run only: drop the overrides")
        write_block(REPO / "docs/benchmarks.md", block, BEGIN, END)
        for page in SUMMARY_PAGES:
            write_block(REPO / page, summary, SUMMARY_BEGIN, SUMMARY_END)
        print(f"figures replaced in docs/benchmarks.md and {', '.join(SUMMARY_PAGES)}")


if __name__ == "__main__":
    main()
