"""vLLM rollout with Rollout Routing Replay: engine processes, the generate client, routed-experts decoding and
validation, weight updates, and rollout files.

Submodules are imported on use (``from r3rl.rollout.client import RolloutClient``): the vLLM worker process imports
``r3rl.rollout.worker_extension`` and must not pay for (or depend on) the client side.
"""
