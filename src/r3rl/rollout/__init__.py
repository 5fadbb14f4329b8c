"""vLLM rollout with Rollout Routing Replay: engine processes, the generate client, routed-experts decoding and
validation, the CPU profile's sampling kernels, and rollout files (weight sync is ``r3rl.sync``).

Submodules are imported on use (``from r3rl.rollout.client import RolloutClient``): the vLLM worker process imports
``r3rl.cpu_only.vllm_mrv2_kernels`` and must not pay for (or depend on) the client side.
"""
