"""Weight updates in flight against in turn and one step ahead: the same recipe, seeds and steps in four modes, side
by side in one invocation, one run after the other on the same machine.

    python bench/inflight_updates.py [--steps 10] [--out outputs/inflight] [overrides ...]
    python bench/inflight_updates.py --steps 8 --write-docs   # ... and the table into the block of docs/async.md

Modes: in turn (``algorithm.max_staleness=0``), one step ahead (``=1``, ``algorithm.weight_update=between_batches``),
in flight (``=1``, ``in_flight``) and in flight taking groups in completion order (``algorithm.group_intake=
completion``: a stream of two batches' groups, a step takes the first to complete), all with ``correction=tis`` and
R3. On GPUs generation sets the step; on 2 CPU cores the trainer does (the default recipe answers in ~14 tokens,
and even long answers are generated faster than the trainer takes them), so no sync would land inside a batch. The
bench puts generation back in charge (``ENGINE_BOUND``): batches of 16 samples, responses of at least
``--min-tokens`` (``rollout.sampling.min_tokens``: no EOS before it) with a long tail to ``--max-tokens``, and an
engine that runs 4 sequences at a time (``rollout.engine.max_num_seqs``). Forced lengths train on text the model
would not write, so the held-out gain here is no learning figure (docs/async.md has the default recipe's). Step 1
is left out of the rates (an overlapped run generates its first batch alone). Printed per mode: trained samples per second (as a ratio to in turn), the engine's idle share
during the steps (``/metrics``: no request running or waiting, polled every 0.1 s), staleness per token, the share
of samples spanning two versions, the samples evicted as stale, the groups that overtook a slower one, the mismatch with and without replay (over the same steps) over the tokens of the current and of
older weight versions (a current-version token's KV prefix may be the older weights', so its mismatch holds that lag), and the held-out gain (eval at step 0 and the last step, paired over prompts, clustered by problem).
Last line, for in flight with completion order: ``inflight: samples/s in-flight / one-step-ahead <r>; spanning
samples <s>; older-version tokens replay/no-replay <q>`` (s: the share of samples whose tokens span two versions,
mean over steps 2..N).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # recipes/ lives at the repository root
sys.path.insert(0, str(REPO / "bench"))  # the block writer and the machine line of readme_figures
BEGIN = "<!-- inflight_updates:begin (written by bench/inflight_updates.py --write-docs; do not edit) -->"
END = "<!-- inflight_updates:end -->"

from r3rl import metrics as M  # noqa: E402
from r3rl.rollout import auth  # noqa: E402
from r3rl.rollout.engine_metrics import counter  # noqa: E402

MODES = {"in turn": ["algorithm.max_staleness=0"],
         "one step ahead": ["algorithm.max_staleness=1", "algorithm.weight_update=between_batches"],
         "in flight": ["algorithm.max_staleness=1", "algorithm.weight_update=in_flight"],
         "completion order": ["algorithm.max_staleness=1", "algorithm.weight_update=in_flight",
                              "algorithm.group_intake=completion"]}
LONG_TAIL_TOKENS = (160, 384)  # (min, max): --min-tokens / --max-tokens
ENGINE_BOUND = ["algorithm.rollout_batch_size=4", "algorithm.global_batch_size=16", "rollout.engine.max_num_seqs=4"]


class IdleMeter:
    """Polls an engine's ``/metrics`` in a thread: (time, idle) samples, idle meaning no request running or waiting."""

    def __init__(self, url: str, every_s: float = 0.1):
        self.url, self.every_s, self.samples = url, every_s, []
        self.headers = auth.headers()  # the run's engine token: /metrics is behind it too
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=2.0, headers=self.headers) as client:
            while not self._stop.wait(self.every_s):
                try:
                    text = client.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    continue
                busy = counter(text, "vllm:num_requests_running") + counter(text, "vllm:num_requests_waiting")
                self.samples.append((time.monotonic(), busy == 0))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def idle_share(self, windows: list[tuple[float, float]]) -> float:
        inside = [idle for t, idle in self.samples if any(a <= t <= b for a, b in windows)]
        return sum(inside) / len(inside) if inside else math.nan


def run(label: str, steps: int, out_dir: Path, overrides: list[str], tokens: tuple[int, int]) -> dict:
    from r3rl.config import compose
    from recipes import warm_start
    from recipes.grpo import GRPORecipe

    cfg = compose(["parallelism=cpu", "rollout=vllm_r3", "correction=tis", f"run.num_steps={steps}",
                   f"run.output_dir={out_dir}", "run.save_every=1000", f"run.eval_every={steps}",
                   "logger.wandb.mode=disabled", *ENGINE_BOUND, f"rollout.sampling.min_tokens={tokens[0]}",
                   f"rollout.sampling.max_tokens={tokens[1]}", *MODES[label], *overrides])
    recipe = GRPORecipe(warm_start.ensure(cfg))
    windows: list[tuple[float, float]] = []
    step_fn = recipe.train_step

    def timed_step(step, prompts=None):
        start = time.monotonic()
        step_fn(step, prompts)
        if step > 1:
            windows.append((start, time.monotonic()))

    recipe.train_step = timed_step
    try:
        recipe.setup()
        with IdleMeter(recipe.engines.urls[0]) as meter:
            recipe.train()
    finally:
        recipe.cleanup()
    rows = [r for r in recipe.history if "perf/step_time_s" in r]
    samples_per_step = cfg.algorithm.rollout_batch_size * cfg.algorithm.n_samples_per_prompt
    return {"rows": rows, "rate": samples_per_step * len(windows) / sum(b - a for a, b in windows),
            "idle": meter.idle_share(windows), "gain": held_out_gain(out_dir, steps)}


def held_out_gain(out_dir: Path, steps: int) -> tuple[float, float]:
    from r3rl.eval.records import paired_gain

    names = sorted({p.name.rsplit("-step", 1)[0] for p in (out_dir / "eval").glob("*-step*.json")})
    if not names:
        return math.nan, math.nan
    gain, se, _ = paired_gain(out_dir / "eval", names[0], 0, steps)
    return gain, se


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows[1:] if key in r and not math.isnan(r[key])]
    return statistics.fmean(values) if values else math.nan


def paired(rows: list[dict], a: str, b: str) -> tuple[float, float]:
    """The means of ``a`` and ``b`` over the same steps (2 on), those where both were logged: with
    ``replay.no_replay_every`` > 1 the unreplayed figure is logged on some steps only, and a ratio of means over
    different steps would be partly the steps'."""
    both = [(r[a], r[b]) for r in rows[1:] if a in r and b in r and not (math.isnan(r[a]) or math.isnan(r[b]))]
    if not both:
        return math.nan, math.nan
    return statistics.fmean(x for x, _ in both), statistics.fmean(y for _, y in both)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="outputs/inflight")
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of the modes, comma-separated")
    parser.add_argument("--min-tokens", type=int, default=LONG_TAIL_TOKENS[0])
    parser.add_argument("--max-tokens", type=int, default=LONG_TAIL_TOKENS[1])
    parser.add_argument("--write-docs", action="store_true", help="replace the inflight_updates block in docs/async.md")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.write_docs and (args.overrides or args.modes != ",".join(MODES)
                            or (args.min_tokens, args.max_tokens) != LONG_TAIL_TOKENS):
        parser.error("--write-docs quotes the bench as shipped: drop the overrides, --modes and the token bounds")
    if args.steps < 3:
        parser.error("--steps must be >= 3 (step 1 is left out)")
    modes = [m for m in MODES if m in args.modes.split(",")]
    tokens = (args.min_tokens, args.max_tokens)
    results = {label: run(label, args.steps, Path(args.out) / label.replace(" ", "_"), args.overrides, tokens)
               for label in modes}

    table = Table(title=f"{args.steps} steps, rates and means over steps 2..{args.steps}")
    table.add_column("figure")
    for label in modes:
        table.add_column(label, justify="right")

    markdown = [f"| | {' | '.join(modes)} |", "|---" * (len(modes) + 1) + "|"]

    def row(name: str, cell) -> None:
        cells = [cell(results[label]) for label in modes]
        table.add_row(name, *cells)
        markdown.append(f"| {name} | {' | '.join(cells)} |")

    base = results[modes[0]]["rate"]
    row(f"trained samples / s, ratio to {modes[0]}", lambda r: f"{r['rate'] / base:.2f}")
    row("engine idle share during the steps", lambda r: f"{r['idle']:.2f}")
    for stage in ("rollout", "weight_sync", "logprobs", "train"):
        row(f"s per step: {stage}" + (" (waiting for samples)" if stage == "rollout" else ""),
            lambda r, k=M.perf_time_key(stage): f"{mean(r['rows'], k):.2f}")
    row("response length mean / max", lambda r: f"{mean(r['rows'], M.RESPONSE_LENGTH_MEAN):.1f} / "
                                                f"{max(x.get(M.RESPONSE_LENGTH_MAX, 0) for x in r['rows']):.0f}")
    row("staleness per token (versions)", lambda r: f"{mean(r['rows'], M.STALENESS_TOKEN_MEAN):.2f}")
    row("samples spanning two versions", lambda r: f"{mean(r['rows'], M.SPANNING_VERSIONS_SHARE):.2f}")
    row("samples out of the loss as stale, per step", lambda r: f"{mean(r['rows'], M.DROPPED_STALE):.1f}")
    row("engine preemptions, per step", lambda r: f"{mean(r['rows'], M.PREEMPTIONS):.1f}")
    row("groups overtaking a slower one, per step", lambda r: f"{mean(r['rows'], M.GROUPS_OVERTAKING):.1f}")
    # replayed and unreplayed over the same steps; a current-version token's mismatch still holds the KV lag: the
    # prefix it attended to was computed under the older weights where an update landed inside its request
    for which, what in (("current", "current-version tokens (their KV prefix may be older weights')"),
                        ("older", "older-version tokens")):
        row(f"mismatch, {what}, replay / no replay",
            lambda r, w=which: "{:.3g} / {:.3g}".format(*paired(
                r["rows"], M.LOGPROB_ABS_DIFF_VERSION_TOKENS.format(which=w),
                M.LOGPROB_ABS_DIFF_NO_REPLAY_VERSION_TOKENS.format(which=w))))
    row("mismatch, all tokens, replay / no replay",
        lambda r: "{:.3g} / {:.3g}".format(*paired(r["rows"], M.LOGPROB_ABS_DIFF, M.LOGPROB_ABS_DIFF_NO_REPLAY)))
    row("held-out gain +- se (clustered by problem)", lambda r: f"{r['gain'][0]:+.3f} +- {r['gain'][1]:.3f}")
    Console(width=160).print(table)
    if not {"one step ahead", "in flight", "completion order"} <= set(results):
        return
    ahead = results["one step ahead"]
    print(f"in flight, batch intake: samples/s / one-step-ahead {results['in flight']['rate'] / ahead['rate']:.2f}")
    # the last line is the whole in-flight design: updates under the requests and groups taken as they complete
    flight = results["completion order"]
    older = M.LOGPROB_ABS_DIFF_VERSION_TOKENS.format(which="older")
    older_no = M.LOGPROB_ABS_DIFF_NO_REPLAY_VERSION_TOKENS.format(which="older")
    replayed, unreplayed = paired(flight["rows"], older, older_no)
    q = replayed / unreplayed
    s = mean(flight["rows"], M.SPANNING_VERSIONS_SHARE)
    last = (f"inflight: samples/s in-flight / one-step-ahead {flight['rate'] / ahead['rate']:.2f}; "
            f"spanning samples {s:.2f}; older-version tokens replay/no-replay {q:.2f}")
    print(last)
    if args.write_docs:
        from readme_figures import measured, write_block

        block = "\n".join([BEGIN, f"`python bench/inflight_updates.py --steps {args.steps} --write-docs` ({measured()}); "
                                  f"rates and means over steps 2-{args.steps}:", "", *markdown, "",
                                  f"`{last}` (batch intake in flight: "
                                  f"{results['in flight']['rate'] / ahead['rate']:.2f} over one step ahead)", END])
        write_block(REPO / "docs/async.md", block, BEGIN, END)
        print("docs/async.md: block replaced")

if __name__ == "__main__":
    main()
