"""How a GRPO step gets its batch, one strategy per mode behind one interface (``Schedule``).

- ``InTurn`` (``algorithm.max_staleness=0``): the step generates its batch, trains on it, and the engines take the
  new weights before the next step generates.
- ``OneStepAhead`` (``max_staleness >= 1``): the engines are the producer and the trainer the consumer. A step takes
  the batch generated during the previous step, hands the engines the trainer's weights if their next batch would
  otherwise come out too old, starts that batch, and trains this one meanwhile.
- ``InFlight`` (``weight_update=in_flight``): as one step ahead, but the weights go to the engines under the batch
  still generating, and the next batch starts beside its slowest samples, before the step waits for them.
- ``CompletionOrder`` (``group_intake=completion``): the engines generate a stream of groups
  (``r3rl.rollout.group_stream``) and a step takes the first to complete, the weights going under the groups
  generating.

The recipe calls ``batch`` for the step's graded samples and ``after_train`` once the step trained; its weight sync
asks ``before_sync``/``after_sync``, its checkpoint ``data_state``, its eval points ``before_eval``. Grading stays in
the main thread (the reward's SIGALRM deadline), and with it any further DAPO round.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from r3rl import metrics as M
from r3rl.config.modes import group_buffer, group_draw_limit
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError
from r3rl.rollout.group_stream import Drawn, GroupFailed, GroupStream, requeued
from r3rl.sample import Sample, SampleStatus
from r3rl.train import staleness

if TYPE_CHECKING:
    from recipes.grpo import GRPORecipe

Timings = dict[str, float]
Batch = tuple[list[Sample], dict[str, float]]


class Schedule:
    """In turn; the base of the others. ``recipe`` generates, grades and syncs; the schedule says when."""

    def __init__(self, recipe: GRPORecipe):
        self.recipe = recipe

    def begin(self) -> None:
        """Before the run's first step (after the recipe's setup and its data stream)."""

    def batch(self, step: int, timings: Timings, prompts=None) -> Batch:
        """The step's graded samples and the rollout-side figures (``prompts``: the step's own, drawn by a caller
        that drives steps itself)."""
        recipe = self.recipe
        return recipe.rollout(step, prompts if prompts is not None else next(recipe.batches))

    def after_train(self, step: int, timings: Timings) -> None:
        """The engines serve the new policy from the next step on."""
        t = time.perf_counter()
        self.recipe.sync_weights(version=step)  # colocated: Adam's moments go to host memory before the engines wake
        timings["weight_sync"] = time.perf_counter() - t

    def before_sync(self, version: int, in_flight: bool) -> None:
        """Refuse a sync this schedule cannot take now."""

    def after_sync(self, version: int) -> None:
        """What the schedule starts from the new version on."""

    def data_state(self) -> dict:
        """The data sampler's state for a checkpoint."""
        return self.recipe.dataset.state_dict()

    def before_eval(self, step: int) -> None:
        """Make the engines serve the weights after ``step`` (in turn they already do)."""

    def close(self) -> None:
        """Let go of what generates beside the trainer."""


InTurn = Schedule


class OneStepAhead(Schedule):
    """The batch of ``step + 1`` generates while ``step`` trains (``producer``); weights go between batches."""

    in_flight = False

    def __init__(self, recipe: GRPORecipe):
        super().__init__(recipe)
        self.producer = ThreadPoolExecutor(max_workers=2 if self.in_flight else 1,
                                           thread_name_prefix="r3rl-rollout-ahead")
        # the batch generating: its step, its prompts, the future of its first generation round, and the data state
        # from before its prompts were drawn, which a checkpoint saves so that a resumed run generates it again
        # (nothing lost, nothing trained twice)
        self.ahead: tuple[int, list, Future, dict] | None = None

    def batch(self, step: int, timings: Timings, prompts=None) -> Batch:
        """The step's samples, generated while the trainer trained the previous step (now, on a run's first step and
        after a resume), with the samples older than the bound taken out of the loss; then the next batch starts,
        the engines taking the trainer's weights first if it would otherwise be trained more than ``max_staleness``
        versions after its weights."""
        if self.ahead is None:
            self.start(step)
        ahead_step, prompts, future, _ = self.ahead
        assert ahead_step == step, f"the batch ahead is step {ahead_step}'s, not step {step}'s"
        self.ahead = None
        if self.in_flight:  # the sync and the next batch do not wait for this batch's slowest samples
            self.sync_and_start_next(step, timings)
        generated, timings["generate"] = future.result()  # an engine that failed raises here, naming itself
        samples, stats = self.recipe.rollout(step, prompts, generated)  # graded; DAPO's further rounds now
        batch = within_staleness(step, samples, stats, self.recipe.max_staleness, timings)
        if not self.in_flight:
            self.sync_and_start_next(step, timings)
        return batch

    def sync_and_start_next(self, step: int, timings: Timings) -> None:
        recipe = self.recipe
        if step >= recipe.cfg.run.num_steps:
            return
        if staleness.must_sync(recipe.engine_version or 0, step - 1, recipe.max_staleness):
            t = time.perf_counter()
            recipe.sync_weights(version=step - 1, in_flight=self.in_flight)
            timings["weight_sync"] = time.perf_counter() - t
        self.start(step + 1)

    def start(self, step: int) -> None:
        recipe = self.recipe
        data_state = recipe.dataset.state_dict()  # before the batch's prompts are drawn
        prompts = next(recipe.batches)

        def generate() -> tuple[list[Sample], float]:
            t = time.perf_counter()
            return recipe.generate(step, prompts), time.perf_counter() - t

        self.ahead = (step, prompts, self.producer.submit(generate), data_state)

    def after_train(self, step: int, timings: Timings) -> None:
        """The weights went to the engines in ``batch``, before the next batch started."""

    def before_sync(self, version: int, in_flight: bool) -> None:
        """Between batches only: never while a batch generated ahead is in flight (``batch`` and ``before_eval`` wait
        for it first)."""
        if not in_flight and self.ahead is not None and not self.ahead[2].done():
            raise RuntimeError(f"weight sync to version {version} while the batch of step {self.ahead[0]} is still "
                               "generating: wait for it first")

    def data_state(self) -> dict:
        """From before the prompts of a batch generated ahead."""
        return self.ahead[3] if self.ahead is not None else super().data_state()

    def before_eval(self, step: int) -> None:
        """The engines still serve older weights: they finish their batch first (kept for the next step), then take
        the weights after ``step``."""
        if self.ahead is not None:
            wait_quietly(self.ahead[2])
        if (self.recipe.engine_version or 0) != step:
            self.recipe.sync_weights(version=step)

    def close(self) -> None:
        if self.ahead is not None:  # not in any checkpoint (the data state is from before it): let it go
            wait_quietly(self.ahead[2])
            self.ahead = None
        self.producer.shutdown(wait=True)


class InFlight(OneStepAhead):
    """One step ahead, with the weights going under the requests still generating."""

    in_flight = True


class CompletionOrder(Schedule):
    """A stream of groups, each taken as it completes; the weights go under the groups generating, every step."""

    def __init__(self, recipe: GRPORecipe):
        super().__init__(recipe)
        self.producer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="r3rl-rollout-ahead")
        self.stream: GroupStream | None = None
        self.client: RolloutClient | None = None

    def begin(self) -> None:
        """One prompt a draw, as groups complete; the groups a checkpoint left drawn and untrained come first."""
        recipe = self.recipe
        draws = recipe.dataset.batches(1)
        again, next_serial = requeued(recipe.resumed_data_state, recipe.dataset.__getitem__)
        self.stream = GroupStream(lambda: next(draws)[0], self.generate_group, capacity=group_buffer(recipe.cfg),
                                  requeue=again, next_serial=next_serial)

    def batch(self, step: int, timings: Timings, prompts=None) -> Batch:
        """The first ``rollout_batch_size`` groups to complete, graded, with the groups past the staleness bound taken
        out of the loss."""
        recipe, alg = self.recipe, self.recipe.cfg.algorithm
        if (recipe.engine_version or 0) != step - 1:
            t = time.perf_counter()
            recipe.sync_weights(version=step - 1, in_flight=True)
            timings["weight_sync"] = time.perf_counter() - t
        if not self.stream.started:
            self.client = RolloutClient.from_config(recipe.cfg, recipe.engines.urls, progress=False)
            self.client.serve_version(recipe.engine_version or 0, recipe.adapter)
            recipe.live_clients.append(self.client)
            self.stream.allow(group_draw_limit(recipe.cfg, recipe.engine_version or 0))
            self.stream.start(self.producer.submit)
        t = time.perf_counter()
        try:
            taken = self.stream.take(alg.rollout_batch_size)
        except GroupFailed as err:  # an engine that failed: the run ends naming it, as in batch intake
            raise EngineError(f"step {step}: {err}") from err
        timings["generate"] = time.perf_counter() - t
        recipe.preemption_windows.since_last(step)  # the stream generates on: no window is this step's alone
        pending = self.stream.pending()
        n = alg.n_samples_per_prompt
        # the step's own group numbers, in completion order: advantages are centred per group
        samples = [dataclasses.replace(s, group=g, index=g * n + j)
                   for g, (_, group) in enumerate(taken) for j, s in enumerate(group)]
        samples, stats = recipe.rollout(step, None, samples)
        stats[M.GROUPS_PENDING] = float(len(pending))
        stats[M.GROUPS_OVERTAKING] = float(sum(d.serial > pending[0] for d, _ in taken)) if pending else 0.0
        return within_staleness(step, samples, stats, recipe.max_staleness, timings)

    async def generate_group(self, drawn: Drawn) -> list[Sample]:
        """One group of the stream: ``n_samples_per_prompt`` samples of ``drawn.prompt``, seeded by its draw serial
        (a resumed run generates a pending group with the same seeds), on engine ``serial % engines``."""
        recipe, prompt = self.recipe, drawn.prompt
        samples = await self.client.generate(
            [list(map(int, prompt.prompt_ids))], recipe.cfg.algorithm.n_samples_per_prompt, recipe.cfg.rollout.sampling,
            step=drawn.serial, stop_token_ids=[recipe.tokenizer.eos_token_id], labels=[prompt.label],
            first_engine=drawn.serial)
        if aborted := [s.index for s in samples if s.status == SampleStatus.ABORTED]:
            raise EngineError(f"samples {aborted} of the group were aborted by the engine")
        return recipe.traced(samples)

    def after_train(self, step: int, timings: Timings) -> None:
        """The weights go to the engines at the next step's ``batch``, under the groups generating."""

    def after_sync(self, version: int) -> None:
        """Groups drawn from now on come out of the new version."""
        if self.stream is not None:  # built when the run's first step is near
            self.stream.allow(group_draw_limit(self.recipe.cfg, version))

    def data_state(self) -> dict:
        """After the stream's last draw, with the groups drawn and not yet trained."""
        return self.stream.state(self.recipe.dataset.state_dict)

    def before_eval(self, step: int) -> None:
        """The stream generates on: the weights after ``step`` go under its requests."""
        if (self.recipe.engine_version or 0) != step:
            self.recipe.sync_weights(version=step, in_flight=self.stream.started)

    def close(self) -> None:
        if self.stream is not None:  # its pending groups are in the checkpoint's data state
            self.stream.close()
        self.producer.shutdown(wait=True)


def schedule_for(recipe: GRPORecipe) -> Schedule:
    """The strategy of the run's ``algorithm`` settings (validated in ``r3rl.config``: completion needs in flight)."""
    alg = recipe.cfg.algorithm
    if alg.group_intake == "completion":
        return CompletionOrder(recipe)
    if alg.max_staleness == 0:
        return InTurn(recipe)
    return InFlight(recipe) if alg.weight_update == "in_flight" else OneStepAhead(recipe)


def within_staleness(step: int, samples: list[Sample], stats: dict[str, float], max_staleness: int,
                     timings: Timings) -> Batch:
    """The samples with the groups older than the bound taken out of the loss, and the staleness figures."""
    try:
        samples, stale = staleness.drop_stale(samples, step - 1, max_staleness)
    except staleness.StaleVersionError as err:  # ends the run like any engine fault: a clear line, exit 1
        raise EngineError(f"step {step}: {err}") from err
    timings.setdefault("weight_sync", 0.0)
    return samples, {**stats, **stale, **staleness.token_metrics(samples, step - 1)}


def wait_quietly(future: Future) -> None:
    """Wait for ``future`` without raising: its error is raised where its result is used."""
    try:
        future.exception()
    except Exception:  # noqa: BLE001  (cancelled)
        pass
