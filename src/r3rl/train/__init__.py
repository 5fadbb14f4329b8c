"""The Megatron-core trainer: Qwen3-MoE model, HF weight conversion, routing replay, log-probs, GRPO steps.

Importing this package is cheap; Megatron is imported by the modules that need it.
"""
