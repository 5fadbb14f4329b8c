"""What drives R3's effect on the tiny model: a sweep of model shape, router and dtype on the SFT-warm-started model.

    python bench/routing_regime.py [--out outputs/routing_regime] [--steps 16] [--points 'a;b'] [--write-docs]
                                   [--reuse] [override ...]

Each point is ``python run.py`` (the default CPU recipe: SFT warm start, cached per shape under data/warm_start/,
then GRPO with R3 and the paired unreplayed pass on the same batch) with the point's overrides, ``--steps`` steps and
no eval, one after the other on this machine. Per point it prints, from the run's W&B offline files:

- the flip rate (``r3/routing_flip_rate``: routed-expert choices the trainer would change, replay off);
- the mean over steps of ``train/logprob_abs_diff`` with replay and of the unreplayed pass on the same batch, and
  the mean of their per-step ratio with its standard error over the steps;
- what replay removes per sample (the paired delta, standard error clustered by prompt) and its z;
- the router margin (mean k-th minus (k+1)-th router logit, share under ``r3rl.metrics.SMALL_ROUTER_MARGIN``) and
  the expert load imbalance (MaxVio), which explain a flip rate;
- the mean step time, and its ratio to the first point's (side by side in one run: CPU times only as ratios).

``--write-docs`` replaces the ``routing_regime`` block of docs/r3.md with the table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from r3rl import metrics as M
from r3rl.tracking.summary import REPLAY_RATIO, replay_removes, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_runs import recipe_run  # noqa: E402
from readme_figures import _pm, write_block  # noqa: E402

# (name, overrides): every point names its shape whole, so the table reads the same whatever the default is. The
# first is the yardstick of the step-time ratios.
POINTS = (
    ("4 layers", ("model.num_layers=4",)),
    ("8 layers", ("model.num_layers=8",)),
    ("12 layers", ("model.num_layers=12",)),
    ("16 layers", ("model.num_layers=16",)),
    ("4 layers, 64 experts top-8", ("model.num_layers=4", "model.num_experts=64", "model.moe_topk=8")),
    # Megatron takes top-1 only with the softmax before the top-k (its weight the chosen expert's probability)
    ("4 layers, top-1", ("model.num_layers=4", "model.moe_topk=1", "model.norm_topk_prob=false")),
    ("4 layers, expert FFN 256", ("model.num_layers=4", "model.moe_ffn_hidden_size=256")),
    ("4 layers, norm_topk_prob=false", ("model.num_layers=4", "model.norm_topk_prob=false")),
    ("4 layers, engine float32", ("model.num_layers=4", "rollout.engine.dtype=float32")),
    ("4 layers, load-balancing loss 0.01", ("model.num_layers=4",
                                            "+trainer.transformer_overrides.moe_router_load_balancing_type=aux_loss",
                                            "+trainer.transformer_overrides.moe_aux_loss_coeff=0.01")),
    ("8 layers, load-balancing loss 0.01", ("model.num_layers=8",
                                            "+trainer.transformer_overrides.moe_router_load_balancing_type=aux_loss",
                                            "+trainer.transformer_overrides.moe_aux_loss_coeff=0.01")),
    ("16 layers, load-balancing loss 0.01", ("model.num_layers=16",
                                             "+trainer.transformer_overrides.moe_router_load_balancing_type=aux_loss",
                                             "+trainer.transformer_overrides.moe_aux_loss_coeff=0.01")),
)
# every point's GRPO steps: 8 prompts x 8 samples, one optimizer step each, no eval (the mismatch of a batch is what
# is measured, not learning)
SWEEP = ("algorithm.rollout_batch_size=8", "algorithm.n_samples_per_prompt=8", "algorithm.global_batch_size=64",
         "run.eval_every=0", "run.resume=false")
BEGIN = "<!-- routing_regime:begin (written by bench/routing_regime.py --write-docs; do not edit) -->"
END = "<!-- routing_regime:end -->"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_point(out: Path, name: str, overrides: tuple[str, ...], steps: int, extra: list[str], reuse: bool) -> Path:
    return recipe_run(out / slug(name), [f"run.num_steps={steps}", *SWEEP, *overrides, *extra], label=name,
                      reuse=reuse)


def figures(history: list[dict]) -> dict[str, float]:
    """The point's row: means over its steps (the paired delta with its clustered standard error)."""
    keys = (M.ROUTING_FLIP_RATE, M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY, M.ROUTER_MARGIN_MEAN,
            M.ROUTER_MARGIN_SMALL_SHARE, M.EXPERT_LOAD_MAX_VIO, M.PERF_STEP_TIME)
    stats = summarize(history, keys=keys)
    row = {key: stats[key]["mean"] if key in stats else math.nan for key in keys}
    # the ratio's error over steps (each step an independent batch of prompts)
    ratios = [r[M.LOGPROB_ABS_DIFF] / r[M.LOGPROB_ABS_DIFF_NO_REPLAY] for r in history
              if r.get(M.LOGPROB_ABS_DIFF_NO_REPLAY) and M.LOGPROB_ABS_DIFF in r]
    row[REPLAY_RATIO], row["ratio_se"] = (M.mean_and_stderr(ratios, range(len(ratios))) if len(ratios) > 1
                                          else (math.nan, math.nan))
    removed = replay_removes(history)
    row["removes"], row["removes_se"], row["steps"] = removed if removed else (math.nan, math.nan, len(history))
    return row


def table(rows: dict[str, dict[str, float]], points: dict[str, tuple[str, ...]], steps: int,
          extra: list[str]) -> str:
    base = next(iter(rows.values()))[M.PERF_STEP_TIME]
    lines = [
        BEGIN,
        f"`python bench/routing_regime.py --steps {steps}{''.join(' ' + o for o in extra)}` (each point: the SFT "
        "warm start of its shape, then that many GRPO steps of the default recipe, 8 prompts x 8 samples, bf16 "
        "engine vs fp32 trainer unless named; means over the steps; \"removes\": the paired delta, standard error "
        "clustered by prompt; ratio: mean over steps of replayed / unreplayed, ± its standard error over the "
        "steps; step time as a ratio to the first row's, measured in the same sweep):",
        "",
        "| point | overrides | flip rate | mismatch, replayed | unreplayed | ratio | replay removes (z) "
        "| router margin | margin < 0.05 | MaxVio | step time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        # an engine in the trainer's dtype leaves no mismatch: nothing to remove, no z
        removes = (f"{_pm(r['removes'], r['removes_se'])} ({r['removes'] / r['removes_se']:.1f})"
                   if r["removes_se"] > 0 else "none to remove")
        lines.append(
            f"| {name} | `{' '.join(points[name])}` | {r[M.ROUTING_FLIP_RATE]:.2%} | {r[M.LOGPROB_ABS_DIFF]:.3g} "
            f"| {r[M.LOGPROB_ABS_DIFF_NO_REPLAY]:.3g} | {r[REPLAY_RATIO]:.2f} ± {r['ratio_se']:.2f} | {removes} "
            f"| {r[M.ROUTER_MARGIN_MEAN]:.3f} | {r[M.ROUTER_MARGIN_SMALL_SHARE]:.1%} "
            f"| {r[M.EXPERT_LOAD_MAX_VIO]:.2f} | {r[M.PERF_STEP_TIME] / base:.2f}x |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/routing_regime")
    parser.add_argument("--steps", type=int, default=16, help="GRPO steps per point")
    parser.add_argument("--points", default=None, help="point names separated by ';' (default: all)")
    parser.add_argument("--write-docs", action="store_true", help="replace the block in docs/r3.md")
    parser.add_argument("--reuse", action="store_true", help="read the finished run of a point in --out, not rerun it")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every point")
    args = parser.parse_args()
    chosen = dict(POINTS)
    if args.points:
        names = [n.strip() for n in args.points.split(";")]
        unknown = [n for n in names if n not in chosen]
        if unknown:
            raise SystemExit(f"--points: unknown {unknown}; known: {list(chosen)}")
        chosen = {n: chosen[n] for n in names}
    if args.write_docs and (args.overrides or args.points):
        raise SystemExit("--write-docs quotes the whole sweep as shipped: drop --points and the overrides")
    from r3rl.tracking.offline_reader import read_run

    out = Path(args.out).resolve()
    rows = {}
    for name, overrides in chosen.items():
        history = [row for row in read_run(run_point(out, name, overrides, args.steps, args.overrides,
                                                    args.reuse)).history
                   if M.LOGPROB_ABS_DIFF in row]
        rows[name] = figures(history)
        print(table(rows, chosen, args.steps, args.overrides), flush=True)
    block = table(rows, chosen, args.steps, args.overrides)
    if args.write_docs:
        write_block(REPO / "docs/r3.md", block, BEGIN, END)
        print("docs/r3.md: routing_regime block replaced")


if __name__ == "__main__":
    main()
