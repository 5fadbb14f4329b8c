"""``env=reflect``: after each answer the user asks the policy to check it and answer again, for ``turns`` turns.

Multi-turn self-correction (the shape of SCoRe-style training) on any prompt set with a reference answer: every
episode has exactly ``turns`` policy turns whatever the policy writes, and the run's ``reward`` grades the last one.
It needs no tool-use training, so the per-turn replay measurement (``bench/multiturn_r3.py``) runs on the default
task's warm-started model.
"""

from __future__ import annotations

from r3rl.env.base import Environment, Episode, Turn


class ReflectEpisode(Episode):
    def __init__(self, env: ReflectEnv):
        self.env = env
        self.turn = 0

    def step(self, text: str) -> Turn:
        self.turn += 1
        if self.turn >= self.env.turns:
            return Turn(observation=None, done=True)
        return Turn(observation=self.env.request)


class ReflectEnv(Environment):
    def __init__(self, turns: int = 2, request: str = "Check your answer and give it again in \\boxed{}."):
        if turns < 1:
            raise ValueError(f"turns={turns}: must be >= 1")
        self.turns = turns
        self.request = request

    def start(self, prompt: str, label: str | None) -> Episode:
        return ReflectEpisode(self)
