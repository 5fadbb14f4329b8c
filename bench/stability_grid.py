"""When does R3 pay? The stabilisers users choose between, side by side on one harness (docs/stabilisers.md).

    python bench/stability_grid.py [--out outputs/stability_grid] [--steps 16] [--seeds 3] [--reuse] [--write-docs]
        [override ...]

From the default CPU recipe's SFT warm start (cached, shared by every run), the same data, seeds and steps, one
``python run.py`` per row of ``GRID`` and rollout seed (12 rows, not the full product of replay x correction x loss x
router freeze x mini-batches): replay none and R3 on-policy (1 optimizer mini-batch per rollout batch, with TIS as the
Qwen study's claim has it); none, R2 and R3 at 2 and at 4 mini-batches; at 4 also soft replay, TIS, GSPO and a frozen
router. Each row runs ``--seeds`` rollout seeds (trajectories): a verdict needs ``MIN_SEEDS`` of them
(``r3rl.dashboard.stabiliser_verdicts``), so ``--seeds 1`` is a quick look whose every verdict is "not measurable". Every run uses ``rollout=vllm_r3`` so the engine's routes are there to measure the
mismatch whatever the trainer replays.

Prints one row per run (``r3rl.dashboard.stabilisers``, the table ``python -m r3rl.dashboard --runs`` shows), a
verdict per claim (``r3rl.dashboard.stabiliser_verdicts``: gaps on shared seeds, paired by prompt, each interval
Student's t wide over the seeds and read against the stated equivalence margin), writes ``--out/comparison.png`` and ``comparison.html``, and ends with exactly:
``grid: R3/R2 later-mini-batch mismatch at 4 mini-batches <r>; best held-out gain <mode> <g>``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench_runs import REPO, recipe_run
from readme_figures import measured, write_block

SEEDS = (1234, 4321, 2718, 3141, 1618)  # rollout.sampling.seed of each trajectory (the warm start and data shared)
# (label, mini-batches per rollout batch, overrides)
GRID = (
    # on-policy with TIS: the Qwen study's claim is about policy gradient with the importance-sampling correction
    ("none", 1, ("replay=none", "correction=tis")),
    ("R3", 1, ("replay=r3", "correction=tis")),
    ("none", 2, ("replay=none",)),
    ("R2", 2, ("replay=r2",)),
    ("R3", 2, ("replay=r3",)),
    ("none", 4, ("replay=none",)),
    ("R2", 4, ("replay=r2",)),
    ("R3", 4, ("replay=r3",)),
    ("soft 0.5", 4, ("replay=soft", "replay.soft_ratio=0.5")),
    ("TIS", 4, ("replay=none", "correction=tis")),
    ("GSPO", 4, ("replay=none", "algorithm.loss=gspo")),
    ("frozen router", 4, ("replay=none", "trainer.freeze_router=true")),
)
BEGIN = "<!-- stability_grid:begin (written by bench/stability_grid.py --write-docs; do not edit) -->"
END = "<!-- stability_grid:end -->"


def run_all(out: Path, steps: int, seeds: int, overrides: list[str], reuse: bool) -> list[tuple[str, Path]]:
    from r3rl.config import compose

    alg = compose(["parallelism=cpu", *overrides]).algorithm
    batch = alg.rollout_batch_size * alg.n_samples_per_prompt
    plan = [(label, mb, extra, seed) for seed in SEEDS[:seeds] for label, mb, extra in GRID]
    done = []
    for i, (label, mb, extra, seed) in enumerate(plan, 1):
        name = f"{label.replace(' ', '_')}-mb{mb}-seed{seed}"
        folder = recipe_run(out / name, ["rollout=vllm_r3", *extra, f"algorithm.global_batch_size={batch // mb}",
                                         f"rollout.sampling.seed={seed}", f"run.num_steps={steps}",
                                         f"run.eval_every={steps}", f"run.name=grid-{name}", *overrides],
                            label=f"[{i}/{len(plan)}] {label}, {mb} mini-batches, seed {seed}", reuse=reuse)
        done.append((label, folder))
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/stability_grid")
    ap.add_argument("--steps", type=int, default=16, help="GRPO steps per run (eval before step 1 and at the end)")
    ap.add_argument("--seeds", type=int, default=3, choices=range(1, len(SEEDS) + 1), metavar=f"1..{len(SEEDS)}",
                    help="rollout seeds (trajectories) per row; a verdict needs MIN_SEEDS of them")
    ap.add_argument("--reuse", action="store_true", help="read runs already finished in --out instead of rerunning")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the stability_grid blocks of docs/stabilisers.md and README.md")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    done = run_all(out, args.steps, args.seeds, args.overrides, args.reuse)
    from r3rl.dashboard.stabiliser_verdicts import EQUIVALENCE_MARGIN, MIN_SEEDS, arm, verdicts
    from r3rl.dashboard.stabilisers import grid_rows, render_table
    from r3rl.tracking.offline_reader import read_run

    runs = [read_run(folder) for _, folder in done]
    rows = grid_rows(runs, [label for label, _ in done])
    print()
    print(render_table(rows))
    subprocess.run([sys.executable, "-m", "r3rl.dashboard", "--runs", *(str(f) for _, f in done), "--out", str(out),
                    "--title", "Stabilisers side by side"], cwd=REPO, check=False, stdout=subprocess.DEVNULL)
    print(f"\ncomparison: {out / 'comparison.png'}, {out / 'comparison.html'}\n")
    verdict_lines = [f"Equivalence margin: {EQUIVALENCE_MARGIN} held-out avg@4; each gap's interval is Student's t "
                     f"wide over its shared seeds (the normal's 2 sigma), and a verdict needs {MIN_SEEDS} seeds. A "
                     "claim that two setups do alike is supported when the interval lies within the margin, one that "
                     "a setup is ahead when it lies above it.", "",
                     *(f"- {line}" for line in verdicts(rows))]
    print("\n".join(verdict_lines))
    r2, r3 = arm(rows, "R2", 4), arm(rows, "R3", 4)
    # the best gain on the first seed, which every arm ran: a mean over seeds only some arms ran is partly the seed
    best = max((r for r in rows if r.seed == SEEDS[0]), key=lambda r: r.gain)
    last = (f"grid: R3/R2 later-mini-batch mismatch at 4 mini-batches {r3.later / r2.later:.2f}; best held-out gain "
            f"(seed {SEEDS[0]}) {best.label} at {best.mini_batches:g} mini-batches {best.gain:+.3f}")
    print(last)
    if args.write_docs:
        command = " ".join(["python bench/stability_grid.py", *([f"--steps {args.steps}"] if args.steps != 16 else []),
                            *([f"--seeds {args.seeds}"] if args.seeds != 3 else []), *args.overrides])
        head = [f"`{command}` ({measured()}; {args.steps} GRPO steps of 64 prompts x 4 per run, held-out avg@4 before step 1 and "
                "after the last, paired by prompt and clustered by problem):", "", render_table(rows), ""]
        write_block(REPO / "docs" / "stabilisers.md", "\n".join([BEGIN, *head, *verdict_lines, "", f"`{last}`", END]),
                    BEGIN, END)
        # the README gives the verdicts; the table lives on the page
        readme = [f"`{command}` ({measured()}; {args.steps} GRPO steps of 64 prompts x 4 per run; the table of every arm is on "
                  "[Which stabiliser do I need?](docs/stabilisers.md)):", ""]
        write_block(REPO / "README.md", "\n".join([BEGIN, *readme, *verdict_lines, "", f"`{last}`", END]), BEGIN, END)
        print("wrote the blocks of docs/stabilisers.md and README.md")


if __name__ == "__main__":
    main()
