"""r3rl: GRPO recipes for Mixture-of-Experts LLMs with Rollout Routing Replay (vLLM rollout, Megatron-core training)."""

__version__ = "0.1.0"
