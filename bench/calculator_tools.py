"""The calculator task's learning figure and the tool's effect: ``python run.py env=calculator`` (the SFT warm start
with some worked tool episodes, then GRPO on 4-digit additions), and the same warm model on the same held-out
problems with the tool taken away (single requests, the same 24-token budget).

    python bench/calculator_tools.py [--out outputs/calculator] [--reuse] [override ...]

Prints the run's per-step reward, tool calls and turns, its eval points ± standard errors clustered by problem, the
gain from the first eval point to the last (paired over the same prompts, clustered by problem), and the warm
model's held-out score without the tool, paired with its score with the tool on the same prompts. Last line:
``calculator: held-out avg@k <a> -> <b> (gain <g> +- <se>, <z> standard errors); warm model without the tool <c>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from r3rl import metrics as M
from r3rl.eval.records import record_path
from r3rl.tracking.offline_reader import read_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runs import recipe_run  # noqa: E402
from learning_curve import eval_keys, summarise  # noqa: E402
# the warm model without the tool: single requests with the calculator run's turn budget, scored at step 0 (the one
# training step the recipe needs to run is not read)
NO_TOOL = ("env.environment=null", "env.max_turns=1", "env.max_tokens_per_turn=null", "rollout.sampling.max_tokens=24",
           "eval.sets.arithmetic.sampling.max_tokens=24", "run.num_steps=1", "run.eval_every=1", "run.resume=false")


def run(folder: Path, overrides: list[str], reuse: bool) -> Path:
    return recipe_run(folder, ["env=calculator", *overrides], label=folder.name, reuse=reuse)


def first_point(folder: Path) -> tuple[str, int, float]:
    """(eval set name, step, avg@k) of the run's first eval point."""
    row = next(r for r in read_run(folder).history if eval_keys(r) is not None)
    key = eval_keys(row)[0]
    return key.split("/")[1], int(row["_step"]), float(row[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/calculator")
    parser.add_argument("--reuse", action="store_true", help="read finished runs in --out instead of rerunning")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    tools = run(out / "tools", list(args.overrides), args.reuse)
    bare = run(out / "no_tool", [*NO_TOOL, *args.overrides], args.reuse)

    history = read_run(tools).history
    print(f"\n{'step':>5} {'reward':>7} {'tool calls':>11} {'turns':>6} {'tool errors':>12} "
          f"{'|dlogp| turn 1 / 2, replayed':>30} {'unreplayed':>20}")
    for row in history:
        if M.TURNS_MEAN not in row:
            continue
        turn = {t: (row.get(M.LOGPROB_ABS_DIFF_TURN.format(turn=t), float("nan")),
                    row.get(M.LOGPROB_ABS_DIFF_NO_REPLAY_TURN.format(turn=t), float("nan"))) for t in (1, 2)}
        print(f"{row['_step']:>5} {row[M.REWARD_MEAN]:>7.3f} {row[M.TOOL_CALLS_MEAN]:>11.2f} "
              f"{row[M.TURNS_MEAN]:>6.2f} {row[M.TOOL_ERRORS]:>12.0f} {turn[1][0]:>15.5f} {turn[2][0]:>14.5f} "
              f"{turn[1][1]:>10.5f} {turn[2][1]:>9.5f}")
    steps = [row for row in history if M.TURNS_MEAN in row]
    for t in (1, 2):
        rep, unrep = M.LOGPROB_ABS_DIFF_TURN.format(turn=t), M.LOGPROB_ABS_DIFF_NO_REPLAY_TURN.format(turn=t)
        ratios = [r[rep] / r[unrep] for r in steps if r.get(unrep)]
        if ratios:
            print(f"turn {t}: replayed / unreplayed mismatch {sum(ratios) / len(ratios):.2f} (mean over "
                  f"{len(ratios)} steps)")
    got = [r[M.ROUTE_BYTES_PER_EPISODE] for r in steps if M.ROUTE_BYTES_PER_EPISODE in r]
    full = [r[M.ROUTE_BYTES_PER_EPISODE_FULL] for r in steps if M.ROUTE_BYTES_PER_EPISODE_FULL in r]
    if got:
        print(f"route bytes per episode: {sum(got) / len(got):.0f} with routed_experts_prompt_start, "
              f"{sum(full) / len(full):.0f} asking for the whole context every turn "
              f"({sum(got) / sum(full):.2f}x)")
    gain, se = summarise("env=calculator", tools)

    name, step, with_tool = first_point(tools)
    _, bare_step, without = first_point(bare)
    a, b = (json.loads(record_path(f / "eval", name, s).read_text()) for f, s in ((tools, step), (bare, bare_step)))
    if a["problems"] != b["problems"]:
        raise SystemExit("the two runs' held-out sets differ: compare like with like")
    diff, diff_se = M.mean_and_stderr([x - y for x, y in zip(a["prompt_means"], b["prompt_means"])], a["problems"])
    print(f"\nwarm model, step 0: avg@k {with_tool:.3f} with the tool, {without:.3f} without "
          f"(difference {diff:+.3f} +- {diff_se:.3f}, paired over the same prompts, clustered by problem)")
    last = [r for r in history if eval_keys(r) is not None][-1]
    print(f"calculator: held-out avg@k {with_tool:.3f} -> {last[eval_keys(last)[0]]:.3f} (gain {gain:+.3f} +- "
          f"{se:.3f}, {gain / se:.1f} standard errors); warm model without the tool {without:.3f}")


if __name__ == "__main__":
    main()
