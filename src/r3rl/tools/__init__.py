"""Small user commands: ``python -m r3rl.tools.check_engine``, ``python -m r3rl.tools.verify_rollout``."""
