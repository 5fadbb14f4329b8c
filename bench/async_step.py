"""Step time of the default recipe with rollout and training in turn (``algorithm.max_staleness=0``) and overlapped
(``=1``: the engines generate the next batch while the trainer trains this one), side by side in one invocation: the
same config, seeds and number of steps, one run after the other on the same machine.

    python bench/async_step.py [--steps 8] [overrides ...]
    python bench/async_step.py --write-docs      # both thread settings; the block in docs/async.md

Step 1 is left out of the means (first requests warm up, and an overlapped run generates its first batch alone).
Printed per mode: the mean wall time per step and its stages (``rollout`` is the wait for the step's samples, which
overlap hides; ``generate`` the generation's own time, measured where it ran), then the samples' staleness. Last line:
``async/sync step time ratio: <r>``. ``--write-docs`` measures the default threads and the trainer on one core
(``parallelism.cpus_per_gpu=1``) one after the other and writes the ``async_step`` block of docs/async.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # recipes/ lives at the repository root
sys.path.insert(0, str(REPO / "bench"))  # the block writer and the machine line of readme_figures

STAGES = ("rollout", "generate", "logprobs", "train", "weight_sync")
BEGIN = "<!-- async_step:begin (written by bench/async_step.py --write-docs; do not edit) -->"
END = "<!-- async_step:end -->"
# what --write-docs measures: the trainer's torch on the node's cores (the default) and on one core beside the engine
SETTINGS = {"default threads (the trainer's torch on both cores)": [],
            "`parallelism.cpus_per_gpu=1` (the trainer on one core, the engine's thread on the other)":
                ["parallelism.cpus_per_gpu=1"]}


def run(max_staleness: int, steps: int, out_dir: str, overrides: list[str]) -> list[dict[str, float]]:
    from r3rl.config import compose
    from recipes import warm_start
    from recipes.grpo import GRPORecipe

    # both runs with the correction one step off-policy needs (refused without one), so only the overlap differs
    cfg = compose(["parallelism=cpu", f"algorithm.max_staleness={max_staleness}", "correction=tis",
                   f"run.num_steps={steps}",
                   f"run.output_dir={out_dir}", "run.save_every=1000", "run.eval_every=0",
                   "logger.wandb.mode=disabled", *overrides])
    recipe = GRPORecipe(warm_start.ensure(cfg))  # the default run starts from its (cached) SFT warm start
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    return [row for row in recipe.history if "perf/step_time_s" in row]


def measure(steps: int, overrides: list[str]) -> dict[str, dict[str, float]]:
    """Mean seconds per stage (and staleness) of steps 2..N, per mode, the two runs one after the other."""
    modes = {"sync (0)": 0, "async (1)": 1}
    results = {}
    with tempfile.TemporaryDirectory(prefix="r3rl-bench-async-") as tmp:
        for label, n in modes.items():
            results[label] = run(n, steps, f"{tmp}/staleness{n}", overrides)

    def mean(rows: list[dict[str, float]], key: str) -> float:
        rows = [r for r in rows[1:] if key in r]
        return statistics.fmean(r[key] for r in rows) if rows else float("nan")

    keys = [f"perf/{stage}_time_s" for stage in STAGES] + ["perf/step_time_s", "rollout/staleness_mean",
                                                          "rollout/staleness_max", "rollout/dropped_stale"]
    return {label: {key: mean(rows, key) for key in keys} for label, rows in results.items()}


def print_table(means: dict[str, dict[str, float]], steps: int, title: str) -> float:
    table = Table(title=f"{title}: seconds per step (mean of steps 2..{steps})")
    table.add_column("stage")
    for label in means:
        table.add_column(f"max_staleness {label}", justify="right")
    for stage in STAGES + ("step",):
        key = "perf/step_time_s" if stage == "step" else f"perf/{stage}_time_s"
        table.add_row(stage, *(f"{m[key]:.2f}" for m in means.values()))
    for key in ("rollout/staleness_mean", "rollout/staleness_max", "rollout/dropped_stale"):
        table.add_row(key, *(f"{m[key]:.2f}" for m in means.values()))
    Console().print(table)
    sync, overlapped = (m["perf/step_time_s"] for m in means.values())
    print(f"mean step time: sync {sync:.2f} s, async {overlapped:.2f} s")
    print(f"async/sync step time ratio: {overlapped / sync:.2f}")
    return overlapped / sync


def docs_block(measured: dict[str, dict[str, dict[str, float]]], steps: int) -> str:
    """The side-by-side table docs/async.md and docs/benchmarks.md quote, as ratios of the in-turn step."""
    from readme_figures import measured as where

    lines = [BEGIN, f"`python bench/async_step.py --write-docs` ({steps} steps a run, means of steps 2-{steps}; "
                    f"{where()}):", "",
             "| trainer threads | in turn (0): rollout / log-probs / train, share of the step | overlapped (1): "
             "rollout wait, log-probs, train against in turn | step time ratio |", "|---|---|---|---|"]
    for setting, means in measured.items():
        sync, lag = means["sync (0)"], means["async (1)"]
        step = sync["perf/step_time_s"]
        shares = " / ".join(f"{sync[f'perf/{s}_time_s'] / step:.2f}" for s in ("rollout", "logprobs", "train"))
        lines.append(f"| {setting} | {shares} | {lag['perf/rollout_time_s']:.2f} s; log-probs "
                     f"{lag['perf/logprobs_time_s'] / sync['perf/logprobs_time_s']:.2f}x, train "
                     f"{lag['perf/train_time_s'] / sync['perf/train_time_s']:.2f}x | "
                     f"{lag['perf/step_time_s'] / step:.2f} |")
    default, one = measured.values()
    lines += ["", f"In-turn step with the trainer on one core against both: "
                  f"{one['sync (0)']['perf/step_time_s'] / default['sync (0)']['perf/step_time_s']:.2f}x; "
                  f"overlapped: {one['async (1)']['perf/step_time_s'] / default['async (1)']['perf/step_time_s']:.2f}x.",
              END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--write-docs", action="store_true",
                        help="measure both thread settings and replace the block in docs/async.md")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is left out)")
    if not args.write_docs:
        print_table(measure(args.steps, args.overrides), args.steps, "as given")
        return
    if args.overrides:
        raise SystemExit("--write-docs measures the default recipe: drop the overrides")
    measured = {}
    for setting, overrides in SETTINGS.items():
        measured[setting] = measure(args.steps, overrides)
        print_table(measured[setting], args.steps, setting)
    block = docs_block(measured, args.steps)
    print(block)
    from readme_figures import write_block

    write_block(REPO / "docs/async.md", block, BEGIN, END)
    print("docs/async.md: block replaced")


if __name__ == "__main__":
    main()
