"""GRPO for MoE models with Rollout Routing Replay: the recipe ``python run.py`` launches.

Each step reads top to bottom: generate -> log-probs (with and without replay) -> mismatch metrics -> train ->
sync weights -> log -> save. The driver process is the controller and holds no GPU; trainer ranks and vLLM engines
are Ray actors placed by ``r3rl.placement``. What the SFT recipe shares with this one (start and stop of the
actors, weight sync, eval points, checkpoints, SIGTERM, the end-of-run report) is in ``recipes/common.py``.
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
from r3rl.config.modes import replay_mode, unreplayed_pass_due
from r3rl.config.schema import R3RLConfig
from r3rl.data.arithmetic import ensure_prompts
from r3rl.data.dataset import PromptDataset
from r3rl.data.reward import grade
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError
from r3rl.rollout.store import save_rollout
from r3rl.sample import Sample, SampleStatus
from r3rl.train import correction, dapo
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

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """The prompts, then Ray, the trainer ranks, the engines, the rollout client, the weight sync and W&B
        (``common.Recipe.start``); a resumed run continues from its checkpoint."""
        resume_from, meta = self.prepare()
        ensure_prompts(self.cfg.data)
        self.dataset = PromptDataset(self.cfg.data, self.tokenizer)
        self.start(resume_from, meta)

    def engines_started(self) -> None:
        self.client = RolloutClient.from_config(self.cfg, self.engines.urls)
        if self.plan.attach_url:
            # launched engines were checked at start; an attached one is checked against this config here
            self.client.check_engines_sync()

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        # one stream of prompt batches: dynamic sampling draws its extra rounds from it, so a checkpoint's data state
        # counts every prompt a step used
        self.batches = batches = self.dataset.batches(cfg.algorithm.rollout_batch_size)
        self.eval_before_training()
        with Progress(TextColumn("[bold]GRPO step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("steps", total=cfg.run.num_steps, completed=self.start_step - 1)
            for step in range(self.start_step, cfg.run.num_steps + 1):
                if self.stop:  # arrived during setup: nothing new to save
                    raise StopRequested(step - 1)
                try:
                    self.train_step(step, next(batches))
                except Exception as err:
                    # an engine whose node went down surfaces as whatever call reached it first: name the engine
                    if dead := self.engines.dead():
                        first = (str(err).splitlines() or [""])[0]
                        raise EngineError(f"step {step}: engine(s) {', '.join(dead)} went down "
                                          f"({type(err).__name__}: {first}); this step was not saved") from err
                    raise
                bar.advance(task)
                if step % cfg.run.save_every == 0 or step == cfg.run.num_steps or self.stop:
                    self.save(step)
                if self.stop:
                    raise StopRequested(step)

    def train_step(self, step: int, prompts) -> None:
        cfg, alg = self.cfg, self.cfg.algorithm
        timings: dict[str, float] = {}
        started = time.perf_counter()
        if dead := self.engines.dead():
            raise EngineError(f"engine(s) {', '.join(dead)} died before step {step}; see {self.run_dir / 'logs'}")

        # 1. generate and grade (DAPO: groups of equal outcome dropped and refilled, overlong responses penalised)
        t = time.perf_counter()
        samples, rollout_stats = self.rollout(step, prompts)
        rewards = [s.reward for s in samples]
        timings["rollout"] = time.perf_counter() - t
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
        # forwards then replay. none: live routing.
        t = time.perf_counter()
        paired = unreplayed_pass_due(cfg, step)
        replayed = self.trainers.call("logprobs", batch, replay=self.r3, record=self.replay_mode == "r2")
        unreplayed = self.trainers.call("logprobs", batch, replay=False) if paired else None
        timings["logprobs"] = time.perf_counter() - t
        train_batch = batch
        if self.replay_mode == "r2":  # the samples keep the engine's routes (if any); training sees the trainer's
            train_batch = ray.put([dataclasses.replace(s, routed_experts=r)
                                   for s, r in zip(samples, replayed.recorded_routes)])

        # 3. train, on pi_old = the log-probs above, with the rollout correction of pi_old / pi_rollout per token
        corrected = correction.correct(self.correction, replayed.logprobs, [s.rollout_logprobs for s in samples],
                                       [s.loss_mask for s in samples])
        advantages = group_advantages(np.asarray(rewards, dtype=np.float64), np.asarray([s.group for s in samples]),
                                      alg.normalize_advantage_std)
        t = time.perf_counter()
        per_token = [np.full(s.response_length, a, dtype=np.float32) for s, a in zip(samples, advantages)]
        apply = self.correction.changes_training
        train_out = self.trainers.call("train_step", train_batch, per_token, replay=self.replay_mode != "none",
                                       old_logprobs=replayed.logprobs,
                                       is_weights=corrected.weights if apply else None,
                                       loss_masks=corrected.loss_masks if apply else None)
        timings["train"] = time.perf_counter() - t

        # 4. sync weights: the engines serve the new policy from the next step on
        t = time.perf_counter()
        self.sync_weights(version=step)  # colocated: Adam's moments go to host memory before the engines wake
        timings["weight_sync"] = time.perf_counter() - t

        # 5. metrics: mismatch with and without replay on identical data, routing flips, correction, rewards, perf
        # (routing flips need the engine's routes: from the unreplayed pass, the only one under R2 and none)
        live = unreplayed if self.r3 else (replayed if samples[0].routed_experts is not None else None)
        values = M.step_metrics(
            rollout_logprobs=[s.rollout_logprobs for s in samples],
            trainer_logprobs=replayed.logprobs,
            trainer_logprobs_no_replay=unreplayed.logprobs if unreplayed is not None else None,
            loss_masks=[s.loss_mask for s in samples],
            rewards=rewards,
            response_lengths=[s.response_length for s in samples],
            prompt_lengths=[len(s.prompt_ids) for s in samples],
            routing_flip_per_layer=live.flip_per_layer if live is not None else None,
            routing_flip_per_layer_prompt=live.flip_per_layer_prompt if live is not None else None,
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
        values.update({f"train/{k}": float(v) for k, v in train_out.items()
                       if k not in ("loss", "grad_norm", "step") and isinstance(v, (int, float))})
        if self.colocated:  # what the trainer still held on its GPUs when the engines woke (0 on a CPU)
            values[M.PERF_TRAINER_RESERVED_AT_WAKE] = max(b for e, b in self.handoffs if e == "yield") / 2**30
        if self.replay_mode == "r2":
            values[M.R2_REPLAY_MISMATCH_ROWS] = float(train_out["replay_mismatch_rows"])
            values[M.R2_REPLAYED_ROWS] = float(train_out["replayed_rows"])
        self.log_with_eval(step, values)

    def rollout(self, step: int, prompts) -> tuple[list[Sample], dict[str, float]]:
        """The step's graded samples (``Sample.reward``) and the rollout-side counters. With
        ``algorithm.dynamic_sampling`` the groups whose samples are all right or all wrong (raw accuracy: a grade of 1
        is right, partial credit never reaches it) are dropped and further prompt batches generated
        (``r3rl.train.dapo``); ``algorithm.overlong_buffer`` then lowers the rewards of responses near max_tokens."""
        cfg, alg = self.cfg, self.cfg.algorithm

        def one_round(r: int) -> list[Sample]:
            samples = self.generate(step, prompts if r == 0 else next(self.batches), round_=r)
            for s in samples:
                text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
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
        samples = asyncio.run(self.client.generate(
            [list(map(int, p.prompt_ids)) for p in prompts], cfg.algorithm.n_samples_per_prompt, sampling,
            step=step, stop_token_ids=[self.tokenizer.eos_token_id], labels=[p.label for p in prompts],
        ))
        aborted = [s.index for s in samples if s.status == SampleStatus.ABORTED]
        if aborted:
            # an aborted sample has no complete response: training on it would be silently off-policy
            raise EngineError(f"step {step}: samples {aborted} were aborted by the engine; nothing was trained")
        return samples


def replay_mismatch_rows(result) -> float:
    """(token, layer) rows Megatron routed otherwise than the rollout under replay: 0 proves the replay, every step;
    NaN when the check saw no row (it must never read as a pass)."""
    if result.replay_mismatch_rows or result.replayed_routes_match:
        return float(result.replay_mismatch_rows)
    return float("nan")


def run_recipe(cfg: R3RLConfig) -> None:
    from recipes import warm_start

    common.run(GRPORecipe, warm_start.ensure(cfg))
