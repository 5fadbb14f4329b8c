"""The learning figure: the default learning run with routing replay and without, same seeds, side by side.

    python bench/learning_curve.py [--out outputs/learning] [--steps N] [--seeds 1,2] [--data-seeds 7,8] [--docs]
                                   [--write-docs] [override ...]

Runs ``python run.py rollout=vllm_r3`` and ``python run.py rollout=vllm`` one after the other (the default CPU
recipe: SFT warm start, cached and shared by both, then GRPO), each into its own folder under ``--out``, then reads
both W&B offline runs and prints, per step, the rollout reward mean +- its standard error (clustered by prompt), and
per eval point avg@k and pass@k +- their standard errors (clustered by problem: 'a + b' and 'b + a' are one). The
gain is the last eval point's avg@k minus the first's; its standard error is that of the mean per-prompt change
(the same prompts at both points, from the per-prompt scores the recipe records under ``eval/``), clustered by
problem (``r3rl.eval.records.paired_gain``), or without those records the two points' errors combined as if
independent. It writes the comparison pictures
(``--out/comparison.png``, every panel, and ``--out/headline.png``, the held-out score and the mismatch, by
``r3rl.dashboard``; ``--docs`` copies them to ``docs/learning_curve.png`` and ``docs/headline.png``). Last line:
``learning: eval avg@k gain <g> (<n> standard errors); R3 <g3>, no replay <g0>``. ``--write-docs`` (with
``--data-seeds 7,8`` and nothing else) also writes the eval table and the gain lines, with the machine and date, into
the ``learning_curve`` block of docs/training.md.

``--seeds`` adds R3 runs with other ``rollout.sampling.seed`` values, the warm start and held-out set shared: one
run's standard error counts only the eval's sampling, while another training trajectory moves the gain too, so this
prints every run's gain and their mean with the standard error over runs. ``--data-seeds`` adds R3 runs with other
``data.seed`` values: each draws its own warm-start solutions and GRPO prompts, so it trains its own warm start (the
largest source of spread between runs), and is scored on the same held-out problems (the held-out share is fixed by
a hash of the problem, its draw by the eval's own seed). A folder that already holds the finished run is not
trained again: ``run.py`` recognises it and prints its summary.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from pathlib import Path

from r3rl.eval.records import paired_gain, record_path
from r3rl.tracking.offline_reader import read_run

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # the block writer and the machine line of readme_figures
RUNS = (("R3", "vllm_r3"), ("no replay", "vllm"))
BEGIN = "<!-- learning_curve:begin (written by bench/learning_curve.py --write-docs; do not edit) -->"
END = "<!-- learning_curve:end -->"
# what the docs quote: the two default runs and two R3 runs of other data seeds, each from its own warm start
DOCS_DATA_SEEDS = "7,8"


def eval_keys(row: dict) -> tuple[str, str] | None:
    """The first eval set's (avg@k, pass@k) keys in ``row``."""
    avg = next((k for k in sorted(row) if k.startswith("eval/") and "/avg@" in k and not k.endswith("_stderr")), None)
    return None if avg is None else (avg, avg.replace("/avg@", "/pass@"))


def summarise(label: str, folder: Path) -> tuple[float, float, list[tuple], str]:
    """Print a run's reward and eval points; (gain, its standard error, the eval points, the gain line)."""
    run = read_run(folder)
    print(f"\n{label} ({folder}):")
    print(f"{'step':>5} {'reward mean +- se':>20}")
    points = []
    for row in run.history:
        if "rollout/reward_mean" in row:
            se = row.get("rollout/reward_stderr", math.nan)
            print(f"{row['_step']:>5} {row['rollout/reward_mean']:>10.3f} +- {se:.3f}")
        keys = eval_keys(row)
        if keys is not None:
            points.append((row["_step"], *(row[k] for k in keys), row.get(keys[0] + "_stderr", math.nan),
                           row.get(keys[1] + "_stderr", math.nan), keys))
    if not points:
        raise SystemExit(f"{folder}: no eval point logged (run.eval_every=0?)")
    for key, what in (("rollout/generation_rounds", "DAPO generation rounds a step"),
                      ("rollout/staleness_mean", "staleness (versions) a step")):
        values = [row[key] for row in run.history if key in row]
        if values:
            print(f"{what}: mean {sum(values) / len(values):.2f}, min {min(values):g}, max {max(values):g} "
                  f"({len(values)} steps)")
    avg_key, pass_key = points[0][-1]
    print(f"{'eval step':>9} {avg_key.split('/')[-1] + ' +- se':>18} {pass_key.split('/')[-1] + ' +- se':>18}")
    for step, avg, pas, avg_se, pas_se, _ in points:
        print(f"{step:>9} {avg:>9.3f} +- {avg_se:.3f} {pas:>9.3f} +- {pas_se:.3f}")
    first, last = points[0], points[-1]
    gain = last[1] - first[1]
    name = avg_key.split("/")[1]
    if record_path(folder / "eval", name, first[0]).is_file():
        gain, se, problems = paired_gain(folder / "eval", name, first[0], last[0])
        kind = f"paired over prompts, clustered by problem: {problems} problems"
    else:
        se, kind = math.hypot(first[3], last[3]), "the two points' errors combined"
    line = f"gain {avg_key.split('/')[-1]}: {gain:+.3f} +- {se:.3f} ({kind}; steps {first[0]} -> {last[0]})"
    print(line)
    return gain, se, points, line


def docs_block(summaries: list[tuple[str, tuple]], lines: list[str]) -> str:
    """The eval table of the two default runs side by side, every run's gain line and the closing lines."""
    from readme_figures import measured

    (a_label, a), (b_label, b) = summaries[:2]
    k = a[2][0][-1][0].split("/")[-1].split("@")[1]
    head = (f"| eval step | {a_label}: avg@{k} | {a_label}: pass@{k} | {b_label}: avg@{k} | {b_label}: pass@{k} |")
    rows = [f"| {p[0]} | {p[1]:.3f} ± {p[3]:.3f} | {p[2]:.3f} ± {p[4]:.3f} | {q[1]:.3f} ± {q[3]:.3f} | "
            f"{q[2]:.3f} ± {q[4]:.3f} |" for p, q in zip(a[2], b[2])]
    gains = [f"{s[3]}      # {label}" for label, s in summaries]
    return "\n".join([BEGIN, f"`python bench/learning_curve.py --data-seeds {DOCS_DATA_SEEDS} --docs --write-docs` "
                              f"({measured()}):", "", head, "|---|---|---|---|---|", *rows, "", "```", *gains,
                       *lines, "```", END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/learning")
    parser.add_argument("--steps", type=int, default=None, help="run.num_steps (default: the recipe's)")
    parser.add_argument("--seeds", default="", help="comma-separated rollout.sampling.seed values of more R3 runs")
    parser.add_argument("--data-seeds", default="",
                        help="comma-separated data.seed values of more R3 runs, each from its own warm start")
    parser.add_argument("--docs", action="store_true",
                        help="copy the pictures to docs/learning_curve.png and docs/headline.png")
    parser.add_argument("--write-docs", action="store_true", help="replace the learning_curve block of docs/training.md")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.write_docs and (args.overrides or args.steps or args.seeds or args.data_seeds != DOCS_DATA_SEEDS):
        parser.error(f"--write-docs quotes --data-seeds {DOCS_DATA_SEEDS} as shipped: drop the other options")
    out = Path(args.out).resolve()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    data_seeds = [int(s) for s in args.data_seeds.split(",") if s]

    def run(label: str, folder: Path, *extra: str) -> Path:
        cmd = [sys.executable, "run.py", f"run.output_dir={folder}", *extra, *args.overrides]
        if args.steps is not None:
            cmd.append(f"run.num_steps={args.steps}")
        print(f"== {label}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
        return folder

    folders = [run(label, out / rollout, f"rollout={rollout}") for label, rollout in RUNS]
    more = [(f"rollout seed {s}", run(f"R3, rollout seed {s}", out / f"vllm_r3_seed{s}", "rollout=vllm_r3",
                                      f"rollout.sampling.seed={s}")) for s in seeds]
    more += [(f"data seed {s}", run(f"R3, data seed {s}", out / f"vllm_r3_data{s}", "rollout=vllm_r3",
                                    f"data.seed={s}")) for s in data_seeds]
    summaries = [(label, summarise(label, folder)) for (label, _), folder in zip(RUNS, folders)]
    subprocess.run([sys.executable, "-m", "r3rl.dashboard", "--runs", *map(str, folders), "--out", str(out)],
                   cwd=REPO, check=False, stdout=subprocess.DEVNULL)
    print(f"\ncomparison pictures: {out / 'comparison.png'}, {out / 'headline.png'}")
    if args.docs:
        shutil.copy(out / "comparison.png", REPO / "docs" / "learning_curve.png")
        shutil.copy(out / "headline.png", REPO / "docs" / "headline.png")
        print("docs/learning_curve.png and docs/headline.png: replaced")
    (g3, se3, *_), (g0, *_) = (s for _, s in summaries)
    lines = []
    if more:
        extra = [(f"R3, {name}", summarise(f"R3, {name}", f)) for name, f in more]
        summaries += extra
        runs = [("the run above", g3)] + [(name, s[0]) for (name, _), (_, s) in zip(more, extra)]
        values = [g for _, g in runs]
        mean = sum(values) / len(values)
        se = math.sqrt(sum((g - mean) ** 2 for g in values) / (len(values) - 1) / len(values))
        lines.append(f"R3 gain over training trajectories: {', '.join(f'{n} {g:+.3f}' for n, g in runs)}; "
                     f"mean {mean:+.3f} +- {se:.3f} (standard error over the {len(values)} runs)")
    lines.append(f"learning: eval avg@k gain {g3:.3f} ({g3 / se3:.1f} standard errors); R3 {g3:.3f}, no replay "
                 f"{g0:.3f}")
    print("\n" + "\n".join(lines))
    if args.write_docs:
        from readme_figures import write_block

        write_block(REPO / "docs" / "training.md", docs_block(summaries, lines), BEGIN, END)
        print("docs/training.md: the learning_curve block replaced")


if __name__ == "__main__":
    main()
