"""Step time of the default recipe with rollout and training in turn (``algorithm.max_staleness=0``) and overlapped
(``=1``: the engines generate the next batch while the trainer trains this one), side by side in one invocation: the
same config, seeds and number of steps, one run after the other on the same machine.

    python bench/async_step.py [--steps 8] [overrides ...]

Step 1 is left out of the means (first requests warm up, and an overlapped run generates its first batch alone).
Printed per mode: the mean wall time per step and its stages (``rollout`` is the wait for the step's samples, which
overlap hides; ``generate`` the generation's own time, measured where it ran), then the samples' staleness. Last line:
``async/sync step time ratio: <r>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/ lives at the repository root

STAGES = ("rollout", "generate", "logprobs", "train", "weight_sync")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is left out)")
    modes = {"sync (0)": 0, "async (1)": 1}
    results = {}
    with tempfile.TemporaryDirectory(prefix="r3rl-bench-async-") as tmp:
        for label, n in modes.items():
            results[label] = run(n, args.steps, f"{tmp}/staleness{n}", args.overrides)

    def mean(label: str, key: str) -> float:
        rows = [r for r in results[label][1:] if key in r]
        return statistics.fmean(r[key] for r in rows) if rows else float("nan")

    table = Table(title=f"seconds per step (mean of steps 2..{args.steps})")
    table.add_column("stage")
    for label in modes:
        table.add_column(f"max_staleness {label}", justify="right")
    for stage in STAGES + ("step",):
        key = "perf/step_time_s" if stage == "step" else f"perf/{stage}_time_s"
        table.add_row(stage, *(f"{mean(label, key):.2f}" for label in modes))
    for key in ("rollout/staleness_mean", "rollout/staleness_max", "rollout/dropped_stale"):
        table.add_row(key, *(f"{mean(label, key):.2f}" for label in modes))
    Console().print(table)
    sync, overlapped = (mean(label, "perf/step_time_s") for label in modes)
    print(f"mean step time: sync {sync:.2f} s, async {overlapped:.2f} s")
    print(f"async/sync step time ratio: {overlapped / sync:.2f}")


if __name__ == "__main__":
    main()
