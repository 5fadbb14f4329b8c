"""CPU rollout speed: the real engine against ``transformers``' ``generate`` on the same checkpoint, in one run.

    python bench/cpu_rollout.py [--prompts 16] [--samples 8] [--max-tokens 16] [--repeats 5] [override ...]
    python bench/cpu_rollout.py --write-docs   # ... and the ratio with its machine into the block of docs/benchmarks.md

The engine is the plan's (``rollout=vllm_r3`` by default: routes on, bfloat16, r3rl's CPU environment), started once;
each timed batch goes through ``RolloutClient`` (HTTP, route decoding and validation included): ``--prompts``
arithmetic prompts x ``--samples`` samples, ``--max-tokens`` new tokens, temperature 1. ``generate`` gets the same
prompts repeated ``--samples`` times as one left-padded batch, sampling, the same dtype, and as many torch threads as
the engine's worker uses (``rollout.engine.cpu_threads``: 1 on the CPU scale). Tokens/s = generated tokens / wall
time, median over ``--repeats`` timed batches of each, taken in turn (engine, generate, engine, ...).

It also reports the share of the engine worker's time spent in Triton's interpreter during the timed batches (the
worker clocks every interpreted launch: ``R3RLWorkerExtension.r3rl_interpreter_clock``) and which kernels those
were, and the CPU time each engine process used per second of those batches (a process that spins while it waits
shows up as a busy core). ``override`` (Hydra) changes the engine, e.g. ``'+rollout.engine.extra_env={R3RL_MRV2_TORCH_KERNELS: "0"}'``
for the interpreted kernels. Last line: ``engine/hf generate tokens/s ratio: <r>``.

The ratio depends on the CPU, so the output names it: where oneDNN has no bfloat16 matmul (AVX2 without AVX-512),
torch's bfloat16 ``linear`` is ~10x slower than float32 and dominates both sides' steps, and the engine's fixed cost
per step (scheduling, sampling, HTTP) weighs less than on a CPU with fast bfloat16 kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch

from r3rl.config import compose
from r3rl.config.schema import SamplingConfig
from r3rl.data.arithmetic import generate_problems
from r3rl.models.tiny_moe import ensure_checkpoint
from r3rl.net import free_port
from r3rl.rollout import auth
from r3rl.plan import build_plan
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import VLLMEngine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # the block writer and the machine line of readme_figures
BEGIN = "<!-- cpu_rollout:begin (written by bench/cpu_rollout.py --write-docs; do not edit) -->"
END = "<!-- cpu_rollout:end -->"


def cpu_identity() -> str:
    """The CPU model, torch's vector ISA and whether oneDNN multiplies bfloat16 natively."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    native = "yes" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{model} ({psutil.cpu_count()} cores), torch ISA {isa}, oneDNN bfloat16: {native}"


def rpc(url: str, method: str, *args) -> object:
    reply = httpx.post(f"{url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=60, headers=auth.headers())
    reply.raise_for_status()
    return reply.json()["results"][0]


def side_by_side(cfg, checkpoint: str, prompts: list[list[int]], samples: int, sampling: SamplingConfig,
                 repeats: int, dtype: str, log_dir: Path) -> tuple[dict, dict]:
    """Timed engine batches and ``generate`` batches in turn (engine, generate, engine, ...), so both see the same
    machine: on a shared 2-core box a ratio of two runs minutes apart moved by +-15%."""
    launch = build_plan(cfg).engines[0]
    with VLLMEngine.launch(launch, log_dir, cfg.rollout.engine.startup_timeout_s) as engine:
        client = RolloutClient.from_config(cfg, [engine.url], progress=False, max_concurrency=len(prompts) * samples)
        client.generate_sync(prompts, samples, sampling)  # warm-up: every batch shape the timed runs see
        info = rpc(engine.url, "r3rl_worker_info")
        hf = HFGenerate(checkpoint, prompts, samples, sampling.max_tokens, dtype, info["torch_threads"])
        hf.run()  # warm-up
        rpc(engine.url, "r3rl_interpreter_clock", True)
        procs = [psutil.Process(pid) for pid in engine.process_tree() if psutil.pid_exists(pid)]
        names = {p.pid: f"{p.pid} {p.name()}" for p in procs}
        cpu = {p.pid: 0.0 for p in procs}
        rates, hf_rates, walls = [], [], 0.0
        for _ in range(repeats):
            before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
            t0 = time.perf_counter()
            out = client.generate_sync(prompts, samples, sampling)
            wall = time.perf_counter() - t0
            for p in procs:
                cpu[p.pid] += sum(p.cpu_times()[:2]) - before[p.pid]
            walls += wall
            rates.append(sum(s.response_length for s in out) / wall)
            assert all(s.routed_experts is not None for s in out) or not cfg.rollout.routing_replay
            hf_rates.append(hf.run())
        clock = rpc(engine.url, "r3rl_interpreter_clock", False)
    return ({"cpu_s": {names[pid]: seconds for pid, seconds in cpu.items()}, "tok_s": statistics.median(rates),
             "runs": rates, "threads": info["torch_threads"], "stand_ins": info["stand_ins"],
             "interpreted_s": clock["seconds"], "wall_s": walls, "kernels": clock["kernels"]},
            {"tok_s": statistics.median(hf_rates), "runs": hf_rates})


class HFGenerate:
    """``transformers``' ``generate`` on the same prompts, each repeated ``samples`` times as one left-padded batch."""

    def __init__(self, checkpoint: str, prompts: list[list[int]], samples: int, max_tokens: int, dtype: str,
                 threads: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        tok = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        rows = [p for p in prompts for _ in range(samples)]
        self.width = max(len(p) for p in rows)
        self.ids = torch.tensor([[pad] * (self.width - len(p)) + p for p in rows])
        mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in rows])
        self.kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad)

    def run(self) -> float:
        """One batch; generated tokens/s."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(self.ids, **self.kwargs)
            return (out.shape[1] - self.width) * self.ids.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-docs", action="store_true", help="replace the cpu_rollout block in docs/benchmarks.md")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the engine")
    args = parser.parse_args()
    cfg = compose(["model=tiny_moe", "rollout=vllm_r3", f"rollout.engine.base_port={free_port()}", *args.overrides])
    checkpoint = str(ensure_checkpoint(cfg.model))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tok(p["prompt"])["input_ids"] for p in generate_problems(args.prompts, seed=7)]
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1234)
    dtype = build_plan(cfg).engine_dtype
    with tempfile.TemporaryDirectory(prefix="r3rl-bench-") as tmp:
        engine, hf = side_by_side(cfg, checkpoint, prompts, args.samples, sampling, args.repeats, dtype, Path(tmp))

    print(f"workload: {args.prompts} prompts x {args.samples} samples, {args.max_tokens} new tokens, temperature 1, "
          f"{dtype}, {engine['threads']} torch thread(s) on both sides, {args.repeats} timed runs each, in turn")
    print(f"cpu: {cpu_identity()}")
    print(f"engine: MRv2 kernels {'as torch stand-ins' if engine['stand_ins'] else 'in the Triton interpreter'} "
          f"({len(engine['stand_ins'])} swapped)")
    for name, r in (("engine (HTTP, routes)", engine), ("hf generate", hf)):
        runs = ", ".join(f"{x:.0f}" for x in r["runs"])
        print(f"{name:>22}: {r['tok_s']:8.1f} tokens/s  [{runs}]")
    share = engine["interpreted_s"] / engine["wall_s"] if engine["wall_s"] else 0.0
    print(f"worker time in Triton's interpreter during the timed batches: {100 * share:.1f}% "
          f"({engine['interpreted_s']:.2f} s of {engine['wall_s']:.2f} s)")
    busy = sum(engine["cpu_s"].values()) / engine["wall_s"]
    print(f"engine processes' CPU time per second of the timed batches: {busy:.2f} cores ("
          + ", ".join(f"{k}: {v / engine['wall_s']:.2f}" for k, v in engine["cpu_s"].items()) + ")")
    for name, (calls, seconds) in sorted(engine["kernels"].items(), key=lambda kv: -kv[1][1]):
        print(f"    {name}: {calls} launches, {seconds:.3f} s")
    ratio = engine["tok_s"] / hf["tok_s"]
    print(f"engine/hf generate tokens/s ratio: {ratio:.2f}")
    if args.write_docs:
        if args.overrides or (args.prompts, args.samples, args.max_tokens, args.repeats) != (16, 8, 16, 5):
            raise SystemExit("--write-docs quotes the default workload: drop the overrides and sizes")
        from readme_figures import measured, write_block

        block = "\n".join([BEGIN, f"`python bench/cpu_rollout.py --write-docs` ({measured()}; {cpu_identity()}): "
                                  f"`engine/hf generate tokens/s ratio: {ratio:.2f}`, the engine "
                                  f"{100 * share:.1f}% of its worker time in Triton's interpreter.", END])
        write_block(REPO / "docs/benchmarks.md", block, BEGIN, END)
        print("docs/benchmarks.md: block replaced")


if __name__ == "__main__":
    main()
