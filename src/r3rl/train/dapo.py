"""DAPO's two rollout-side switches (Yu et al. 2025, "DAPO", sections 3.2 and 3.4), as pure functions of a batch.

- Dynamic sampling (``algorithm.dynamic_sampling``): a group whose samples are all right or all wrong has zero
  advantage under GRPO, so it adds tokens to the loss's denominator and nothing to its gradient. Such groups are
  dropped and more prompts are generated until the batch holds ``rollout_batch_size`` groups of mixed outcome.
  Groups are judged on the *raw* accuracy (the grader's correct/incorrect), never on the shaped reward: partial
  credit or an overlong penalty makes a group of equal outcomes look mixed (NVIDIA-NeMo/RL#2431).
- Overlong shaping (``algorithm.overlong_buffer``): a response in the last ``buffer`` tokens before
  ``max_tokens`` gets a penalty growing linearly from 0 to ``-penalty_factor`` at ``max_tokens``; one beyond it (it
  cannot be, vLLM stops there) would get ``-penalty_factor``. verl's ``reward_model.overlong_buffer`` computes the
  same: ``min(-(length - (max_tokens - buffer)) / buffer * penalty_factor, 0)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from r3rl import metrics as M
from r3rl.sample import Sample


def overlong_penalty(response_lengths: Sequence[int], max_tokens: int, buffer: int,
                     penalty_factor: float = 1.0) -> np.ndarray:
    """Per sample, DAPO's soft overlong punishment (0 with ``buffer`` 0)."""
    lengths = np.asarray(response_lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths)
    expected = max_tokens - buffer
    return np.minimum(-(lengths - expected) / buffer * penalty_factor, 0.0).clip(min=-penalty_factor)


def mixed_groups(correct: Sequence[float], groups: Sequence[int]) -> set[int]:
    """The groups whose raw outcomes differ (some right, some wrong): the ones dynamic sampling keeps."""
    c = np.asarray(correct, dtype=np.float64)
    g = np.asarray(groups)
    if c.shape != g.shape:
        raise ValueError(f"{c.size} outcomes for {g.size} group ids")
    return {int(group) for group in np.unique(g) if np.ptp(c[g == group]) > 0}


@dataclass
class FilledBatch:
    """The samples of a step after dynamic sampling, regrouped 0..G-1, and what it took."""

    samples: list[Sample]
    rounds: int  # generation rounds run
    filtered_groups: int  # groups dropped for all-equal raw accuracy
    padded_groups: int  # dropped groups put back because max_rounds ran out (zero advantage)

    @property
    def metrics(self) -> dict[str, float]:
        return {M.FILTERED_GROUPS: float(self.filtered_groups), M.GENERATION_ROUNDS: float(self.rounds),
                M.PADDED_GROUPS: float(self.padded_groups)}


def fill_with_mixed_groups(next_round: Callable[[int], list[Sample]], correct: Callable[[Sample], float],
                           groups_wanted: int, max_rounds: int) -> FilledBatch:
    """Run ``next_round(r)`` (r = 0, 1, ...: one batch of prompts each, ``n`` samples per group) until
    ``groups_wanted`` groups of mixed raw outcome (``correct``) are in, or ``max_rounds`` rounds ran; then pad with the
    most recently dropped groups. Kept groups keep their order of arrival; samples and groups are renumbered so the
    batch looks like one round's (``index`` in order, ``group`` 0..G-1)."""
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    rounds = 0
    while len(kept) < groups_wanted and rounds < max_rounds:
        samples = next_round(rounds)
        rounds += 1
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        mixed = mixed_groups([correct(s) for s in samples], [s.group for s in samples])
        for group, members in by_group.items():
            (kept if group in mixed else dropped).append(members)
    filtered = len(dropped)
    padded = max(groups_wanted - len(kept), 0)
    chosen = kept[:groups_wanted] + dropped[len(dropped) - padded:]
    out = []
    for g, members in enumerate(chosen):
        for s in members:
            out.append(dataclasses.replace(s, index=len(out), group=g))
    return FilledBatch(out, rounds, filtered, padded)
