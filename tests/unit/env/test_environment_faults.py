"""A user's environment that raises, hangs or answers nonsense costs its episode an error observation and a
counted tool error, never the run; a bad ``env`` config is refused before anything starts, naming the key."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from r3rl.env import build_environment
from r3rl.env.base import Environment, Episode, Turn
from r3rl.env.episodes import EpisodeRunner, EpisodeSettings


class Faulty(Environment):
    """A real environment that fails the way user tools do: ``mode`` raise | hang | wrong."""

    def __init__(self, mode: str):
        self.mode = mode
        self.release = threading.Event()

    def start(self, prompt, label):
        env = self

        class _Episode(Episode):
            def step(self, text):
                if env.mode == "raise":
                    raise KeyError("no such tool")
                if env.mode == "hang":
                    env.release.wait(30)
                    return Turn(observation="late")
                return "not a turn"

        return _Episode()


@pytest.mark.parametrize("mode, said", [("raise", "error: KeyError: 'no such tool'"),
                                        ("hang", "error: the tool did not answer within 0.3s"),
                                        ("wrong", "error: the environment answered str, not a Turn")])
def test_a_failing_tool_becomes_an_error_observation(mode, said):
    """Fails if a raising or hanging step propagated (the run would end) or waited past env.tool_timeout_s, or if
    the error were not counted as a tool error."""
    env = Faulty(mode)
    runner = EpisodeRunner(client=None, env=env, tokenizer=None,
                           settings=EpisodeSettings(max_turns=3, max_context_tokens=64, tool_timeout_s=0.3,
                                                    observation_template="{observation}"))
    tools = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    try:
        turn = asyncio.run(runner._step(env.start("p", None), "text", tools, index=3, turn=2))
    finally:
        env.release.set()
        tools.shutdown(wait=True)
    assert turn.observation == said and turn.tool_error and turn.tool_call and not turn.done


def test_env_configs_are_checked_before_launch(compose_cfg):
    """Fails if a multi-turn setting without an environment, a context budget beyond the engine's, or an
    environment that cannot be built, or a route store sized for an engine that returns no routes, got past the
    config check or the preflight."""
    with pytest.raises(ValueError, match="env.max_turns"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "env.max_turns=3")
    with pytest.raises(ValueError, match="env.max_context_tokens"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "env=calculator", "env.max_context_tokens=100000")
    with pytest.raises(ValueError, match="env.observation_template"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "env=calculator", "env.observation_template=plain")
    with pytest.raises(ValueError, match="env.environment: cannot build 'r3rl.env.calculator.NoSuchEnv'"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "env=calculator",
                    "env.environment._target_=r3rl.env.calculator.NoSuchEnv")
    with pytest.raises(ValueError, match="rollout.engine.route_store_bytes"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout=vllm", "rollout.engine.route_store_bytes=4096")
    ok = compose_cfg("model=tiny_moe", "parallelism=cpu", "env=calculator", "env.environment.max_digits=12")
    assert build_environment(ok.env).max_digits == 12
