"""Multi-turn R3: per turn, the train-rollout mismatch with and without replay, with the stitching rule and with a
deliberately wrong one; the held route rows later prefills recomputed and how many changed experts; and the route
bytes per episode with and without prefix omission.

Runs the default recipe with ``env=reflect`` (every episode 2 policy turns: answer, then answer again when asked to
check) twice, the second with ``debug.wrong_stitching=true`` (the rows of turn 2 one row off), and reads both runs'
W&B files. Figures are means over steps; "±" is the standard error over steps (each step an independent batch of
prompts). Last line: ``multiturn: turn>=2 replay/no-replay mismatch ratio <r>; wrong stitching <r2>``.

    python bench/multiturn_r3.py --steps 8 [--reuse] [overrides...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from r3rl import metrics as M

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runs import recipe_run  # noqa: E402
# 16 prompts x 8 episodes a step, one optimizer step, no eval: the mismatch of a batch is what is measured
RUN = ("env=reflect", "algorithm.rollout_batch_size=16", "algorithm.n_samples_per_prompt=8",
       "algorithm.global_batch_size=128", "run.eval_every=0", "run.resume=false")
RULES = (("stitching rule", ()), ("wrong stitching", ("debug.wrong_stitching=true",)),
         ("no prefix omission", ("env.route_prefix_omission=false",)))


def run(out: Path, name: str, overrides: tuple[str, ...], steps: int, extra: list[str], reuse: bool) -> Path:
    return recipe_run(out / name.replace(" ", "_"), [f"run.num_steps={steps}", *RUN, *overrides, *extra],
                      label=name, reuse=reuse)


def mean_se(values: list[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size < 2:
        return (float(v.mean()) if v.size else math.nan), math.nan
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))


def per_turn(history: list[dict], turns: int) -> dict[int, dict[str, tuple[float, float]]]:
    out = {}
    for t in range(1, turns + 1):
        rep = M.LOGPROB_ABS_DIFF_TURN.format(turn=t)
        unrep = M.LOGPROB_ABS_DIFF_NO_REPLAY_TURN.format(turn=t)
        rows = [r for r in history if rep in r and unrep in r]
        out[t] = {"replayed": mean_se([r[rep] for r in rows]), "unreplayed": mean_se([r[unrep] for r in rows]),
                  "ratio": mean_se([r[rep] / r[unrep] for r in rows if r[unrep] > 0])}
    return out


def pm(x: tuple[float, float], fmt: str = ".3g") -> str:
    return f"{x[0]:{fmt}} ± {x[1]:{fmt}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/multiturn_r3")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="read finished runs in --out instead of rerunning")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    from r3rl.tracking.offline_reader import read_run

    out = Path(args.out).resolve()
    extra = list(args.overrides) + ([f"env.environment.turns={args.turns}", f"env.max_turns={args.turns}"]
                                    if args.turns != 2 else [])
    results = {}
    for name, overrides in RULES:
        history = [r for r in read_run(run(out, name, overrides, args.steps, extra, args.reuse)).history
                   if M.LOGPROB_ABS_DIFF in r]
        results[name] = (per_turn(history, args.turns), history)

    print(f"\nper-turn train/logprob_abs_diff, {args.steps} steps of {' '.join(RUN)} (mean ± se over steps)")
    print("| rule | turn | replayed | unreplayed | replayed / unreplayed |")
    print("|---|---|---|---|---|")
    for name, (turns, _) in list(results.items())[:2]:
        for t, f in turns.items():
            print(f"| {name} | {t} | {pm(f['replayed'])} | {pm(f['unreplayed'])} | {pm(f['ratio'], '.2f')} |")
    _, history = results["stitching rule"]
    _, without = results["no prefix omission"]
    got = mean_se([r.get(M.ROUTE_BYTES_PER_EPISODE) for r in history])
    full = mean_se([r.get(M.ROUTE_BYTES_PER_EPISODE) for r in without])
    turns_mean = mean_se([r.get(M.TURNS_MEAN) for r in history])
    rows, checked, changed = (sum(r.get(k, 0.0) for r in history) for k in
                              (M.RECOMPUTED_ROWS, M.RECOMPUTED_ROWS_CHECKED, M.RECOMPUTED_ROWS_CHANGED))
    print(f"\nroute provenance (earliest forward wins): later turns' prefills recomputed {rows:.0f} held rows over "
          f"{len(history)} steps, {checked:.0f} of them sent again and compared, {changed:.0f} with another expert set "
          f"in some layer ({changed / checked if checked else math.nan:.3f} of those compared)")
    print(f"route bytes received per episode: {got[0]:.0f} with routed_experts_prompt_start, {full[0]:.0f} "
          f"without ({got[0] / full[0]:.2f}x); {turns_mean[0]:.2f} turns per episode")

    def requests_per_s(rows: list[dict]) -> list[float]:
        """Requests per second of a step's rollout stage: its episodes' turns over the stage's time."""
        batch = int(RUN[1].split("=")[1]) * int(RUN[2].split("=")[1])
        return [batch * r[M.TURNS_MEAN] / r[M.perf_time_key("rollout")] for r in rows
                if r.get(M.perf_time_key("rollout")) and M.TURNS_MEAN in r and r["_step"] >= 2]  # step 1 warms up

    a, b = mean_se(requests_per_s(history)), mean_se(requests_per_s(without))
    ratio = a[0] / b[0]
    ratio_se = ratio * math.hypot(a[1] / a[0], b[1] / b[0])  # the two runs' step-to-step errors, independent
    print(f"rollout requests per second, with / without prefix omission: {ratio:.2f} ± {ratio_se:.2f} (steps 2 on; "
          f"same invocation, runs one after the other)")

    def later(name: str) -> float:
        turns = results[name][0]
        ratios = [turns[t]["ratio"][0] for t in turns if t >= 2]
        return float(np.mean(ratios)) if ratios else math.nan

    print(f"multiturn: turn>=2 replay/no-replay mismatch ratio {later('stitching rule'):.2f}; wrong stitching "
          f"{later('wrong stitching'):.2f}")


if __name__ == "__main__":
    main()
