"""Model assets: the locally generated tiny Qwen3-MoE and checkpoint checks."""
