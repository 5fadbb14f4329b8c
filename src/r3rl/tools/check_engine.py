"""Check that a running vLLM server serves what an R3 run needs.

    python -m r3rl.tools.check_engine --url http://127.0.0.1:8100 --num-layers 48 --topk 8 --num-experts 128
    python -m r3rl.tools.check_engine --url ... --num-layers 46 --first-k-dense 1 --topk 8 --num-experts 128  # GLM

Sends one short greedy request and validates its routed experts against the model shape (rows = tokens - 1,
layers, top-k, ids < experts, distinct, no all-zero MoE layer, the dense leading layers' rows all zero); also
checks the vLLM version and the dev-mode routes.
Exit status 0 when the engine is fit, 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import sys

from r3rl.rollout.errors import EngineError
from r3rl.rollout.probe import check_engine
from r3rl.rollout.routed_experts import RouteSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m r3rl.tools.check_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="http://HOST:PORT of the vLLM server")
    parser.add_argument("--num-layers", type=int, required=True, help="model num_hidden_layers")
    parser.add_argument("--topk", type=int, required=True, help="experts per token (num_experts_per_tok)")
    parser.add_argument("--num-experts", type=int, required=True, help="routed experts per MoE layer")
    parser.add_argument("--first-k-dense", type=int, default=0,
                        help="leading decoder layers with a dense MLP (first_k_dense_replace: GLM-4.5, DeepSeek-V3)")
    parser.add_argument("--no-routing-replay", action="store_true",
                        help="the run does not replay routes: do not require them")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = parser.parse_args(argv)
    spec = None if args.no_routing_replay else RouteSpec(args.num_layers, args.topk, args.num_experts,
                                                         dense_layers=tuple(range(args.first_k_dense)))
    try:
        report = check_engine(args.url, spec=spec, timeout_s=args.timeout)
    except EngineError as err:
        print(f"check_engine: FAILED: {err}", file=sys.stderr)
        return 1
    moe = args.num_layers - args.first_k_dense
    routes = (f"routed experts ok: {report.route_rows} rows x {moe} MoE layers x top-{args.topk} ({report.route_dtype})"
              f" for {report.tokens} tokens" if spec is not None else "routes not required")
    print(f"check_engine: OK: {report.url} vLLM {report.version}; {routes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
