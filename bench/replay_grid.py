"""The replay x correction grid the docs quote (docs/r3.md): `replay=none,r2,r3` x `correction=none,tis`, same seeds and data.

    python bench/replay_grid.py [--out outputs/replay_grid] [--write-docs] [override ...]

Runs ``python run.py replay=<mode> correction=<name>`` (the default CPU recipe, SFT warm start cached and shared,
``rollout=vllm_r3`` so every run gets the engine's routes and R3 is a choice of replay only) one after the other,
each into its own folder under ``--out``, reads their W&B offline files and prints, per run, the mean over steps of
the mismatch figures (with the standard error of that mean where the figure has one) under the definitions in the
metric reference. ``--write-docs`` replaces the ``replay_grid`` block of docs/r3.md and redraws
``docs/replay_grid_tis.png`` (the dashboard's panels for the three ``correction=tis`` runs).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from r3rl import metrics as M
from r3rl.tracking.summary import replay_removes, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from readme_figures import _pm, write_block  # noqa: E402

REPLAYS = ("none", "r2", "r3")
CORRECTIONS = ("none", "tis")
# small steps: the grid is about the mismatch of one batch, not about learning. The tiny model as initialised (no
# SFT warm start): its flat distributions show the routing mismatch that the warm-started model's confident ones
# hide (`python bench/replay_grid.py warm_start.enabled=true` gives the other figures)
GRID = ("run.num_steps=4", "run.eval_every=0", "algorithm.rollout_batch_size=4", "algorithm.n_samples_per_prompt=4",
        "algorithm.global_batch_size=16", "warm_start.enabled=false")
BEGIN = "<!-- replay_grid:begin (written by bench/replay_grid.py --write-docs; do not edit) -->"
END = "<!-- replay_grid:end -->"
# (column, key, digits): each figure's mean over the run's steps
COLUMNS = (
    ("`logprob_abs_diff`", M.LOGPROB_ABS_DIFF, 4),
    ("unreplayed, same batch", M.LOGPROB_ABS_DIFF_NO_REPLAY, 4),
    ("flip rate", M.ROUTING_FLIP_RATE, 4),
    ("IS mean", M.ROLLOUT_IS_MEAN, 4),
    ("ESS", M.ROLLOUT_IS_ESS, 4),
    ("k3 KL", M.K3_KL, 5),
    ("log-ppl \\|diff\\|", M.LOG_PPL_ABS_DIFF, 4),
    ("w > C", M.ROLLOUT_IS_FRACTION_HIGH, 4),
    ("log-prob stage s", M.perf_time_key("logprobs"), 2),
)


def run_grid(out: Path, overrides: list[str]) -> dict[tuple[str, str], Path]:
    folders = {}
    for correction in CORRECTIONS:
        for replay in REPLAYS:
            folder = out / f"{replay}-{correction}"
            cmd = [sys.executable, "run.py", "rollout=vllm_r3", f"replay={replay}", f"correction={correction}",
                   f"run.output_dir={folder}", *GRID, *overrides]
            print(f"== {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, cwd=REPO, check=True)
            folders[replay, correction] = folder
    return folders


def cell(stats: dict, key: str, digits: int) -> str:
    s = stats.get(key)
    if s is None:
        return "-"
    se = s.get("mean_stderr")
    return f"{s['mean']:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def table(histories: dict[tuple[str, str], list[dict]], steps: int, overrides: list[str] | tuple = ()) -> str:
    from r3rl.config import compose

    keys = tuple(k for _, k, _ in COLUMNS)
    warm = compose(["parallelism=cpu", *GRID, *overrides]).warm_start.enabled
    model = "the SFT warm-started tiny model" if warm else "the tiny model as initialised (no warm start)"
    cap = compose(["parallelism=cpu", "correction=tis"]).correction.ratio_high
    lines = [
        BEGIN,
        f"`python bench/replay_grid.py{''.join(' ' + o for o in overrides)}` ({steps} steps of 16 samples = 4 "
        f"prompts x 4 per run, {model}, bf16 engine vs fp32 trainer, same seeds; mean over the steps ± the standard "
        f"error of that mean; C = `correction.ratio_high` = {cap:g}):",
        "",
        "| replay | correction | " + " | ".join(c for c, _, _ in COLUMNS) + " | replay removes (paired) |",
        "|---|---|" + "---|" * len(COLUMNS) + "---|",
    ]
    for (replay, correction), history in histories.items():
        stats = summarize(history, keys=keys)
        removed = replay_removes(history)
        paired = _pm(*removed[:2]) if removed else "-"
        lines.append(f"| {replay} | {correction} | " + " | ".join(cell(stats, k, d) for _, k, d in COLUMNS)
                     + f" | {paired} |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/replay_grid_init")
    parser.add_argument("--write-docs", action="store_true", help="replace the block in docs/r3.md and the picture")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.write_docs and args.overrides:
        raise SystemExit("--write-docs quotes the grid as shipped: drop the overrides")
    from r3rl.dashboard.local import write_png
    from r3rl.tracking.offline_reader import read_run

    folders = run_grid(Path(args.out).resolve(), args.overrides)
    runs = {cell_: read_run(folder) for cell_, folder in folders.items()}
    histories = {cell_: [row for row in run.history if M.LOGPROB_ABS_DIFF in row] for cell_, run in runs.items()}
    block = table(histories, steps=max(len(h) for h in histories.values()), overrides=args.overrides)
    print(block)
    if args.write_docs:
        write_block(REPO / "docs/r3.md", block, BEGIN, END)
        write_png([runs[r, "tis"] for r in REPLAYS], REPO / "docs" / "replay_grid_tis.png")
        print("docs/r3.md and docs/replay_grid_tis.png: replaced")


if __name__ == "__main__":
    main()
