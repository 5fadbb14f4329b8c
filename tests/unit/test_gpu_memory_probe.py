"""The CPU-side parts of ``bench/gpu_memory_probe.py`` (issue 23 item 8): the slice it plans for, its plan side, its
refusal without CUDA (the fused core attention it runs without TransformerEngine is r3rl's own:
tests/unit/train/test_train_te_fallback.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).resolve().parents[2] / "bench" / "gpu_memory_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("gpu_memory_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def qwen3_moe_params(m, layers: int) -> int:
    """Parameters of a Qwen3-MoE with ``layers`` decoder layers, counted from the architecture (not r3rl.memory)."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    attention = m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 2 * m.head_dim  # q/k/v, o, q/k norms
    norms_router = 2 * m.hidden_size + m.num_experts * m.hidden_size
    experts = m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size  # gate, up, down
    embeddings = 2 * m.vocab_size * m.hidden_size + m.hidden_size  # untied input/output, final norm
    return layers * (attention + norms_router + experts) + embeddings


@pytest.mark.parametrize("precision_aware", [False, True])
def test_slice_is_the_planned_experiment_cut_to_two_layers_on_one_gpu(probe, compose_cfg, precision_aware):
    """Fails if the probe's slice stops being the planned Qwen3-30B-A3B run cut to 2 layers (another width, expert
    count, top-k or vocabulary than the experiment's model, experts split over more than the one GPU, other micro-batch
    tokens than the plan's) or if its plan side stops being ``r3rl.memory.trainer_parts`` of that slice (e.g. master
    weights counted on the GPU under the precision-aware optimizer, or ``runtime`` counted as allocator bytes)."""
    from r3rl import memory

    planned = compose_cfg(f"experiment={probe.EXPERIMENT}")
    cfg = probe.compose_slice(2, precision_aware)
    m = cfg.model
    for key in ("hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "num_experts", "moe_topk",
                "moe_ffn_hidden_size", "vocab_size"):
        assert getattr(m, key) == getattr(planned.model, key), key
    assert (m.num_layers, m.num_experts, m.moe_topk, m.hidden_size, m.vocab_size) == (2, 128, 8, 2048, 151936)
    t = cfg.parallelism.trainer
    assert (t.num_gpus, t.tensor_parallel, t.expert_parallel, t.pipeline_parallel) == (1, 1, 1, 1)
    assert cfg.trainer.recompute_granularity == planned.trainer.recompute_granularity == "full"
    assert cfg.trainer.optimizer_cpu_offload and cfg.trainer.optimizer_offload_fraction == 1.0

    plan = probe.plan_side(cfg)
    assert plan.params_dtype == "bfloat16"
    assert plan.tokens == memory.micro_batch_tokens(planned) == 9216
    assert plan.batch[0] * plan.batch[1] == plan.tokens
    n = qwen3_moe_params(m, 2)
    assert plan.terms["weights"] == 2 * n and plan.terms["gradients"] == 4 * n
    # offloaded optimizer: no Adam moments on the GPU; the float32 masters stay there unless precision-aware
    assert plan.terms["optimizer state"] == 0
    assert plan.terms["master weights"] == (0 if precision_aware else 4 * n)
    assert plan.terms["logits"] == plan.tokens * m.vocab_size * (2 + 4)  # bf16 logits + the float32 copy the loss works on in place
    assert plan.allocator_total == sum(plan.terms.values()) - plan.terms["runtime"]


def test_plan_only_runs_anywhere_and_the_measurement_refuses_without_cuda(probe, capsys):
    """Fails if ``--plan-only`` needs a GPU or stops printing the plan's terms, or if the probe without CUDA exits
    otherwise than with code 3 and a line saying no CUDA GPU is visible (gpu_check.sh reads both)."""
    assert probe.main(["--plan-only", "--te", "no"]) == 0
    out = capsys.readouterr().out
    assert "128 experts, top-8" in out and "9216 tokens" in out
    for term in ("weights", "gradients", "master weights", "activations", "logits", "runtime"):
        assert f"\n{term} " in out
    assert out.rstrip().splitlines()[-1].startswith("memory plan: ")
    # the table a GPU run prints renders from a measurement (one of each term, in GiB)
    plan = probe.plan_side(probe.compose_slice(2, False))
    got = probe.Measured(weights=3 << 30, gradients=7 << 30, optimizer_build=7 << 30, forward_peak=9 << 30,
                         backward_peak=8 << 30, step_peak=26 << 30, outside_allocator=1 << 30)
    rows = probe.comparison_rows(plan, got)
    assert rows[1].split()[-2:] == ["3.00", f"{plan.terms['weights'] / (3 << 30):.2f}"]
    assert rows[-1].split()[-3:] == [f"{plan.allocator_total / 2**30:.2f}", "26.00",
                                     f"{plan.allocator_total / (26 << 30):.2f}"]
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the refusal is not reachable")
    assert probe.main([]) == probe.NO_CUDA_EXIT == 3
    assert "no CUDA GPU" in capsys.readouterr().out
