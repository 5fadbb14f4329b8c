"""Which decoder layers of an HF checkpoint route tokens to experts, by each family's own config fields.

vLLM returns routes for every decoder layer (a dense layer's rows stay 0, which reads as expert 0) and never for the
MTP modules past ``num_hidden_layers``; Megatron builds one router per MoE layer. Both sides must agree on this list,
or every replayed layer after a dense one is off by one (verl #5037)."""

from __future__ import annotations

from typing import Any


def hf_moe_layers(hf_config: dict[str, Any]) -> list[int]:
    """The 0-based indices of the decoder layers with a routed MoE block: Qwen-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``, DeepSeek's and GLM's ``first_k_dense_replace`` and ``moe_layer_freq``. Layers past
    ``num_hidden_layers`` (MTP / next-token-prediction modules) are never counted."""
    n = int(hf_config["num_hidden_layers"])
    if "first_k_dense_replace" in hf_config or "n_routed_experts" in hf_config:
        first = int(hf_config.get("first_k_dense_replace") or 0)
        freq = int(hf_config.get("moe_layer_freq") or 1)
        return [i for i in range(n) if i >= first and i % freq == 0]
    if not int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0):
        return []
    dense = set(hf_config.get("mlp_only_layers") or [])
    step = int(hf_config.get("decoder_sparse_step") or 1)
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
