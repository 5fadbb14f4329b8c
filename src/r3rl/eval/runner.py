"""One eval point: every eval set generated on the engines with the weights they serve now, scored, summarised.

Eval requests go through their own ``RolloutClient`` with routing replay off: nothing here is trained on, so the
routes are neither decoded nor kept. With an ``env`` that runs episodes, eval runs them the same way (each sample
an episode, the answer of its last policy turn scored). The same request seeds are used at every point, so two
points differ by the weights only. ``stop()`` returning true (SIGTERM) abandons the point: its requests are cancelled and
``EvalInterrupted`` is raised, for the recipe to redo the point after resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from r3rl.env import build_environment, multi_turn
from r3rl.env.episodes import EpisodePrompt, EpisodeRunner, EpisodeSettings
from r3rl.eval.records import write_record
from r3rl.eval.scoring import overlaps_key, set_metrics
from r3rl.eval.sets import EvalSet
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError
from r3rl.sample import SampleStatus

EVAL_TIME = "perf/eval_time_s"
# every eval point sends the same request seeds (the client derives them from the step it is given)
_SEED_STEP = 0


class EvalInterrupted(Exception):
    """SIGTERM arrived during an eval point; it was abandoned and must be redone."""


class Evaluator:
    def __init__(self, sets: list[EvalSet], client: RolloutClient, tokenizer: Any, console: Console,
                 record_dir: Path | None = None, episodes: EpisodeRunner | None = None) -> None:
        self.sets = sets
        self.client = client
        self.episodes = episodes
        self.tokenizer = tokenizer
        self.console = console
        # per-prompt scores of every eval point (r3rl.eval.records): the same prompts at two points give a paired
        # standard error of the change (bench/learning_curve.py), tighter than the two points' errors combined
        self.record_dir = record_dir

    @classmethod
    def from_config(cls, cfg, sets: list[EvalSet], urls, tokenizer: Any, console: Console,
                    record_dir: Path | None = None) -> Evaluator:
        from r3rl.config.modes import engine_concurrency

        m, eng = cfg.model, cfg.rollout.engine
        client = RolloutClient(urls, num_layers=m.num_layers, topk=m.moe_topk, num_experts=m.num_experts,
                               routing_replay=False, max_concurrency=engine_concurrency(cfg),
                               request_timeout_s=eng.request_timeout_s, max_num_seqs=eng.max_num_seqs)
        episodes = None
        if multi_turn(cfg.env):
            episodes = EpisodeRunner(client, build_environment(cfg.env), tokenizer, EpisodeSettings.of(cfg),
                                     stop_token_ids=[tokenizer.eos_token_id])
        return cls(sets, client, tokenizer, console, record_dir, episodes)

    def evaluate(self, step: int, stop: Callable[[], bool]) -> dict[str, float]:
        """``eval/<set>/...`` for every set and ``perf/eval_time_s``, for the weights after ``step``."""
        started = time.perf_counter()
        values: dict[str, float] = {}
        for s in self.sets:
            samples = asyncio.run(self._generate(s, step, stop))
            if any(x.status == SampleStatus.ABORTED for x in samples):
                raise EngineError(f"eval {s.name} at step {step}: the engine aborted samples")
            served = sorted({x.weight_version or 0 for x in samples})
            if step > 0 and served != [step]:  # step 0: whatever an attached engine held, possibly labelled before
                raise EngineError(f"eval {s.name} at step {step}: the engines served weight version(s) {served}, "
                                  f"not step {step}'s: the eval would score another policy")
            texts = [self.tokenizer.decode(x.extra.get("answer_ids", x.response_ids), skip_special_tokens=True)
                     for x in samples]
            rewards = [s.score(t, x.label) for t, x in zip(texts, samples)]
            n, k = s.cfg.n_samples_per_prompt, s.k
            values.update(set_metrics(
                s.name, n, rewards=rewards,
                groups=[x.group for x in samples], lengths=[x.response_length for x in samples],
                truncated=[x.status == SampleStatus.TRUNCATED for x in samples], k=k,
                problems=dict(enumerate(s.problems)) if s.problems else None))
            # constant over a run, logged with every point so a run's eval figures say what they left out
            values[overlaps_key(s.name)] = float(s.overlaps_removed)
            if self.record_dir is not None:
                write_record(self.record_dir, s.name, step, rewards, [x.group for x in samples], s.problems)
            pass_k = f", pass@{k} {values[f'eval/{s.name}/pass@{k}']:.3f}" if k != n else ""
            self.console.print(f"eval {s.name} at step {step}: avg@{n} {values[f'eval/{s.name}/avg@{n}']:.3f}, "
                               f"pass@{n} {values[f'eval/{s.name}/pass@{n}']:.3f}{pass_k} ({len(s.prompts)} prompts "
                               f"x {n}; {s.overlaps_removed} training problems left out)")
        values[EVAL_TIME] = time.perf_counter() - started
        return values

    async def _generate(self, s: EvalSet, step: int, stop: Callable[[], bool]):
        label = f"eval {s.name} (weights of step {step})"
        if self.episodes is not None:
            task = asyncio.create_task(self.episodes.run(
                [EpisodePrompt(p.prompt_ids, p.text, p.label) for p in s.prompts], s.cfg.n_samples_per_prompt,
                s.cfg.sampling, step=_SEED_STEP, progress_label=label))
        else:
            task = asyncio.create_task(self.client.generate(
                [list(map(int, p.prompt_ids)) for p in s.prompts], s.cfg.n_samples_per_prompt, s.cfg.sampling,
                step=_SEED_STEP, stop_token_ids=[self.tokenizer.eos_token_id], labels=[p.label for p in s.prompts],
                progress_label=label))
        while not task.done():
            if stop():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise EvalInterrupted(s.name)
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
