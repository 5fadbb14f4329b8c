"""Wall time per GRPO step of the default recipe, split into rollout / log-probs / train / weight sync,
with R3 and without, side by side in one run on the same machine.

    python bench/recipe_step.py [--steps 3] [--pi-old-pass] [overrides ...]

``--pi-old-pass`` adds a third run: R3 with pi_old from a no-grad pass of its own
(``algorithm.separate_old_logprob_pass=true``), against the default that takes it from the training forward.
Step 1 of each run is reported apart (first-request warm-up); the table uses the mean of the later steps.
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

STAGES = ("rollout", "logprobs", "train", "weight_sync")


# name -> (rollout, its own overrides)
ARMS = {"vllm_r3": ("vllm_r3", []), "vllm": ("vllm", []),
        "vllm_r3_pi_old_pass": ("vllm_r3", ["algorithm.separate_old_logprob_pass=true"])}


def run(arm: str, steps: int, out_dir: str, overrides: list[str]) -> list[dict[str, float]]:
    from r3rl.config import compose
    from recipes.grpo import GRPORecipe

    rollout, own = ARMS[arm]
    cfg = compose(["parallelism=cpu", f"rollout={rollout}", *own, f"run.num_steps={steps}", f"run.output_dir={out_dir}",
                   "run.save_every=1000", "run.eval_every=0", "logger.wandb.mode=disabled", *overrides])
    recipe = GRPORecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    return recipe.history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pi-old-pass", action="store_true",
                        help="also R3 with pi_old from a no-grad pass of its own (the default takes the training "
                             "forward's)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    arms = ["vllm_r3", "vllm"] + (["vllm_r3_pi_old_pass"] if args.pi_old_pass else [])
    results = {}
    with tempfile.TemporaryDirectory(prefix="r3rl-bench-") as tmp:
        for arm in arms:
            results[arm] = run(arm, args.steps, f"{tmp}/{arm}", args.overrides)

    def mean(arm: str, key: str) -> float:
        rows = results[arm][1:] or results[arm]
        return statistics.fmean(r[key] for r in rows)

    table = Table(title=f"seconds per step (mean of steps 2..{args.steps})")
    table.add_column("stage")
    columns = ["R3 (vllm_r3)", "no R3 (vllm)", "R3 / no R3"]
    if args.pi_old_pass:
        columns += ["R3, pi_old pass", "R3 / R3 with the pass"]
    for col in columns:
        table.add_column(col, justify="right")
    def ratio(a: float, b: float) -> str:
        # a stage a run skips (no R3 without a correction runs no log-prob pass) has no ratio
        return f"{a / b:.2f}" if b >= 0.005 else "-"

    for stage in STAGES + ("step",):
        key = "perf/step_time_s" if stage == "step" else f"perf/{stage}_time_s"
        a, b = mean("vllm_r3", key), mean("vllm", key)
        row = [stage, f"{a:.2f}", f"{b:.2f}", ratio(a, b)]
        if args.pi_old_pass:
            c = mean("vllm_r3_pi_old_pass", key)
            row += [f"{c:.2f}", ratio(a, c)]
        table.add_row(*row)
    console = Console()
    console.print(table)
    ratio = mean("vllm_r3", "perf/step_time_s") / mean("vllm", "perf/step_time_s")
    print(f"r3/no_r3 step time ratio: {ratio:.2f}")
    if args.pi_old_pass:
        ratio = mean("vllm_r3", "perf/step_time_s") / mean("vllm_r3_pi_old_pass", "perf/step_time_s")
        print(f"pi_old from the training forward / from its own pass, step time ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
