"""The episode loop: multi-turn episodes over the rollout client, token ids in and out, one ``Sample`` each.

Each turn sends the whole context as token ids (the prompt, earlier turns, observations) and asks only for the route
rows the episode does not hold yet (``r3rl.env.stitch.route_start``). The environment's ``step`` runs in a worker
thread under ``env.tool_timeout_s``; a step that raises or hangs becomes an error observation and a counted tool
error. Observations are wrapped in ``env.observation_template`` and tokenised once. The episode ends when the
environment says so, after ``env.max_turns`` turns, or when the next observation would not leave a turn room in
``env.max_context_tokens`` (``context_truncated``). Each turn's ``max_tokens`` is the sampling budget cut to what the
context budget leaves.

Seeds: turn ``t`` of sample ``i`` is seeded ``sample_seed(seed, step, i) + t * 7919``, so an episode is reproducible
whatever order the turns of a batch finish in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from r3rl import metrics as M
from r3rl.config.schema import SamplingConfig
from r3rl.env.base import Environment, Turn
from r3rl.env.stitch import (EpisodeStats, Recomputed, TurnRecord, episode_sample, held_rows_from, recomputed_rows,
                             route_start)
from r3rl.rollout.client import RolloutClient, all_or_cancel, rollout_bar
from r3rl.rollout.errors import EngineError
from r3rl.rollout.routed_experts import RoutedExpertsError
from r3rl.rollout.wire import sample_seed
from r3rl.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 7919


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int
    max_context_tokens: int
    tool_timeout_s: float
    observation_template: str
    max_tokens_per_turn: int | None = None  # None: the sampling config's max_tokens
    route_prefix_omission: bool = True  # False: every turn asks for the whole context's routes
    route_overlap_rows: int = 0  # held rows each later turn asks for again, to measure recomputed rows

    @classmethod
    def of(cls, cfg) -> EpisodeSettings:
        """From a validated run config: its ``env`` keys, the context budget defaulting to the engine's."""
        env = cfg.env
        return cls(env.max_turns, env.max_context_tokens or cfg.rollout.engine.max_model_len, env.tool_timeout_s,
                   env.observation_template, env.max_tokens_per_turn, env.route_prefix_omission,
                   env.route_overlap_rows)


@dataclass(frozen=True)
class EpisodePrompt:
    prompt_ids: Sequence[int]
    text: str
    label: str | None


class EpisodeRunner:
    """Runs batches of episodes of ``env`` through ``client``; ``tokenizer`` decodes turns and encodes
    observations."""

    def __init__(self, client: RolloutClient, env: Environment, tokenizer, settings: EpisodeSettings, *,
                 stop_token_ids: Sequence[int] | None = None):
        self.client = client
        self.env = env
        self.tokenizer = tokenizer
        self.settings = settings
        self.stop_token_ids = list(stop_token_ids or [])

    async def run(self, prompts: Sequence[EpisodePrompt], n: int, sampling: SamplingConfig, *, step: int = 0,
                  progress_label: str | None = None) -> list[Sample]:
        """``n`` episodes per prompt: episode ``i = prompt * n + j`` has ``group = prompt``."""
        sessions = self.client.sessions()
        # one request in flight per episode: at most max_concurrency episodes at a time per engine
        gates = {u: asyncio.Semaphore(self.client.max_concurrency) for u in self.client.urls}
        # tool steps get their own threads: a step that hangs keeps its thread, and must not starve the others
        tools = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, self.client.max_concurrency),
                                                      thread_name_prefix="r3rl-env")
        bar = rollout_bar(len(prompts) * n, step, enabled=self.client.progress, desc=progress_label)
        try:
            async def one(i: int) -> Sample:
                group = i // n
                url = self.client.urls[group % len(self.client.urls)]
                async with gates[url]:
                    out = await self.episode(sessions, url, prompts[group], sampling, step=step, index=i,
                                             group=group, tools=tools)
                bar.update(1)
                return out

            return await all_or_cancel(one(i) for i in range(len(prompts) * n))
        finally:
            bar.close()
            tools.shutdown(wait=False, cancel_futures=True)
            await asyncio.gather(*(s.close() for s in sessions.values()), return_exceptions=True)

    async def episode(self, sessions, url: str, prompt: EpisodePrompt, sampling: SamplingConfig, *, step: int,
                      index: int, group: int, tools: concurrent.futures.Executor) -> Sample:
        cfg = self.settings
        context = [int(t) for t in prompt.prompt_ids]
        episode = self.env.start(prompt.text, prompt.label)
        turns: list[TurnRecord] = []
        held = 0
        calls = errors = observed = 0
        truncated = False
        reward = None
        rows_full = received = 0
        recomputed = Recomputed()  # None once a turn's prefix-cache hits are unknown
        masked = ""
        for t in range(1, cfg.max_turns + 1):
            budget = min(cfg.max_tokens_per_turn or sampling.max_tokens, cfg.max_context_tokens - len(context))
            start = route_start(held, cfg.route_overlap_rows) if cfg.route_prefix_omission else 0
            seed = sample_seed(sampling.seed, step, index) + t * _TURN_SEED_STRIDE
            sample, failure = None, ""
            for attempt in range(2):  # a turn the engine aborted, or sent without all its routes, goes once more
                rid = self.client.request_id(f"s{step}-{index}-t{t}-a{attempt}")
                try:
                    sample = await self.client.turn(
                        sessions, url, context, sampling, seed=seed, index=index, group=group, request_id=rid,
                        max_tokens=budget, routes_from=start, stop_token_ids=self.stop_token_ids)
                except RoutedExpertsError as err:
                    sample, failure = None, str(err)
                    continue
                if sample.status is not SampleStatus.ABORTED:
                    break
                sample, failure = None, f"request {rid} aborted by the engine"
            if sample is None:
                # never trained on guessed routes: the episode stops at its last complete turn, masked whole
                if not turns:
                    raise EngineError(f"engine {url}: sample {index}, turn 1 failed twice ({failure}); an episode "
                                      "needs at least one complete turn", url=url)
                masked = failure
                # the observation its last complete turn kept was never answered: the episode ends before it
                observed -= len(turns[-1].observation_ids)
                turns[-1].observation_ids = np.zeros(0, np.int32)
                break
            if sample.routed_experts is not None:
                received += len(sample.routed_experts)
                if held and recomputed is not None:
                    cached = sample.extra.get("cached_tokens")
                    recomputed = None if cached is None else recomputed + recomputed_rows(
                        held_rows_from(turns, start), sample.routed_experts, start=start, cached_tokens=cached)
                # rows asked for again (no prefix omission): the held ones stay as their turn returned them
                sample.routed_experts = sample.routed_experts[held - start:]
            record = TurnRecord(context_len=len(context), routes_from=held, sample=sample)
            turns.append(record)
            rows_full += len(context) + sample.response_length - 1
            held = len(context) + sample.response_length - 1
            context += [int(x) for x in sample.response_ids]
            text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            answer = await self._step(episode, text, tools, index=index, turn=t)
            calls += answer.tool_call
            errors += answer.tool_error
            reward = answer.reward
            if answer.done or answer.observation is None or t == cfg.max_turns:
                break
            obs = self.tokenizer.encode(cfg.observation_template.format(observation=answer.observation),
                                        add_special_tokens=False)
            if len(context) + len(obs) >= cfg.max_context_tokens:  # no room left for another turn
                truncated = True
                break
            record.observation_ids = np.asarray(obs, dtype=np.int32)
            context += obs
            observed += len(obs)
        stats = EpisodeStats(turns=len(turns), tool_calls=calls, tool_errors=errors, observation_tokens=observed,
                             context_truncated=truncated, route_rows_received=received, route_rows_full=rows_full,
                             recomputed=recomputed if received else None, masked=masked)
        return episode_sample(turns, index=index, group=group, label=prompt.label, reward=reward, stats=stats)

    async def _step(self, episode, text: str, tools, *, index: int, turn: int) -> Turn:
        """The environment's answer to a turn; raising or running past ``env.tool_timeout_s`` is a tool error with
        an error observation (the episode goes on, the run is never stopped by a tool)."""
        loop = asyncio.get_running_loop()
        try:
            answer = await asyncio.wait_for(loop.run_in_executor(tools, episode.step, text),
                                            timeout=self.settings.tool_timeout_s)
        except asyncio.TimeoutError:
            log.warning("sample %d, turn %d: the environment did not answer within env.tool_timeout_s=%gs",
                        index, turn, self.settings.tool_timeout_s)
            return Turn(observation=f"error: the tool did not answer within {self.settings.tool_timeout_s:g}s",
                        tool_call=True, tool_error=True)
        except Exception as err:  # noqa: BLE001  (a user's environment: any error is the episode's, not the run's)
            log.warning("sample %d, turn %d: the environment raised %s: %s", index, turn, type(err).__name__, err)
            return Turn(observation=f"error: {type(err).__name__}: {err}", tool_call=True, tool_error=True)
        if not isinstance(answer, Turn):
            return Turn(observation=f"error: the environment answered {type(answer).__name__}, not a Turn",
                        tool_call=True, tool_error=True)
        return answer


def mask_failed_episodes(samples: list[Sample], route_row_bytes: int = 0) -> tuple[list[Sample], dict[str, float]]:
    """Episodes with a turn that failed twice (aborted, or tokens without all their routes: ``r3rl.env.episodes``)
    train on nothing, and neither does the rest of their group (its advantages would be centred on a mean that
    counts them), as ``staleness.drop_stale`` takes groups out; the episodes' counters for the step."""
    failed = {s.group for s in samples if s.extra["episode"].masked}
    kept = [dataclasses.replace(s, loss_mask=np.zeros_like(s.loss_mask)) if s.group in failed else s for s in samples]
    return kept, {**M.episode_metrics([s.extra["episode"] for s in samples], route_row_bytes),
                  M.EPISODES_MASKED: float(sum(s.group in failed for s in samples))}
