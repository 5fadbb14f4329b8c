"""Check a saved rollout (``debug.save_rollout=PATH``) against the rollout -> training contract.

    python -m r3rl.tools.verify_rollout outputs/run/rollouts --num-layers 48 --topk 8 [--num-experts 128]

PATH is one rollout file or a folder of them (every ``*.npz``, in name order). Every sample is checked: lengths of
log-probs and loss mask, status vs finish reason, no trainable aborted sample, and the routed experts (narrow dtype,
rows == len(tokens) - 1, layers, top-k, ids in range, K distinct ids per row, no all-zero MoE layer). Exit status
0 when all pass; 1 with every problem listed (sample index, request id, expected vs got) otherwise; 2 when PATH
cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from r3rl.rollout.store import load_rollout
from r3rl.rollout.verify import verify_samples

MAX_LISTED = 50


def rollout_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob("*.npz"))
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m r3rl.tools.verify_rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a rollout file or a folder of rollout files")
    parser.add_argument("--num-layers", type=int, required=True, help="model num_hidden_layers")
    parser.add_argument("--topk", type=int, required=True, help="experts per token")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="routed experts per layer (checks ids < E and the dtype; default: dtype range)")
    parser.add_argument("--no-routing-replay", action="store_true", help="the run did not record routes")
    args = parser.parse_args(argv)
    files = rollout_files(args.path)
    if not files:
        print(f"verify_rollout: no rollout files in {args.path}", file=sys.stderr)
        return 2
    total, problems = 0, []
    for f in files:
        try:
            samples = load_rollout(f)
        except (OSError, ValueError, KeyError) as err:
            print(f"verify_rollout: cannot read {f}: {err}", file=sys.stderr)
            return 2
        total += len(samples)
        problems += [f"{f.name}: {p}" for p in verify_samples(
            samples, num_layers=args.num_layers, topk=args.topk, num_experts=args.num_experts,
            routing_replay=not args.no_routing_replay)]
    if problems:
        for p in problems[:MAX_LISTED]:
            print(p, file=sys.stderr)
        more = f" (first {MAX_LISTED} listed)" if len(problems) > MAX_LISTED else ""
        print(f"verify_rollout: FAILED: {len(problems)} problems in {total} samples{more}", file=sys.stderr)
        return 1
    print(f"verify_rollout: OK: {total} samples in {len(files)} file(s) meet the contract")
    return 0


if __name__ == "__main__":
    sys.exit(main())
