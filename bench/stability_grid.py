"""When does R3 pay? The stabilisers users choose between, side by side on one harness (docs/stabilisers.md).

    python bench/stability_grid.py [--out outputs/stability_grid] [--steps 16] [--reuse] [--write-docs] [override ...]

From the default CPU recipe's SFT warm start (cached, shared by every run), the same data, seeds and steps, one
``python run.py`` per row of ``GRID`` (14 runs, not the full product of replay x correction x loss x router freeze x
mini-batches): replay none and R3 on-policy (1 optimizer mini-batch per rollout batch); none, R2 and R3 at 2 and at
4 mini-batches; at 4 also soft replay, TIS, GSPO and a frozen router; and a second rollout seed of none and R3 at 4,
where the claims differ. Every run uses ``rollout=vllm_r3`` so the engine's routes are there to measure the
mismatch whatever the trainer replays.

Prints one row per run (``r3rl.dashboard.stabilisers``, the table ``python -m r3rl.dashboard --runs`` shows), a
verdict per claim, writes ``--out/comparison.png`` and ``comparison.html``, and ends with exactly:
``grid: R3/R2 later-mini-batch mismatch at 4 mini-batches <r>; best held-out gain <mode> <g>``.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

from bench_runs import REPO, recipe_run
from readme_figures import write_block

SEEDS = (1234, 4321)  # rollout.sampling.seed of the first and second trajectory (the warm start and data shared)
# (label, mini-batches per rollout batch, overrides)
GRID = (
    ("none", 1, ("replay=none",)),
    ("R3", 1, ("replay=r3",)),
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
SECOND_SEED = ("none", "R3")  # at 4 mini-batches
BEGIN = "<!-- stability_grid:begin (written by bench/stability_grid.py --write-docs; do not edit) -->"
END = "<!-- stability_grid:end -->"


def run_all(out: Path, steps: int, overrides: list[str], reuse: bool) -> list[tuple[str, Path]]:
    from r3rl.config import compose

    alg = compose(["parallelism=cpu", *overrides]).algorithm
    batch = alg.rollout_batch_size * alg.n_samples_per_prompt
    plan = [(label, mb, extra, SEEDS[0]) for label, mb, extra in GRID]
    plan += [(label, mb, extra, SEEDS[1]) for label, mb, extra in GRID if mb == 4 and label in SECOND_SEED]
    done = []
    for i, (label, mb, extra, seed) in enumerate(plan, 1):
        name = f"{label.replace(' ', '_')}-mb{mb}-seed{seed}"
        folder = recipe_run(out / name, ["rollout=vllm_r3", *extra, f"algorithm.global_batch_size={batch // mb}",
                                         f"rollout.sampling.seed={seed}", f"run.num_steps={steps}",
                                         f"run.eval_every={steps}", f"run.name=grid-{name}", *overrides],
                            label=f"[{i}/{len(plan)}] {label}, {mb} mini-batches, seed {seed}", reuse=reuse)
        done.append((label, folder))
    return done


def _by(rows: list, label: str, mb: int) -> list:
    return [r for r in rows if r.label == label and r.mini_batches == mb]


def _pooled(rows: list) -> tuple[float, float]:
    """Mean gain over runs (independent trajectories) and its standard error: the runs' own clustered errors
    combined, or the spread between them where that is larger."""
    gains = [r.gain for r in rows]
    mean = sum(gains) / len(gains)
    within = math.sqrt(sum(r.gain_se ** 2 for r in rows)) / len(rows)
    if len(rows) < 2:
        return mean, within
    between = math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1) / len(gains))
    return mean, max(within, between)


def _gap(rows: list, a: tuple[str, int], b: tuple[str, int]) -> tuple[float, float]:
    """Held-out gain of ``a`` minus ``b`` (label, mini-batches), each pooled over its seeds, and its standard error."""
    (ma, sa), (mb, sb) = _pooled(_by(rows, *a)), _pooled(_by(rows, *b))
    return ma - mb, math.hypot(sa, sb)


def _resolved(d: float, se: float) -> bool:
    return abs(d) > 2 * se


def verdicts(rows: list) -> list[str]:
    """One line per claim: supported, not supported, or not measurable on this model, with the figure."""
    out = []
    r3 = {mb: _by(rows, "R3", mb)[0] for mb in (1, 2, 4)}
    r2 = {mb: _by(rows, "R2", mb)[0] for mb in (2, 4)}
    d, se = _gap(rows, ("R3", 1), ("none", 1))
    out.append(f"Qwen: on-policy (1 mini-batch) needs neither R2 nor R3. R3 - none held-out gain {d:+.3f} +- {se:.3f}: "
               + ("not supported" if d > 2 * se else "supported") + f" (R3 leaves {r3[1].mismatch:.2e} of "
               f"{r3[1].unreplayed:.2e} mismatch; with one optimizer step there is no later mini-batch to drift)")
    d, se = _gap(rows, ("R3", 2), ("R2", 2))
    out.append(f"Qwen: R2 suffices at 2 mini-batches. Later-mini-batch mismatch R3/R2 {r3[2].later / r2[2].later:.2f}; "
               f"R3 - R2 held-out gain {d:+.3f} +- {se:.3f}: " + ("not supported" if d > 2 * se else "supported"))
    d, se = _gap(rows, ("R3", 4), ("R2", 4))
    d0, se0 = _gap(rows, ("R3", 4), ("none", 4))
    pays = d > 2 * se or d0 > 2 * se0
    out.append(f"Qwen: R3 pays from 4 mini-batches on. Later-mini-batch mismatch R3/R2 {r3[4].later / r2[4].later:.2f}; "
               f"R3 - R2 held-out gain {d:+.3f} +- {se:.3f}, R3 - none {d0:+.3f} +- {se0:.3f} "
               f"({len(_by(rows, 'R3', 4))} seeds of R3 and none): "
               + ("supported" if pays else "not measurable on this model (no gain difference beyond 2 se)"))
    for other in ("GSPO", "TIS"):
        d, se = _gap(rows, ("R3", 4), (other, 4))
        out.append(f"R3 paper: R3 ahead of {other}. R3 - {other} held-out gain at 4 mini-batches {d:+.3f} +- {se:.3f}: "
                   + ("supported" if d > 2 * se else "not supported" if d < -2 * se else
                      "not measurable on this model (the paper's gaps come with collapses of long runs)"))
    soft = _by(rows, "soft 0.5", 4)[0]
    d, se = _gap(rows, ("soft 0.5", 4), ("R3", 4))
    out.append(f"prime-rl #2703: soft replay at ratio 0.5 replaces {soft.replace_rate:.2g} of replayed experts; "
               f"mismatch {soft.mismatch:.2e} against R3's {r3[4].mismatch:.2e} and {soft.unreplayed:.2e} unreplayed; "
               f"soft - R3 held-out gain {d:+.3f} +- {se:.3f}"
               + ("" if _resolved(d, se) else ": no difference measurable on this model"))
    frozen, none = _by(rows, "frozen router", 4)[0], _by(rows, "none", 4)[0]
    d, se = _gap(rows, ("frozen router", 4), ("none", 4))
    out.append(f"folk remedy: a frozen router. Mismatch {frozen.mismatch:.2e} (later mini-batches {frozen.later:.2e}) "
               f"against {none.mismatch:.2e} ({none.later:.2e}) with the router training; frozen - none held-out gain "
               f"{d:+.3f} +- {se:.3f}" + ("" if _resolved(d, se) else ": no difference measurable on this model"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/stability_grid")
    ap.add_argument("--steps", type=int, default=16, help="GRPO steps per run (eval before step 1 and at the end)")
    ap.add_argument("--reuse", action="store_true", help="read runs already finished in --out instead of rerunning")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the stability_grid blocks of docs/stabilisers.md and README.md")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    done = run_all(out, args.steps, args.overrides, args.reuse)
    from r3rl.dashboard.stabilisers import grid_rows, render_table
    from r3rl.tracking.offline_reader import read_run

    runs = [read_run(folder) for _, folder in done]
    rows = grid_rows(runs, [label for label, _ in done])
    print()
    print(render_table(rows))
    subprocess.run([sys.executable, "-m", "r3rl.dashboard", "--runs", *(str(f) for _, f in done), "--out", str(out),
                    "--title", "Stabilisers side by side"], cwd=REPO, check=False, stdout=subprocess.DEVNULL)
    print(f"\ncomparison: {out / 'comparison.png'}, {out / 'comparison.html'}\n")
    verdict_lines = [f"- {line}" for line in verdicts(rows)]
    print("\n".join(verdict_lines))
    r2, r3 = _by(rows, "R2", 4)[0], _by(rows, "R3", 4)[0]
    means: dict[tuple[str, int], list] = {}
    for r in rows:
        means.setdefault((r.label, r.mini_batches), []).append(r)
    best = max(means.values(), key=lambda rs: _pooled(rs)[0])
    last = (f"grid: R3/R2 later-mini-batch mismatch at 4 mini-batches {r3.later / r2.later:.2f}; best held-out gain "
            f"{best[0].label} at {best[0].mini_batches:g} mini-batches {_pooled(best)[0]:+.3f}")
    print(last)
    if args.write_docs:
        command = " ".join(["python bench/stability_grid.py", *([f"--steps {args.steps}"] if args.steps != 16 else []),
                            *args.overrides])
        head = [f"`{command}` ({args.steps} GRPO steps of 64 prompts x 4 per run, held-out avg@4 before step 1 and "
                "after the last, paired by prompt and clustered by problem):", "", render_table(rows), ""]
        write_block(REPO / "docs" / "stabilisers.md", "\n".join([BEGIN, *head, *verdict_lines, "", f"`{last}`", END]),
                    BEGIN, END)
        write_block(REPO / "README.md", "\n".join([BEGIN, *head, f"`{last}`", END]), BEGIN, END)
        print("wrote the blocks of docs/stabilisers.md and README.md")


if __name__ == "__main__":
    main()
