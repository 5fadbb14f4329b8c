"""GRPO for MoE models with Rollout Routing Replay: the recipe ``python run.py`` launches.

Each step reads top to bottom: generate -> log-probs (with and without replay) -> mismatch metrics -> train ->
sync weights -> log -> save. With ``algorithm.max_staleness >= 1`` the engines are the producer and the trainer the
consumer: a step takes the batch the engines generated during the previous step, hands the engines the trainer's
weights if their next batch would otherwise come out too old, starts that batch, and trains this one meanwhile.
With ``algorithm.weight_update=in_flight`` the weights go to the engines under the batch still generating, and the
next batch starts beside its slowest samples, before the step waits for them; with ``algorithm.group_intake=completion``
too, the engines generate a stream of groups and a step takes the first to complete (``r3rl.rollout.group_stream``).
The driver process is the controller and holds no GPU; trainer ranks and vLLM engines are Ray actors placed by
``r3rl.placement``. What the SFT recipe shares with this one (start and stop of the
actors, weight sync, eval points, checkpoints, SIGTERM, the end-of-run report) is in ``recipes/common.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from r3rl import metrics as M
from r3rl import route_trace
from r3rl.config.modes import (group_buffer, group_draw_limit, pi_old_from_training_forward, replay_mode,
                               unreplayed_pass_due)
from r3rl.config.schema import R3RLConfig
from r3rl.data.arithmetic import ensure_prompts
from r3rl.data.dataset import PromptDataset
from r3rl.data.reward import grade
from r3rl.env import build_environment, multi_turn
from r3rl.env.episodes import EpisodePrompt, EpisodeRunner, EpisodeSettings
from r3rl.env.stitch import shift_turn_rows
from r3rl.rollout import engine_metrics
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError, route_store_failure
from r3rl.rollout.group_stream import Drawn, GroupFailed, GroupStream, requeued
from r3rl.rollout.store import save_rollout
from r3rl.sample import Sample, SampleStatus
from r3rl.train import correction, dapo, staleness
from r3rl.train.grpo import group_advantages
from recipes import common
from recipes.common import StopRequested, console

__all__ = ["GRPORecipe", "StopRequested", "run_recipe"]


class GRPORecipe(common.Recipe):
    def __init__(self, cfg: R3RLConfig):
        super().__init__(cfg)
        self.replay_mode = replay_mode(cfg)
        self.r3 = self.replay_mode == "r3"
        self.correction = correction.Correction.of(cfg.correction)
        self.pi_old_in_forward = pi_old_from_training_forward(cfg)
        self.max_staleness = cfg.algorithm.max_staleness
        self.in_flight = cfg.algorithm.weight_update == "in_flight"
        # in flight, every batch (and DAPO round) has a client of its own: two batches generate at once, from two
        # threads, and each client's state belongs to one event loop; a sync in flight reaches all of them
        self.live_clients: list[RolloutClient] = []
        # max_staleness >= 1: the batch the engines generate while the trainer trains (its step, its prompts, the
        # future of its first generation round, and the data state from before its prompts were drawn, which a
        # checkpoint saves so that a resumed run generates it again: nothing lost, nothing trained twice). Grading
        # stays in the main thread (the reward's SIGALRM deadline), and with it any further DAPO round
        self.producer = ThreadPoolExecutor(max_workers=2 if self.in_flight else 1,
                                           thread_name_prefix="r3rl-rollout-ahead") if self.max_staleness else None
        self.ahead: tuple[int, list, Future, dict] | None = None
        # group_intake=completion: the stream of groups (built in train, started at the first step), its client,
        # and the groups a checkpoint left drawn and untrained (generated first)
        self.completion = cfg.algorithm.group_intake == "completion"
        self.stream: GroupStream | None = None
        self.stream_client: RolloutClient | None = None
        self.resumed_data_state: dict = {}
        # env with episodes (r3rl.env): the environment, built in setup, and its episode loop over the client
        self.environment = None
        self.episodes: EpisodeRunner | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """The prompts, then Ray, the trainer ranks, the engines, the rollout client, the weight sync and W&B
        (``common.Recipe.start``); a resumed run continues from its checkpoint."""
        resume_from, meta = self.prepare()
        # group_intake=completion: its pending groups (batch intake refuses such a checkpoint: preflight)
        self.resumed_data_state = meta.data_state if meta is not None else {}
        ensure_prompts(self.cfg.data)
        self.dataset = PromptDataset(self.cfg.data, self.tokenizer)
        # built before any process starts: an environment that cannot be built ends the run here
        self.environment = build_environment(self.cfg.env) if multi_turn(self.cfg.env) else None
        self.start(resume_from, meta)

    def engines_started(self) -> None:
        self.client = RolloutClient.from_config(self.cfg, self.engines.urls)
        # what an attached engine counted before this run is not this run's
        self.preemptions_seen = engine_metrics.read_counter(self.engines.urls, engine_metrics.PREEMPTIONS)
        if self.environment is not None:
            self.episodes = EpisodeRunner(self.client, self.environment, self.tokenizer, EpisodeSettings.of(self.cfg),
                                          stop_token_ids=[self.tokenizer.eos_token_id])
        if self.plan.attach_url:
            # launched engines were checked at start; an attached one is checked against this config here
            self.client.check_engines_sync()

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        # one stream of prompt batches: dynamic sampling draws its extra rounds from it, so a checkpoint's data state
        # counts every prompt a step used
        self.batches = batches = self.dataset.batches(cfg.algorithm.rollout_batch_size)
        if self.completion:  # one prompt a draw, as groups complete; a checkpoint's pending groups first
            draws = self.dataset.batches(1)
            again, next_serial = requeued(self.resumed_data_state, self.dataset.__getitem__)
            self.stream = GroupStream(lambda: next(draws)[0], self.generate_group, capacity=group_buffer(cfg),
                                      requeue=again, next_serial=next_serial)
        self.eval_before_training()
        with Progress(TextColumn("[bold]GRPO step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("steps", total=cfg.run.num_steps, completed=self.start_step - 1)
            for step in range(self.start_step, cfg.run.num_steps + 1):
                if self.stop:  # arrived during setup: nothing new to save
                    raise StopRequested(step - 1)
                try:
                    # ahead of the trainer, the engines draw their prompts themselves (``collect``)
                    self.train_step(step, None if self.producer else next(batches))
                except Exception as err:
                    # an engine whose node went down surfaces as whatever call reached it first: name the engine
                    if dead := self.engines.dead():
                        first = (str(err).splitlines() or [""])[0]
                        raise EngineError(f"step {step}: engine(s) {', '.join(dead)} went down "
                                          f"({type(err).__name__}: {first}); this step was not saved") from err
                    if isinstance(err, EngineError) and (store := route_store_failure(self.run_dir / "logs")):
                        raise EngineError(f"step {step}: {store}; this step was not saved") from err
                    raise
                bar.advance(task)
                if step % cfg.run.save_every == 0 or step == cfg.run.num_steps or self.stop:
                    self.save(step)
                else:
                    self.poll_save()
                if self.stop:
                    raise StopRequested(step)

    def train_step(self, step: int, prompts=None) -> None:
        cfg, alg = self.cfg, self.cfg.algorithm
        timings: dict[str, float] = {}
        started = time.perf_counter()
        if dead := self.engines.dead():
            raise EngineError(f"engine(s) {', '.join(dead)} died before step {step}; see {self.run_dir / 'logs'}")

        # 1. generate and grade (DAPO: groups of equal outcome dropped and refilled, overlong responses penalised);
        # ahead of the trainer (max_staleness >= 1): the batch generated meanwhile, the next one started
        t = time.perf_counter()
        samples, rollout_stats = self.rollout(step, prompts) if self.producer is None else self.collect(step, timings)
        rewards = [s.reward for s in samples]
        timings["rollout"] = time.perf_counter() - t - timings.get("weight_sync", 0.0)
        if cfg.debug.wrong_stitching and self.episodes is not None:  # the bench's deliberate fault
            samples = [dataclasses.replace(s, routed_experts=shift_turn_rows(
                s.routed_experts, s.extra["turn_of_token"], len(s.prompt_ids))) for s in samples]
        if cfg.debug.save_rollout:
            save_rollout(samples, Path(cfg.debug.save_rollout) / f"step_{step:06d}.npz")
        batch = ray.put(samples)
        self.handoffs.clear()  # the step's own
        if self.colocated:  # the GPUs go to the trainer: engines sleep, the optimizer state comes back
            self.engine_set.sleep(cfg.rollout.weight_sync.sleep_level)
            self.engines_asleep = True
            self.trainers.call("onload_optimizer_state")

        # 2. log-probs (pi_old). R3: with the rollout's routes replayed and (every replay.no_replay_every steps), on
        # the same batch, without. R2: live routing, recording the routes the trainer chose, which its training
        # forwards then replay. none: live routing. Where the training forward gives pi_old itself, bit for bit
        # (r3rl.config.modes.pi_old_from_training_forward), it comes from there: one forward less a step.
        t = time.perf_counter()
        paired = unreplayed_pass_due(cfg, step)
        pi_old_in_forward = self.pi_old_in_forward and len(samples) == alg.global_batch_size
        replayed = None if pi_old_in_forward else \
            self.trainers.call("logprobs", batch, replay=self.r3, record=self.replay_mode == "r2")
        unreplayed = self.trainers.call("logprobs", batch, replay=False) if paired else None
        timings["logprobs"] = time.perf_counter() - t
        if cfg.debug.route_trace:
            self.write_trace(step, samples, replayed)
        train_batch = batch
        if self.replay_mode == "r2":  # the samples keep the engine's routes (if any); training sees the trainer's
            train_batch = ray.put([dataclasses.replace(s, routed_experts=r)
                                   for s, r in zip(samples, replayed.recorded_routes)])

        # 3. train, on pi_old, with the rollout correction of pi_old / pi_rollout per token
        advantages = group_advantages(np.asarray(rewards, dtype=np.float64), np.asarray([s.group for s in samples]),
                                      alg.normalize_advantage_std)
        per_token = [np.full(s.response_length, a, dtype=np.float32) for s, a in zip(samples, advantages)]
        rollout_lps, masks = [s.rollout_logprobs for s in samples], [s.loss_mask for s in samples]
        t = time.perf_counter()
        if pi_old_in_forward:  # the correction changes nothing in the loss: its figures come after the update
            replayed, train_out = self.trainers.call("train_on_policy", train_batch, per_token, replay=self.r3)
            corrected = correction.correct(self.correction, replayed.logprobs, rollout_lps, masks)
        else:
            corrected = correction.correct(self.correction, replayed.logprobs, rollout_lps, masks)
            apply = self.correction.changes_training
            train_out = self.trainers.call("train_step", train_batch, per_token, replay=self.replay_mode != "none",
                                           old_logprobs=replayed.logprobs,
                                           is_weights=corrected.weights if apply else None,
                                           loss_masks=corrected.loss_masks if apply else None)
        timings["train"] = time.perf_counter() - t

        # 4. sync weights: the engines serve the new policy from the next step on (ahead of the trainer: from the
        # batch after the one they are generating, in the next step's ``collect``)
        if self.producer is None:
            t = time.perf_counter()
            self.sync_weights(version=step)  # colocated: Adam's moments go to host memory before the engines wake
            timings["weight_sync"] = time.perf_counter() - t

        # 5. metrics: mismatch with and without replay on identical data, routing flips, correction, rewards, perf
        # (routing flips need the engine's routes: from the unreplayed pass, the only one under R2 and none)
        live = unreplayed if self.r3 else (replayed if samples[0].routed_experts is not None else None)
        values = M.step_metrics(
            rollout_logprobs=rollout_lps,
            trainer_logprobs=replayed.logprobs,
            trainer_logprobs_no_replay=unreplayed.logprobs if unreplayed is not None else None,
            loss_masks=masks,
            rewards=rewards,
            response_lengths=[s.response_length for s in samples],
            prompt_lengths=[len(s.prompt_ids) for s in samples],
            routing_flip_per_layer=live.flip_per_layer if live is not None else None,
            routing_flip_per_layer_prompt=live.flip_per_layer_prompt if live is not None else None,
            router_per_layer=(live.margin_per_layer, live.small_margin_per_layer, live.load_max_vio_per_layer)
            if live is not None and live.margin_per_layer is not None else None,
            sample_groups=[s.group for s in samples],
            replay_mismatch_rows=replay_mismatch_rows(replayed) if self.r3 else None,
            loss=train_out.get("loss"),
            grad_norm=train_out.get("grad_norm"),
            timings_s=timings,
            step_time_s=time.perf_counter() - started,
        )
        if self.r3 and unreplayed is None:  # the paired pass skipped this step: its figures are not logged
            for key in (M.LOGPROB_ABS_DIFF_NO_REPLAY, M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR):
                values.pop(key)
        if not self.r3:  # one pass, no pairing: replayed and unreplayed are the same figures
            for key in (M.LOGPROB_ABS_DIFF_PAIRED_DELTA, M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR):
                values.pop(key, None)
        values.update(corrected.metrics)
        values.update(rollout_stats)
        if self.episodes is not None:  # the mismatch of each turn's tokens, with and without replay, same batch
            turns = [s.extra["turn_of_token"] for s in samples]
            values.update(M.per_turn_mismatch(replayed.logprobs, rollout_lps, masks, turns))
            if unreplayed is not None:
                values.update(M.per_turn_mismatch(unreplayed.logprobs, rollout_lps, masks, turns,
                                                  M.LOGPROB_ABS_DIFF_NO_REPLAY_TURN))
        if self.producer is not None:  # the engine mismatch alone, on the samples the trainer's weights generated
            fresh = [i for i, s in enumerate(samples) if (s.weight_version or 0) == step - 1]
            if fresh:
                values[M.LOGPROB_ABS_DIFF_FRESH] = M.logprob_abs_diff(
                    [replayed.logprobs[i] for i in fresh], [samples[i].rollout_logprobs for i in fresh],
                    [samples[i].loss_mask for i in fresh])
            values.update(version_token_mismatch(samples, step - 1, replayed, unreplayed))
        values.update(self.preemptions(samples))
        values.update({f"train/{k}": float(v) for k, v in train_out.items()
                       if k not in ("loss", "grad_norm", "step") and isinstance(v, (int, float))})
        if self.colocated:  # what the trainer still held on its GPUs when the engines woke (0 on a CPU)
            values[M.PERF_TRAINER_RESERVED_AT_WAKE] = max(b for e, b in self.handoffs if e == "yield") / 2**30
        if self.replay_mode == "r2":
            values[M.R2_REPLAY_MISMATCH_ROWS] = float(train_out["replay_mismatch_rows"])
            values[M.R2_REPLAYED_ROWS] = float(train_out["replayed_rows"])
        self.log_with_eval(step, values)

    def collect(self, step: int, timings: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """``max_staleness >= 1``: the step's samples, generated while the trainer trained the previous step (now,
        on a run's first step and after a resume), with the samples older than the bound taken out of the loss.
        Then the engines take the trainer's weights if the batch they start next would otherwise be trained more
        than ``max_staleness`` versions after its weights, and start it: it is generated while this step trains."""
        if self.stream is not None:
            return self.take_completed(step, timings)
        if self.ahead is None:
            self.start_ahead(step)
        ahead_step, prompts, future, _ = self.ahead
        assert ahead_step == step, f"the batch ahead is step {ahead_step}'s, not step {step}'s"
        self.ahead = None
        if self.in_flight:  # the sync and the next batch do not wait for this batch's slowest samples
            self.sync_and_start_next(step, timings, in_flight=True)
        generated, timings["generate"] = future.result()  # an engine that failed raises here, naming itself
        samples, stats = self.rollout(step, prompts, generated)  # graded; DAPO's further rounds generated now
        try:
            samples, stale = staleness.drop_stale(samples, step - 1, self.max_staleness)
        except staleness.StaleVersionError as err:  # ends the run like any engine fault: a clear line, exit 1
            raise EngineError(f"step {step}: {err}") from err
        if not self.in_flight:
            self.sync_and_start_next(step, timings, in_flight=False)
        timings.setdefault("weight_sync", 0.0)
        return samples, {**stats, **stale, **staleness.token_metrics(samples, step - 1)}

    def take_completed(self, step: int, timings: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """``group_intake=completion``: the engines take the trainer's weights under the groups generating (every
        step), and the step takes the first ``rollout_batch_size`` groups to complete, graded, with the groups past
        the staleness bound taken out of the loss."""
        alg = self.cfg.algorithm
        if (self.engine_version or 0) != step - 1:
            t = time.perf_counter()
            self.sync_weights(version=step - 1, in_flight=True)
            timings["weight_sync"] = time.perf_counter() - t
        if not self.stream.started:
            self.stream_client = RolloutClient.from_config(self.cfg, self.engines.urls, progress=False)
            self.stream_client.serve_version(self.engine_version or 0)
            self.live_clients.append(self.stream_client)
            self.stream.allow(group_draw_limit(self.cfg, self.engine_version or 0))
            self.stream.start(self.producer.submit)
        t = time.perf_counter()
        try:
            taken = self.stream.take(alg.rollout_batch_size)
        except GroupFailed as err:  # an engine that failed: the run ends naming it, as in batch intake
            raise EngineError(f"step {step}: {err}") from err
        timings["generate"] = time.perf_counter() - t
        pending = self.stream.pending()
        n = alg.n_samples_per_prompt
        # the step's own group numbers, in completion order: advantages are centred per group
        samples = [dataclasses.replace(s, group=g, index=g * n + j)
                   for g, (_, group) in enumerate(taken) for j, s in enumerate(group)]
        samples, stats = self.rollout(step, None, samples)
        try:
            samples, stale = staleness.drop_stale(samples, step - 1, self.max_staleness)
        except staleness.StaleVersionError as err:
            raise EngineError(f"step {step}: {err}") from err
        stats[M.GROUPS_PENDING] = float(len(pending))
        stats[M.GROUPS_OVERTAKING] = float(sum(d.serial > pending[0] for d, _ in taken)) if pending else 0.0
        timings.setdefault("weight_sync", 0.0)
        return samples, {**stats, **stale, **staleness.token_metrics(samples, step - 1)}

    async def generate_group(self, drawn: Drawn) -> list[Sample]:
        """One group of the stream: ``n_samples_per_prompt`` samples of ``drawn.prompt``, seeded by its draw serial
        (a resumed run generates a pending group with the same seeds), on engine ``serial % engines``."""
        cfg, prompt = self.cfg, drawn.prompt
        samples = await self.stream_client.generate(
            [list(map(int, prompt.prompt_ids))], cfg.algorithm.n_samples_per_prompt, cfg.rollout.sampling,
            step=drawn.serial, stop_token_ids=[self.tokenizer.eos_token_id], labels=[prompt.label],
            first_engine=drawn.serial)
        if aborted := [s.index for s in samples if s.status == SampleStatus.ABORTED]:
            raise EngineError(f"samples {aborted} of the group were aborted by the engine")
        return self.traced(samples)

    def sync_and_start_next(self, step: int, timings: dict[str, float], *, in_flight: bool) -> None:
        """Before the batch of ``step + 1`` starts: the trainer's weights, if that batch would otherwise be trained
        more than ``max_staleness`` versions after its weights (``in_flight``: under the requests still
        generating)."""
        if step >= self.cfg.run.num_steps:
            return
        if staleness.must_sync(self.engine_version or 0, step - 1, self.max_staleness):
            t = time.perf_counter()
            self.sync_weights(version=step - 1, in_flight=in_flight)
            timings["weight_sync"] = time.perf_counter() - t
        self.start_ahead(step + 1)

    def start_ahead(self, step: int) -> None:
        data_state = self.dataset.state_dict()  # before the batch's prompts are drawn
        prompts = next(self.batches)

        def generate() -> tuple[list[Sample], float]:
            t = time.perf_counter()
            return self.generate(step, prompts), time.perf_counter() - t

        self.ahead = (step, prompts, self.producer.submit(generate), data_state)

    def sync_weights(self, version: int, *, in_flight: bool = False) -> None:
        """The engines take the trainer's weights; between batches, never while a batch generated ahead is in
        flight (``collect`` and ``before_eval`` wait for it first). In flight, the requests sent from now on carry
        the new version as their cache salt, the batches still generating included."""
        if not in_flight and self.ahead is not None and not self.ahead[2].done():
            raise RuntimeError(f"weight sync to version {version} while the batch of step {self.ahead[0]} is still "
                               "generating: wait for it first")
        super().sync_weights(version, in_flight=in_flight)
        if self.in_flight:  # every client the recipe owns: the evaluator's too, or an eval point after an in-flight
            # update could be served prefix blocks that older weights computed
            evaluator = [self.evaluator.client] if self.evaluator is not None else []
            for client in [self.client, *self.live_clients, *evaluator]:
                client.serve_version(version)
        if self.stream is not None:  # groups drawn from now on come out of the new version
            self.stream.allow(group_draw_limit(self.cfg, version))

    def data_state(self) -> dict:
        """The data sampler's state for a checkpoint: from before the prompts of a batch generated ahead; with a
        stream of groups, after its last draw, with the groups drawn and not yet trained."""
        if self.stream is not None:
            return self.stream.state(self.dataset.state_dict)
        return self.ahead[3] if self.ahead is not None else self.dataset.state_dict()

    def before_eval(self, step: int) -> None:
        """Ahead of the trainer, the engines still serve older weights: they finish their batch first (kept for
        the next step), then take the weights after ``step``."""
        if self.ahead is not None:
            wait_quietly(self.ahead[2])
        if self.producer is not None and (self.engine_version or 0) != step:
            # a stream of groups generates on: the weights go under its requests
            self.sync_weights(version=step, in_flight=self.stream is not None and self.stream.started)

    def cleanup(self) -> None:
        if self.stream is not None:  # its pending groups are in the checkpoint's data state
            self.stream.close()
        if self.producer is not None:
            if self.ahead is not None:  # not in any checkpoint (the data state is from before it): let it go
                wait_quietly(self.ahead[2])
                self.ahead = None
            self.producer.shutdown(wait=True)
        super().cleanup()

    def rollout(self, step: int, prompts, generated: list[Sample] | None = None
                ) -> tuple[list[Sample], dict[str, float]]:
        """The step's graded samples (``Sample.reward``) and the rollout-side counters (``generated``: the first
        round's samples, generated already). With
        ``algorithm.dynamic_sampling`` the groups whose samples are all right or all wrong (raw accuracy: a grade of 1
        is right, partial credit never reaches it) are dropped and further prompt batches generated
        (``r3rl.train.dapo``); ``algorithm.overlong_buffer`` then lowers the rewards of responses near max_tokens."""
        cfg, alg = self.cfg, self.cfg.algorithm

        def one_round(r: int) -> list[Sample]:
            samples = generated if r == 0 and generated is not None else \
                self.generate(step, prompts if r == 0 else next(self.batches), round_=r)
            for s in samples:
                if s.reward is None:  # an environment's own reward stands; else the run's grader, on the answer
                    # (an episode's last policy turn: observations and tool calls are not the answer)
                    text = self.tokenizer.decode(s.extra.get("answer_ids", s.response_ids), skip_special_tokens=True)
                    s.reward = grade(cfg.reward, text, s.label, cfg.data.partial_credit)
                s.extra["correct"] = float(s.reward >= 1.0)
            return samples

        stats: dict[str, float] = {}
        if alg.dynamic_sampling:
            filled = dapo.fill_with_mixed_groups(one_round, lambda s: s.extra["correct"], alg.rollout_batch_size,
                                                 alg.max_generation_rounds)
            samples = filled.samples
            stats = {M.FILTERED_GROUPS: float(filled.filtered_groups), M.GENERATION_ROUNDS: float(filled.rounds),
                     M.PADDED_GROUPS: float(filled.padded_groups)}
            if filled.padded_groups:
                console.print(f"[yellow]step {step}: {filled.padded_groups} of {alg.rollout_batch_size} groups have "
                              f"equal outcomes after {filled.rounds} generation rounds "
                              f"(algorithm.max_generation_rounds); they train with zero advantage[/]")
        else:
            samples = one_round(0)
        if self.episodes is not None:
            samples, episode_stats = mask_failed_episodes(
                samples, self.client.spec.row_bytes if self.client.routing_replay else 0)
            stats.update(episode_stats)
        if alg.overlong_buffer:
            penalty = dapo.overlong_penalty([s.response_length for s in samples], cfg.rollout.sampling.max_tokens,
                                            alg.overlong_buffer, alg.overlong_penalty_factor)
            for s, p in zip(samples, penalty):
                s.reward += float(p)
            stats[M.OVERLONG_PENALTY_MEAN] = float(np.mean(penalty))
        return samples, stats

    def generate(self, step: int, prompts, round_: int = 0) -> list[Sample]:
        """``n_samples_per_prompt`` samples of each prompt; a dynamic-sampling round after the first draws from other
        seeds (the request seeds follow the step and the sample's index)."""
        cfg = self.cfg
        sampling = cfg.rollout.sampling
        if round_:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + round_ * 1_000_003)
        if self.episodes is not None:  # multi-turn: an episode per sample, one Sample each
            return self.traced(asyncio.run(self.episodes.run(
                [EpisodePrompt(p.prompt_ids, p.text, p.label) for p in prompts], cfg.algorithm.n_samples_per_prompt,
                sampling, step=step)))
        client = self.client
        if self.in_flight:
            client = RolloutClient.from_config(cfg, self.engines.urls)
            self.live_clients.append(client)  # first: a sync from now on reaches it
            client.serve_version(self.engine_version or 0)
        try:
            samples = asyncio.run(client.generate(
                [list(map(int, p.prompt_ids)) for p in prompts], cfg.algorithm.n_samples_per_prompt, sampling,
                step=step, stop_token_ids=[self.tokenizer.eos_token_id], labels=[p.label for p in prompts],
            ))
        finally:
            if client is not self.client:
                self.live_clients.remove(client)
        aborted = [s.index for s in samples if s.status == SampleStatus.ABORTED]
        if aborted:
            # an aborted sample has no complete response: training on it would be silently off-policy
            raise EngineError(f"step {step}: samples {aborted} were aborted by the engine; nothing was trained")
        return self.traced(samples)

    def preemptions(self, samples: list[Sample]) -> dict[str, float]:
        """The engines' preemptions since the last step (``vllm:num_preemptions_total``); with in-flight updates,
        also the samples that spanned an update in a step with preemptions: each may have been preempted before the
        update and recomputed after it by newer weights than the routes it returned (an upper bound; 0 proves none
        was)."""
        total = engine_metrics.read_counter(self.engines.urls, engine_metrics.PREEMPTIONS)
        out = {M.PREEMPTIONS: total - self.preemptions_seen}
        self.preemptions_seen = total
        if self.in_flight:
            spanning = sum(staleness.spans_versions(s) for s in samples)
            out[M.PREEMPTED_SPANNING_SAMPLES] = float(spanning if out[M.PREEMPTIONS] > 0 else 0)
        return out

    def traced(self, samples: list[Sample]) -> list[Sample]:
        """``debug.route_trace``: each sample's digest as the rollout returned it (``r3rl.route_trace``)."""
        if self.cfg.debug.route_trace:
            for s in samples:
                s.extra["trace_rollout"] = route_trace.sample_hex(s)
        return samples

    def write_trace(self, step: int, samples: list[Sample], replayed) -> None:
        """The step's trace: every sample's digest at each boundary, in ``<run>/trace/step_N.jsonl``."""
        records = [{"request_id": s.request_id, "index": i, "digests": {
            "rollout": s.extra.get("trace_rollout"),
            "batch": route_trace.sample_hex(s),
            **{boundary: digests[i] for boundary, digests in (replayed.trace or {}).items()}}}
            for i, s in enumerate(samples)]
        route_trace.write_step(self.run_dir / route_trace.TRACE_DIR, step, records)


def mask_failed_episodes(samples: list[Sample], route_row_bytes: int = 0) -> tuple[list[Sample], dict[str, float]]:
    """Episodes with a turn that failed twice (aborted, or tokens without all their routes: ``r3rl.env.episodes``)
    train on nothing, and neither does the rest of their group (its advantages would be centred on a mean that
    counts them), as ``staleness.drop_stale`` takes groups out; the episodes' counters for the step."""
    failed = {s.group for s in samples if s.extra["episode"].masked}
    kept = [dataclasses.replace(s, loss_mask=np.zeros_like(s.loss_mask)) if s.group in failed else s for s in samples]
    return kept, {**M.episode_metrics([s.extra["episode"] for s in samples], route_row_bytes),
                  M.EPISODES_MASKED: float(sum(s.group in failed for s in samples))}


def version_token_mismatch(samples: list[Sample], trainer_version: int, replayed, unreplayed) -> dict[str, float]:
    """The mismatch with and without replay over the response tokens the trainer's current weights generated and over
    those older weights generated (a sample spanning an in-flight update has both), each where there are any."""
    versions = [staleness.token_versions(s) for s in samples]
    rollout_lps = [s.rollout_logprobs for s in samples]
    out = {}
    for which, keep in (("current", lambda v: v == trainer_version), ("older", lambda v: v < trainer_version)):
        masks = [s.loss_mask * keep(v) for s, v in zip(samples, versions)]
        if not any(m.any() for m in masks):
            continue
        for key, result in ((M.LOGPROB_ABS_DIFF_VERSION_TOKENS, replayed),
                            (M.LOGPROB_ABS_DIFF_NO_REPLAY_VERSION_TOKENS, unreplayed)):
            if result is not None:
                out[key.format(which=which)] = M.logprob_abs_diff(result.logprobs, rollout_lps, masks)
    return out


def wait_quietly(future: Future) -> None:
    """Wait for ``future`` without raising: its error is raised where its result is used."""
    try:
        future.exception()
    except Exception:  # noqa: BLE001  (cancelled)
        pass


def replay_mismatch_rows(result) -> float:
    """(token, layer) rows Megatron routed otherwise than the rollout under replay: 0 proves the replay, every step;
    NaN when the check saw no row (it must never read as a pass)."""
    if result.replay_mismatch_rows or result.replayed_routes_match:
        return float(result.replay_mismatch_rows)
    return float("nan")


def run_recipe(cfg: R3RLConfig) -> None:
    from recipes import warm_start

    common.run(GRPORecipe, warm_start.ensure(cfg))
