"""GRPO for MoE models with Rollout Routing Replay: the recipe ``python run.py`` launches.

Each step reads top to bottom: generate and grade -> log-probs (with and without replay) -> advantages -> train ->
sync weights -> mismatch metrics -> log -> save. When the batch is generated (in turn, one step ahead, with weight
updates in flight, or in completion order) is the schedule's business (``recipes/schedule.py``): the step asks it
for its batch and tells it when it trained. The driver process is the controller and holds no GPU; trainer ranks and
vLLM engines are Ray actors placed by ``r3rl.placement``. What the SFT recipe shares with this one (start and stop of
the actors, weight sync, eval points, checkpoints, SIGTERM, the end-of-run report) is in ``recipes/common.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np
import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from r3rl import metrics as M
from r3rl import route_trace
from r3rl.config.modes import pi_old_from_training_forward, replay_mode, unreplayed_pass_due
from r3rl.config.schema import R3RLConfig
from r3rl.data.arithmetic import ensure_prompts
from r3rl.data.dataset import PromptDataset
from r3rl.data.reward import grade_samples
from r3rl.env import build_environment, multi_turn
from r3rl.env.episodes import EpisodePrompt, EpisodeRunner, EpisodeSettings, mask_failed_episodes
from r3rl.env.stitch import shift_turn_rows
from r3rl.rollout import engine_metrics
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError
from r3rl.rollout.store import save_rollout
from r3rl.sample import Sample, SampleStatus
from r3rl.train import correction, dapo, staleness
from r3rl.train.grpo import group_advantages
from r3rl.train.step_figures import step_figures, update_figures
from recipes import common
from recipes.common import StopRequested, console
from recipes.schedule import schedule_for

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
        # group_intake=completion: the groups a checkpoint left drawn and untrained (generated first)
        self.resumed_data_state: dict = {}
        self.schedule = schedule_for(self)
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
        self.preemption_windows = engine_metrics.PreemptionWindows(
            lambda: engine_metrics.read_counter(self.engines.urls, engine_metrics.PREEMPTIONS))
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
        self.batches = self.dataset.batches(cfg.algorithm.rollout_batch_size)
        self.schedule.begin()
        self.eval_before_training()
        with Progress(TextColumn("[bold]GRPO step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("steps", total=cfg.run.num_steps, completed=self.start_step - 1)
            for step in range(self.start_step, cfg.run.num_steps + 1):
                if self.stop:  # arrived during setup: nothing new to save
                    raise StopRequested(step - 1)
                try:
                    self.train_step(step)
                except Exception as err:
                    if named := self.engine_fault(step, err):
                        raise named from err
                    raise
                bar.advance(task)
                if step % cfg.run.save_every == 0 or step == cfg.run.num_steps or self.stop:
                    self.save(step)
                else:
                    self.poll_save()
                if self.stop:
                    raise StopRequested(step)

    def train_step(self, step: int, prompts=None) -> None:
        """One step (``prompts``: the step's own, for a caller that drives steps itself; else the schedule draws)."""
        cfg, alg = self.cfg, self.cfg.algorithm
        timings: dict[str, float] = {}
        started = time.perf_counter()
        if dead := self.engines.dead():
            raise EngineError(f"engine(s) {', '.join(dead)} died before step {step}; see {self.run_dir / 'logs'}")

        # 1. generate and grade (DAPO: groups of equal outcome dropped and refilled, overlong responses penalised);
        # ahead of the trainer (max_staleness >= 1): the batch generated meanwhile, the next one started
        t = time.perf_counter()
        samples, rollout_stats = self.schedule.batch(step, timings, prompts)
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
        # batch after the one they are generating, when the schedule starts it)
        self.schedule.after_train(step, timings)

        # 5. metrics: mismatch with and without replay on identical data, routing flips, correction, rewards, perf
        values = step_figures(samples, replayed, unreplayed, train_out, replay_mode=self.replay_mode, step=step,
                              max_staleness=self.max_staleness, multi_turn=self.episodes is not None,
                              timings=timings, step_time_s=time.perf_counter() - started,
                              merged=(corrected.metrics, rollout_stats))
        values.update(self.preemptions(step, samples))
        values.update(update_figures(train_out, self.replay_mode))
        if self.colocated:  # what the trainer still held on its GPUs when the engines woke (0 on a CPU)
            values[M.PERF_TRAINER_RESERVED_AT_WAKE] = max(b for e, b in self.handoffs if e == "yield") / 2**30
        self.log_with_eval(step, values)

    def sync_weights(self, version: int, *, in_flight: bool = False) -> None:
        """The engines take the trainer's weights, when the schedule allows. In flight, the requests sent from now on
        carry the new version as their cache salt, the batches still generating included."""
        self.schedule.before_sync(version, in_flight)
        super().sync_weights(version, in_flight=in_flight)
        if self.in_flight or self.adapter is not None:  # every client the recipe owns: the evaluator's too, or an
            # eval point after an in-flight update could be served prefix blocks that older weights computed (or,
            # with adapters, the base or an older version's adapter)
            evaluator = [self.evaluator.client] if self.evaluator is not None else []
            for client in [self.client, *self.live_clients, *evaluator]:
                client.serve_version(version, self.adapter)
        self.schedule.after_sync(version)

    def data_state(self) -> dict:
        return self.schedule.data_state()

    def before_eval(self, step: int) -> None:
        self.schedule.before_eval(step)

    def cleanup(self) -> None:
        self.schedule.close()
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
            grade_samples(samples, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), cfg.reward,
                          cfg.data.partial_credit)
            return samples

        stats: dict[str, float] = {}
        if alg.dynamic_sampling:
            filled = dapo.fill_with_mixed_groups(one_round, lambda s: s.extra["correct"], alg.rollout_batch_size,
                                                 alg.max_generation_rounds)
            samples = filled.samples
            stats = filled.metrics
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
            with self.preemption_windows.window(step):
                return self.traced(asyncio.run(self.episodes.run(
                    [EpisodePrompt(p.prompt_ids, p.text, p.label) for p in prompts],
                    cfg.algorithm.n_samples_per_prompt, sampling, step=step)))
        client = self.client
        if self.in_flight:
            client = RolloutClient.from_config(cfg, self.engines.urls)
            self.live_clients.append(client)  # first: a sync from now on reaches it
            client.serve_version(self.engine_version or 0, self.adapter)
        try:
            with self.preemption_windows.window(step):
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

    def preemptions(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """The engines' preemptions while the step's batch generated (``vllm:num_preemptions_total``, by batch window:
        ``engine_metrics.PreemptionWindows``), and whether that window was shared with another batch's generation;
        with in-flight updates, also the samples that spanned an update in a step with preemptions: each may have
        been preempted before the update and recomputed after it by newer weights than the routes it returned (an
        upper bound; 0 proves none was)."""
        count, shared = self.preemption_windows.take(step)
        out = {M.PREEMPTIONS: count, M.PREEMPTIONS_WINDOW_SHARED: float(shared)}
        if self.in_flight:
            spanning = sum(staleness.spans_versions(s) for s in samples)
            out[M.PREEMPTED_SPANNING_SAMPLES] = float(spanning if out[M.PREEMPTIONS] > 0 else 0)
        return out

    def traced(self, samples: list[Sample]) -> list[Sample]:
        """``debug.route_trace``: each sample's digest as the rollout returned it (``r3rl.route_trace``)."""
        return route_trace.mark_rollout(samples) if self.cfg.debug.route_trace else samples

    def write_trace(self, step: int, samples: list[Sample], replayed) -> None:
        """The step's trace: every sample's digest at each boundary, in ``<run>/trace/step_N.jsonl``."""
        route_trace.write_step(self.run_dir / route_trace.TRACE_DIR, step,
                               route_trace.step_records(samples, replayed.trace))


def run_recipe(cfg: R3RLConfig) -> None:
    from recipes import warm_start

    common.run(GRPORecipe, warm_start.ensure(cfg))
