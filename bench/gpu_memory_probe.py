"""Memory probe: a Qwen3-30B-A3B-width slice through one training step on one GPU, measured next to the plan.

The slice is the planned experiment (``experiment=qwen3_30b_r3_4p4``: its micro-batch tokens, bf16, full recompute,
distributed optimizer with CPU offload) with ``--layers`` decoder layers (default 2) and all 128 experts on the one
GPU: real hidden size, heads, experts, top-k, expert width and vocabulary. r3rl's own code builds it
(``r3rl.train.model``: settings, GPTModel, Megatron DDP; ``r3rl.train.optim``: the optimizer) with random weights
(no checkpoint), and runs one forward + backward + optimizer step the way ``MegatronTrainer`` does (token log-probs
by ``vocab_parallel_cross_entropy`` on the float32 logits, the GRPO loss, ``finalize_model_grads``, the step).

Measured (``torch.cuda.memory_allocated`` / ``max_memory_allocated``) after each phase: weights (model built),
gradients (DDP's float32 buffer), master weights + optimizer state on the GPU (optimizer built, and what its first
step adds), activations + logits (the peak of forward and backward above what stays resident). Each is printed next
to ``r3rl.memory.trainer_parts`` for the same slice; the last line is ``memory plan/measured: <ratio>``: the plan's
terms that torch's allocator sees (all but ``runtime``: CUDA context, NCCL, fragmentation) over the step's peak.
Exit 0 when the ratio is within [0.9, 1.2], 4 outside, 3 without a CUDA GPU (1: it failed).

Without TransformerEngine (the one-GPU check carries none) r3rl's local layer spec runs its core attention through
torch's fused ``scaled_dot_product_attention`` on CUDA (``r3rl.train.te_fallback.local_core_attention``; Megatron's
own local attention would keep an S x S score matrix per head, 32 x 9216^2 in bf16 plus its float32 softmax), so the
probe measures r3rl's spec as it runs, with TE or without. ``--packed`` feeds the micro batch as one packed (THD) row
of one segment, the way ``trainer.packing`` does, through that attention's packed path. For the same reason the plan
side takes ``trainer.precision_aware_optimizer`` as this install runs it (off without TE, where r3rl's
``te_fallback`` turns it off: then the float32 master weights stay on the GPU).

    python bench/gpu_memory_probe.py               # on one GPU
    python bench/gpu_memory_probe.py --layers 2 4  # and the per-layer slope (scripts/gpu_check.sh runs this)
    python bench/gpu_memory_probe.py --packed      # the micro batch as one packed 9216-token segment
    python bench/gpu_memory_probe.py --plan-only   # anywhere: the plan side only
    python bench/gpu_memory_probe.py --cpu-smoke   # development: a tiny slice through the same code on the CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import warnings
from dataclasses import dataclass

GIB = 1024**3
EXPERIMENT = "qwen3_30b_r3_4p4"
RATIO_RANGE = (0.9, 1.2)
NO_CUDA_EXIT = 3
OUTSIDE_EXIT = 4  # measured, and the plan is off by more than RATIO_RANGE allows
# r3rl.memory.trainer_parts' terms: resident through the step, and the step's working set
STATIC_TERMS = ("weights", "gradients", "master weights", "optimizer state")
TRANSIENT_TERMS = ("activations", "logits")
# a model small enough for a CPU, for --cpu-smoke (the code path, not the memory)
CPU_SMOKE_MODEL = ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
                   "model.head_dim=16", "model.num_experts=8", "model.moe_topk=2", "model.moe_ffn_hidden_size=32",
                   "model.vocab_size=512", "parallelism=cpu", "trainer.params_dtype=float32",
                   "trainer.optimizer_cpu_offload=false", "trainer.max_tokens_per_micro_batch=64"]


def slice_overrides(layers: int, precision_aware: bool, experiment: str = EXPERIMENT) -> list[str]:
    """The planned experiment cut to ``layers`` decoder layers and one trainer GPU holding every expert."""
    return [f"experiment={experiment}", f"model.num_layers={layers}",
            "parallelism.trainer.num_gpus=1", "parallelism.trainer.tensor_parallel=1",
            "parallelism.trainer.pipeline_parallel=1", "parallelism.trainer.expert_parallel=1",
            "parallelism.trainer.context_parallel=1", "parallelism.trainer.expert_tensor_parallel=1",
            "parallelism.trainer.sequence_parallel=false",
            # the rollout side only has to fit the layout check; the probe starts no engine
            "parallelism.rollout.num_gpus=1", "parallelism.rollout.tensor_parallel=1",
            "parallelism.rollout.data_parallel=1", "parallelism.gpus_per_node=2", "parallelism.nnodes=1",
            f"trainer.precision_aware_optimizer={str(precision_aware).lower()}"]


def compose_slice(layers: int, precision_aware: bool, extra: list[str] = ()):
    import logging

    from r3rl.config import compose

    # the experiment's data set need not exist here: the probe reads no data (compose would warn about it)
    quiet = logging.getLogger("r3rl.eval.sets")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return compose(slice_overrides(layers, precision_aware) + list(extra))
    finally:
        quiet.setLevel(level)


@dataclass(frozen=True)
class PlanSide:
    """``r3rl.memory``'s trainer-rank terms for the slice (bytes) and the micro batch it plans for."""

    terms: dict[str, int]
    params_dtype: str
    tokens: int  # r3rl.memory.micro_batch_tokens
    batch: tuple[int, int]  # [samples, tokens each] of the micro batch the probe feeds

    @property
    def allocator_total(self) -> int:
        """What torch's allocator can see: every term but ``runtime``."""
        return sum(v for k, v in self.terms.items() if k != "runtime")


def plan_side(cfg) -> PlanSide:
    """Pure: the plan of ``cfg``'s trainer rank, as ``r3rl.memory.estimate`` counts it."""
    from r3rl import memory
    from r3rl.config.modes import resolve_dtype

    dtype = resolve_dtype(cfg.trainer.params_dtype, cfg.parallelism.device)
    parts, _ = memory.trainer_parts(cfg, dtype)
    tokens = memory.micro_batch_tokens(cfg)
    tr = cfg.trainer
    batch = (1, tokens) if tr.max_tokens_per_micro_batch is not None else \
        (tr.micro_batch_size, cfg.rollout.engine.max_model_len)
    return PlanSide({p.name: p.bytes for p in parts}, dtype, tokens, batch)


def have_transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def gib(b: float | None) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def describe(cfg, plan: PlanSide, precision_aware: bool) -> str:
    m, tr, t = cfg.model, cfg.trainer, cfg.parallelism.trainer
    offload = tr.optimizer_offload_fraction if tr.optimizer_cpu_offload else 0.0
    return (f"slice of {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
            f"({m.num_query_groups} KV groups), {m.num_experts} experts, top-{m.moe_topk}, expert width "
            f"{m.moe_ffn_hidden_size}, vocab {m.vocab_size}; TP {t.tensor_parallel}, EP {t.expert_parallel}; "
            f"micro batch {plan.batch[0]} x {plan.batch[1]} = {plan.tokens} tokens; {plan.params_dtype}; recompute "
            f"{tr.recompute_granularity}; optimizer offload {offload}, precision-aware "
            f"{'on' if precision_aware else 'off'}")


def plan_rows(plan: PlanSide) -> list[str]:
    t = plan.terms
    out = [f"{'term':<46}{'plan GiB':>10}"]
    for name in STATIC_TERMS + TRANSIENT_TERMS + ("runtime",):
        out.append(f"{name:<46}{gib(t.get(name, 0)):>10}")
    out.append(f"{'total seen by the allocator (all but runtime)':<46}{gib(plan.allocator_total):>10}")
    return out


@dataclass
class Measured:
    weights: int = 0
    gradients: int = 0
    optimizer_build: int = 0  # master weights + optimizer state allocated when the optimizer is built
    optimizer_first_step: int = 0  # what the first step leaves allocated (lazily created moments)
    kept_after_forward: int = 0
    forward_peak: int = 0  # above the resident bytes before the forward
    backward_peak: int = 0
    step_transient: int = 0  # optimizer step, above the resident bytes before it
    build_peak: int = 0
    step_peak: int = 0  # the training step's peak above the baseline: the figure the plan is compared with
    reserved_peak: int = 0  # torch's allocator: the most it held from the device during the step (cached blocks too)
    outside_allocator: int | None = None  # device memory in use outside torch's allocator (CUDA context, NCCL)
    loss: float = float("nan")
    grad_norm: float = float("nan")
    seconds: float = 0.0


def comparison_rows(plan: PlanSide, got: Measured) -> list[str]:
    t = plan.terms

    def row(name: str, planned: int | None, measured: int | None) -> str:
        r = f"{planned / measured:.2f}" if planned is not None and measured else "-"
        return f"{name:<46}{gib(planned):>10}{gib(measured):>14}{r:>15}"

    optimizer = got.optimizer_build + got.optimizer_first_step
    transient = max(got.forward_peak, got.backward_peak)
    return [
        f"{'term':<46}{'plan GiB':>10}{'measured GiB':>14}{'plan/measured':>15}",
        row("weights", t["weights"], got.weights),
        row("gradients (float32 main_grad)", t["gradients"], got.gradients),
        row("master weights + optimizer state on the GPU", t["master weights"] + t["optimizer state"], optimizer),
        row("activations + logits (peak of fwd/bwd)", t["activations"] + t["logits"], transient),
        row("  activations", t["activations"], None),
        row("  logits", t["logits"], None),
        row("  kept through the forward", None, got.kept_after_forward),
        row("  forward peak", None, got.forward_peak),
        row("  backward peak", None, got.backward_peak),
        row("optimizer step transient (no plan term)", None, got.step_transient),
        row("runtime (CUDA context, NCCL, fragmentation)", t["runtime"], None if got.outside_allocator is None
            else got.outside_allocator + max(got.reserved_peak - got.step_peak, 0)),
        row("total seen by the allocator (all but runtime)", plan.allocator_total, got.step_peak),
    ]


# ----------------------------------------------------------------------------------------------- measurement

class CudaMeter:
    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()

    def now(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.memory_allocated() - self.base

    def reset(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() - self.base

    def peak_reserved(self) -> int:
        return self.torch.cuda.max_memory_reserved() - self.base

    def outside_allocator(self) -> int:
        free, total = self.torch.cuda.mem_get_info()
        return total - free - self.torch.cuda.memory_reserved()


class NullMeter:
    """--cpu-smoke: the code path only."""

    def now(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def peak(self) -> int:
        return 0

    def peak_reserved(self) -> int:
        return 0

    def outside_allocator(self) -> None:
        return None


def run_step(cfg, meter, packed: bool = False) -> Measured:
    """Build the slice with r3rl's code and run one training step as ``MegatronTrainer`` does, metering each phase
    (``packed``: the micro batch's tokens as one THD row of one segment, as ``MegatronTrainer._packed_seq_params``
    describes a packed row)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads

    from r3rl.train import distributed, grpo, hardware, optim
    from r3rl.train import model as model_lib

    t = cfg.parallelism.trainer
    info = distributed.init(distributed.Layout(t.tensor_parallel, t.pipeline_parallel, t.expert_parallel,
                                               t.context_parallel, t.expert_tensor_parallel), seed=cfg.run.seed)
    got = Measured()
    start = time.perf_counter()
    try:
        device = info.device
        settings = model_lib.model_settings(cfg, replay=False)  # replay adds only the [T, k] routes
        meter.reset()
        before_build = meter.now()
        bare = model_lib.build_gpt(settings, device)
        got.weights = meter.now() - before_build
        kinds = {type(m).__name__ for m in bare.modules()}
        if not (kinds & {"LocalCoreAttention", "TEDotProductAttention"}):
            raise RuntimeError(f"the slice's core attention is neither r3rl's local one nor TE's: {sorted(kinds)}")
        model = model_lib.wrap_ddp(bare, settings)
        got.gradients = meter.now() - before_build - got.weights
        optimizer = optim.build_optimizer(cfg, model, settings.dtype, settings.use_distributed_optimizer)
        resident = meter.now()
        got.optimizer_build = resident - before_build - got.weights - got.gradients
        got.build_peak = meter.peak()

        plan = plan_side(cfg)
        samples, seq = plan.batch
        m, alg = cfg.model, cfg.algorithm
        gen = torch.Generator(device="cpu").manual_seed(0)
        if packed:  # one row holding every token, one segment per sample
            samples, seq = 1, samples * seq
        tokens = torch.randint(0, m.vocab_size, (samples, seq), generator=gen).to(device)
        labels = torch.randint(0, m.vocab_size, (samples, seq), generator=gen).to(device)
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(samples, seq)
        advantages = torch.linspace(-1, 1, samples * seq, device=device).view(samples, seq)
        loss_mask = torch.ones(samples, seq, device=device)
        mask, forward_kwargs = hardware.attention_mask(seq, device), {}
        if packed:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = torch.arange(0, seq + 1, plan.batch[1], dtype=torch.int32, device=device)
            position_ids = (torch.arange(seq, device=device) % plan.batch[1]).unsqueeze(0)
            mask, forward_kwargs = None, {"packed_seq_params": PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                max_seqlen_q=plan.batch[1], max_seqlen_kv=plan.batch[1])}

        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        resident = meter.now()
        meter.reset()
        output = model(tokens, position_ids, mask, **forward_kwargs)
        token_lp = -tensor_parallel.vocab_parallel_cross_entropy(output.float(), labels)
        del output
        terms = grpo.policy_loss(token_lp, token_lp.detach(), advantages, loss_mask,
                                 clip_low=alg.clip_eps_low, clip_high=alg.clip_eps_high)
        got.kept_after_forward = meter.now() - resident
        got.forward_peak = meter.peak() - resident
        meter.reset()
        terms.loss.backward()
        num_tokens = terms.tokens.to(device, torch.int)
        got.loss = float(terms.loss.detach()) / max(float(terms.tokens), 1.0)
        del terms, token_lp
        finalize_model_grads([model], num_tokens=num_tokens)
        got.backward_peak = meter.peak() - resident
        got.reserved_peak = meter.peak_reserved()
        fwd_bwd_peak = resident + max(got.forward_peak, got.backward_peak)

        before_step = meter.now()
        meter.reset()
        optimizer.set_lr(cfg.trainer.lr)
        ok, got.grad_norm = optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer skipped the step (non-finite gradients?)")
        got.step_transient = meter.peak() - before_step
        got.optimizer_first_step = meter.now() - before_step
        got.step_peak = max(fwd_bwd_peak, meter.peak())
        got.reserved_peak = max(got.reserved_peak, meter.peak_reserved())
        got.outside_allocator = meter.outside_allocator()
    finally:
        got.seconds = time.perf_counter() - start
        distributed.release()
    return got


# ----------------------------------------------------------------------------------------------- main

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2],
                   help="decoder layers of the slice (default 2); two or more counts also check the plan's per-layer "
                        "slope (kept inputs, expert weights and their gradients) against the measured one")
    p.add_argument("--plan-only", action="store_true", help="print the plan side only (no GPU needed)")
    p.add_argument("--packed", action="store_true",
                   help="feed the micro batch as one packed THD row (trainer.packing's path through the attention)")
    p.add_argument("--te", choices=("auto", "yes", "no"), default="auto",
                   help="--plan-only: plan as with TransformerEngine or without (auto: whether it is installed)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="development: a tiny slice through the same code on the CPU (no memory figures)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the slice")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    say = lambda *a: print("gpu_memory_probe:", *a, flush=True)  # noqa: E731

    if args.plan_only:
        te = have_transformer_engine_installed() if args.te == "auto" else args.te == "yes"
        cfg = compose_slice(args.layers[0], te, args.overrides)
        plan = plan_side(cfg)
        say(describe(cfg, plan, te))
        print("\n".join(plan_rows(plan)))
        print(f"memory plan: {gib(plan.allocator_total)} GiB seen by the allocator (+ {gib(plan.terms['runtime'])} "
              "GiB runtime); no measurement (--plan-only)")
        return 0

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        say("no CUDA GPU visible: nothing measured (--plan-only prints the plan side anywhere)")
        return NO_CUDA_EXIT

    warnings.simplefilter("ignore")  # Megatron's deprecation notices per layer, TE/Apex missing (named below)
    from r3rl.train import te_fallback

    te = te_fallback.have_transformer_engine()
    extra = (CPU_SMOKE_MODEL if args.cpu_smoke else []) + list(args.overrides)  # the command line wins
    shape = "one packed THD row" if args.packed else "padded micro batch"
    say(f"attention: {'TransformerEngine' if te else 'r3rl local spec, torch SDPA on CUDA'} ({shape})")
    if not args.cpu_smoke:
        say(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    points = []  # (layers, plan, measured)
    for layers in args.layers:
        cfg = compose_slice(layers, te, extra)
        plan = plan_side(cfg)
        say(describe(cfg, plan, te))
        if args.cpu_smoke:
            got = run_step(cfg, NullMeter(), packed=args.packed)
            say(f"cpu smoke: one step ran in {got.seconds:.1f}s, loss {got.loss:.4f}, grad norm {got.grad_norm:.4f}; "
                "no memory measured on a CPU")
            if not (math.isfinite(got.loss) and math.isfinite(got.grad_norm)):
                return 1
            continue
        got = run_step(cfg, CudaMeter(), packed=args.packed)
        torch.cuda.empty_cache()  # the next slice's reserved-memory figures start from nothing cached
        print("\n".join(comparison_rows(plan, got)))
        points.append((layers, plan, got))
    if args.cpu_smoke:
        return 0

    low, high = RATIO_RANGE
    layers, plan, got = points[0]
    ratio = plan.allocator_total / got.step_peak
    verdict = "within" if low <= ratio <= high else "OUTSIDE"
    say(f"{layers} layers: one step in {got.seconds:.1f}s (loss {got.loss:.4f}, grad norm {got.grad_norm:.3f}); "
        f"build peak {gib(got.build_peak)} GiB; plan/measured {ratio:.2f} {verdict} [{low}, {high}]")
    if len(points) > 1:
        (l0, p0, g0), (l1, p1, g1) = points[0], points[-1]
        planned = (p1.allocator_total - p0.allocator_total) / (l1 - l0)
        measured = (g1.step_peak - g0.step_peak) / (l1 - l0)
        slope = planned / measured if measured > 0 else float("inf")
        slope_ok = low <= slope <= high
        verdict = "within" if verdict == "within" and slope_ok else "OUTSIDE"
        say(f"per layer ({l0} -> {l1} layers): plan {gib(planned)} GiB, measured {gib(measured)} GiB, "
            f"plan/measured {slope:.2f} {'within' if slope_ok else 'OUTSIDE'} [{low}, {high}]")
        print(f"memory plan/measured per layer: {slope:.2f}", flush=True)
    print(f"memory plan/measured: {ratio:.2f}", flush=True)
    return 0 if verdict == "within" else OUTSIDE_EXIT


if __name__ == "__main__":
    sys.exit(main())
