"""The interface of a multi-turn environment: what a user writes to put tools in the loop.

An ``Environment`` is built once per run from ``env.environment`` (Hydra's ``instantiate``: its ``_target_`` class,
the node's other keys as keyword arguments). For every episode the episode loop calls ``start`` with the prompt's text and label,
then, after each policy turn, the episode's ``step`` with the text of that turn. ``step`` answers with a ``Turn``:

- ``observation``: text the policy sees next (a tool's output, an error); ``None`` ends the episode;
- ``done``: the episode is over (the policy answered);
- ``reward``: the episode's reward, read when it ends; ``None`` leaves grading to the run's ``reward`` config
  (``r3rl.data.reward``, applied to the text of the last policy turn);
- ``tool_call`` / ``tool_error``: counted into ``rollout/tool_calls_mean`` and ``rollout/tool_errors``.

``step`` runs in a worker thread under ``env.tool_timeout_s``: one that raises or does not answer in time gives the
policy an error observation and is counted as a tool error; the run goes on. The loop, not the environment, wraps an
observation in the chat turn markers (``env.observation_template``) and tokenises it once.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    observation: str | None
    done: bool = False
    reward: float | None = None
    tool_call: bool = False
    tool_error: bool = False


class Episode(abc.ABC):
    """The state of one episode."""

    @abc.abstractmethod
    def step(self, text: str) -> Turn:
        """The policy's turn ``text`` -> what the environment answers."""


class Environment(abc.ABC):
    """Makes episodes; one instance serves a whole run, from several threads at once (keep ``start`` free of shared
    mutable state, or lock it)."""

    @abc.abstractmethod
    def start(self, prompt: str, label: str | None) -> Episode:
        """A new episode of ``prompt`` (the text the engine is sent: the chat-templated prompt where the data set
        applies the template) whose reference answer is ``label``."""
