"""Doctor check 3 on deep stand-ins of the tiny model: does its flip bound hold at depth on a sound stack?

    python bench/deep_doctor.py [--layers 24 48] [--out outputs/deep_doctor] [--plot docs/deep_doctor.png]
                                [override ...]

Per depth, ``python doctor.py`` on the tiny Qwen3-MoE with that many layers (its own random checkpoint and SFT warm
start, cached under data/ by the shape), the engine in bfloat16 against the float32 trainer (the CPU profile). From
each run's ``doctor.json`` it prints, per layer, the sound stack's teacher-forced flips, the bound one rounding of
the router's logits and inputs gives, the bound with the hidden-state drift measured at that depth (what check 3
uses), the near miss (routes a training step away), the flips of the trainer's own pass under the emulated
rounding, and that pass's margin move in units of the one-rounding reach. Then, per depth, the slope over the layers
of flips / reachable rows for each reach, with its standard error: a reach that keeps up with depth has no slope.
The last lines are the figures: depth by depth, how far under each bound the sound flips stayed, the slopes, and how
many of the engine's flips the emulated rounding reproduces (a calibration: it rounds at three places a layer).
``--plot`` draws each depth's layers: the flips, both bounds and the near miss. The doctor's own output (its
progress, the warm start's) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHECK = "routes are the model's"


def doctor(layers: int, out: Path, overrides: list[str]) -> dict:
    name = f"tiny_moe_{layers}"
    run_dir = out / name
    argv = [sys.executable, "doctor.py", f"model.name={name}", f"model.num_layers={layers}",
            f"model.checkpoint=data/models/{name}", "model.generate_if_missing=true", "warm_start.enabled=true",
            f"run.output_dir={run_dir}", *overrides]
    print("$", " ".join(argv[1:]), flush=True)
    done = subprocess.run(argv, cwd=REPO, stdout=sys.stderr, stderr=sys.stderr)
    report = run_dir / "doctor" / "doctor.json"
    if not report.is_file():
        sys.exit(f"doctor.py at {layers} layers wrote no report (exit {done.returncode}): its output is above")
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    print(f"  {layers} layers: " + ", ".join(f"{n} {c['status']}" for n, c in checks.items()), flush=True)
    return checks[CHECK]


def slope(y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of ``y`` over the layer index, with its standard error."""
    x = np.arange(len(y), dtype=np.float64)
    a = np.vstack([np.ones_like(x), x]).T
    coef, residual, *_ = np.linalg.lstsq(a, y, rcond=None)
    dof = max(len(y) - 2, 1)
    cov = (residual[0] / dof if len(residual) else 0.0) * np.linalg.inv(a.T @ a)
    return float(coef[1]), float(np.sqrt(cov[1, 1]))


def one_rounding_bound(v: dict) -> np.ndarray:
    """check 3's bound from the one-rounding reach alone (``doctor.checks.flip_bounds`` without the drift)."""
    from r3rl.doctor.checks import flip_bounds

    return flip_bounds(np.array(v["rounding_reachable_per_layer"]), np.array(v["rows_per_layer"]))


def rows_for(check: dict) -> tuple[list[str], str]:
    v = check["values"]
    flips, near = np.array(v["flip_per_layer"]), np.array(v["near_miss_flip_per_layer"])
    one = np.array(v["rounding_reachable_per_layer"])
    with_drift = np.array(v["reachable_per_layer"])
    bound, one_bound = np.array(v["flip_bound_per_layer"]), one_rounding_bound(v)
    lines = [f"{'layer':>5} {'flips':>7} {'bound, 1 rounding':>18} {'bound, drift':>13} {'a step away':>12} "
             f"{'emulated flips':>15} {'move / reach':>13}"]
    for i in range(len(flips)):
        lines.append(f"{i:>5} {flips[i]:>7.2%} {one_bound[i]:>18.2%} {bound[i]:>13.2%} {near[i]:>12.2%} "
                     f"{v['drift_flip_per_layer'][i]:>15.2%} {v['drift_move_over_reach_per_layer'][i]:>13.2f}")
    s1, e1 = slope(flips / np.maximum(one, 1e-12))
    s2, e2 = slope(flips / np.maximum(with_drift, 1e-12))
    emulated = np.array(v["drift_flip_per_layer"])
    under = int((flips <= bound).sum())
    summary = (f"deep stand-in of {len(flips)} layers: sound flips under the drift bound on {under} of {len(flips)} layers (at most "
               f"{np.max(flips / bound):.0%} of it; of the one-rounding bound {np.max(flips / one_bound):.0%}), the "
               f"near miss over it on {int((near > bound).sum())}; slope of flips / reachable per layer: one rounding "
               f"{s1:+.4f} +- {e1:.4f}, with drift {s2:+.4f} +- {e2:.4f}; the emulated rounding flips "
               f"{emulated.sum() / flips.sum():.2f} x the engine's rows (correlation over layers "
               f"{np.corrcoef(emulated, flips)[0, 1]:.2f})")
    return lines, summary


def plot(checks: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(checks), figsize=(6 * len(checks), 3.6), squeeze=False)
    for ax, (layers, check) in zip(axes[0], checks.items()):
        v = check["values"]
        x = np.arange(layers)
        ax.plot(x, 100 * np.array(v["flip_per_layer"]), "o-", color="black", label="sound stack's flips")
        ax.plot(x, 100 * one_rounding_bound(v), "--", color="tab:blue", label="bound, one rounding")
        ax.plot(x, 100 * np.array(v["flip_bound_per_layer"]), "-", color="tab:green", label="bound with drift (used)")
        ax.plot(x, 100 * np.array(v["near_miss_flip_per_layer"]), ":", color="tab:red", label="a step away (must exceed)")
        ax.set_title(f"{layers} layers, bf16 engine, float32 trainer")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("% of response rows")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"{path}: written", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "deep_doctor")
    parser.add_argument("--plot", type=Path, help="draw every depth's layers into this picture")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    checks, summaries = {}, []
    for layers in opts.layers:
        checks[layers] = doctor(layers, opts.out, opts.overrides)
        lines, summary = rows_for(checks[layers])
        print("\n".join(lines), flush=True)
        summaries.append(summary)
    if opts.plot:
        plot(checks, opts.plot)
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
