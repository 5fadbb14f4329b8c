"""GRPO for MoE models with Rollout Routing Replay: the recipe ``python run.py`` launches.

Each step reads top to bottom: generate -> log-probs (with and without replay) -> mismatch metrics -> train ->
sync weights -> log -> save. The driver process is the controller and holds no GPU; trainer ranks and vLLM engines
are Ray actors placed by ``r3rl.placement``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from r3rl import checkpoint
from r3rl import metrics as M
from r3rl.config.modes import replay_mode, unreplayed_pass_due
from r3rl.config.schema import R3RLConfig
from r3rl.dashboard.local import write_comparison
from r3rl.data.arithmetic import ensure_prompts
from r3rl.data.dataset import PromptDataset
from r3rl.data.reward import shaped_math_reward
from r3rl.eval.runner import EvalInterrupted, Evaluator
from r3rl.eval.sets import eval_due, load_sets
from r3rl.models.tiny_moe import ensure_checkpoint
from r3rl.orchestration.groups import EngineGroup, TrainerGroup
from r3rl.orchestration.ray_cluster import start_or_attach
from r3rl.plan import build_plan, weight_sync_backend
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError
from r3rl.rollout.store import save_rollout
from r3rl.rollout.weight_transfer import EngineSet
from r3rl.rollout.weights import update_weights_from_hf
from r3rl.sample import Sample, SampleStatus
from r3rl.tracking.finished import finished_step, report_finished
from r3rl.tracking.offline_reader import read_runs
from r3rl.tracking.summary import print_summary
from r3rl.tracking.wandb_logger import WandbLogger
from r3rl.train import correction
from r3rl.train.grpo import group_advantages

console = Console()


class StopRequested(Exception):
    """SIGTERM arrived (Slurm preemption, scancel): checkpoint and leave."""


class GRPORecipe:
    def __init__(self, cfg: R3RLConfig):
        self.cfg = cfg
        self.plan = build_plan(cfg)
        self.run_dir = Path(cfg.run.output_dir).resolve()
        self.replay_mode = replay_mode(cfg)
        self.r3 = self.replay_mode == "r3"
        self.correction = correction.Correction.of(cfg.correction)
        self.cluster = self.trainers = self.engines = self.logger = self.engine_set = None
        self.history: list[dict[str, float]] = []
        self.colocated = self.plan.placement.colocated
        self.engines_asleep = False
        self.stop = False
        self.unlogged: dict[str, float] | None = None  # a step's metrics whose eval point SIGTERM interrupted

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        # from here on SIGTERM (Slurm preemption, scancel) ends the run at the next step boundary with a checkpoint
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # one line per HTTP request drowns the progress bars
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        model_dir = ensure_checkpoint(cfg.model)
        ensure_prompts(cfg.data)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        eval_sets = load_sets(cfg, self.tokenizer) if cfg.run.eval_every > 0 else []
        resume_from = checkpoint.latest(self.run_dir) if cfg.run.resume else None
        meta = checkpoint.read_meta(resume_from) if resume_from else None
        if meta is not None:
            self.dataset.load_state_dict(meta.data_state)
        self.start_step = (meta.step if meta else 0) + 1
        self.unlogged = meta.unlogged_metrics if meta else None

        self.cluster = start_or_attach(cfg, self.plan)
        with console.status("starting trainer ranks"):
            self.trainers = TrainerGroup(cfg, self.plan, loopback=self.cluster.started_here)
        if resume_from is not None:
            self.trainers.call("load_checkpoint", resume_from / "trainer")
        with console.status(f"starting {len(self.plan.engines) or 1} vLLM engine(s)"):
            self.engines = EngineGroup(cfg, self.plan, self.run_dir / "logs", self.trainers)
        self.client = RolloutClient.from_config(cfg, self.engines.urls)
        self.evaluator = Evaluator.from_config(cfg, eval_sets, self.engines.urls, self.tokenizer, console)
        if self.plan.attach_url:
            # launched engines were checked at start; an attached one is checked against this config here
            self.client.check_engines_sync()
        self._write_process_table()
        self.open_weight_sync()
        if meta is not None:  # engines load the HF checkpoint; a resumed policy has moved on from it
            self.sync_weights(version=meta.step)
        self.logger = WandbLogger(cfg, self.plan.wandb, self.run_dir, resume_id=meta.wandb_run_id if meta else None)
        # again: ray.init installs its own SIGTERM handler in the driver (it aborts the process)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if meta is not None:
            console.print(f"resumed from step {meta.step} ({resume_from})")

    def _write_process_table(self) -> None:
        """What this run started, by PID, so operators and tests can check that all of it is gone afterwards."""
        table = {
            "driver_pid": os.getpid(),
            "ray_temp_dir": str(self.cluster.temp_dir) if self.cluster.temp_dir else None,
            "trainers": self.trainers.devices,
            "engines": self.engines.info or [{"url": u, "pid": None} for u in self.engines.urls],
        }
        (self.run_dir / "processes.json").write_text(json.dumps(table, indent=2))

    def _on_sigterm(self, signum, frame) -> None:
        self.stop = True
        # a rollout in flight completes first (Slurm's --signal=B:TERM@120 leaves time for one step)
        console.print("[yellow]SIGTERM: finishing this step, then checkpointing[/]")

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        batches = self.dataset.batches(cfg.algorithm.rollout_batch_size)
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

        # 1. generate
        t = time.perf_counter()
        samples = self.generate(step, prompts)
        timings["rollout"] = time.perf_counter() - t
        rewards = [shaped_math_reward(self.tokenizer.decode(s.response_ids, skip_special_tokens=True), s.label,
                                      cfg.data.partial_credit)
                   for s in samples]
        for s, r in zip(samples, rewards):
            s.reward = r
        if cfg.debug.save_rollout:
            save_rollout(samples, Path(cfg.debug.save_rollout) / f"step_{step:06d}.npz")
        batch = ray.put(samples)
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
        self.sync_weights(version=step)
        if self.colocated:  # the engines generate next: Adam's moments wait in host memory
            self.trainers.call("offload_optimizer_state")
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
            replay_mismatch_rows=replay_mismatch_rows(replayed) if self.r3 else None,
            loss=train_out.get("loss"),
            grad_norm=train_out.get("grad_norm"),
            timings_s=timings,
            step_time_s=time.perf_counter() - started,
        )
        if self.r3 and unreplayed is None:  # the paired pass skipped this step: its figures are not logged
            for key in (M.LOGPROB_ABS_DIFF_NO_REPLAY, M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR):
                values.pop(key)
        values.update(corrected.metrics)
        values.update({f"train/{k}": float(v) for k, v in train_out.items()
                       if k not in ("loss", "grad_norm", "step") and isinstance(v, (int, float))})
        if self.replay_mode == "r2":
            values[M.R2_REPLAY_MISMATCH_ROWS] = float(train_out["replay_mismatch_rows"])
            values[M.R2_REPLAYED_ROWS] = float(train_out["replayed_rows"])
        self.log_with_eval(step, values)

    # ------------------------------------------------------------------ eval
    def eval_before_training(self) -> None:
        """The baseline (weights before any step), or the eval point SIGTERM interrupted before the checkpoint this
        run resumed from; each is logged once, at its step."""
        if self.start_step == 1 and eval_due(self.cfg, 0):
            self.log_with_eval(0, {})
        elif self.unlogged is not None:
            step = self.start_step - 1
            console.print(f"redoing the eval of step {step} that SIGTERM interrupted")
            self.log_with_eval(step, self.unlogged)
            folder = checkpoint.latest(self.run_dir)
            checkpoint.update_meta(folder, dataclasses.replace(checkpoint.read_meta(folder), unlogged_metrics=None))
        if self.unlogged is not None:  # interrupted again: the checkpoint still holds them
            raise StopRequested(self.start_step - 1)

    def log_with_eval(self, step: int, values: dict[str, float]) -> None:
        """Log ``step``'s metrics, with its eval point when one is due; an interrupted eval keeps them unlogged
        (``self.unlogged``) for the checkpoint, so the resumed run logs the step once, eval included."""
        self.unlogged = None
        if eval_due(self.cfg, step):
            try:
                values = {**values, **self.evaluator.evaluate(step, stop=lambda: self.stop)}
            except EvalInterrupted:
                console.print(f"[yellow]SIGTERM: eval of step {step} abandoned; it is redone after resume[/]")
                self.unlogged = dict(values)
                return
        self.logger.log(values, step=step)
        self.history.append({"step": step, **values})

    def generate(self, step: int, prompts) -> list[Sample]:
        cfg = self.cfg
        samples = asyncio.run(self.client.generate(
            [list(map(int, p.prompt_ids)) for p in prompts], cfg.algorithm.n_samples_per_prompt, cfg.rollout.sampling,
            step=step, stop_token_ids=[self.tokenizer.eos_token_id], labels=[p.label for p in prompts],
        ))
        aborted = [s.index for s in samples if s.status == SampleStatus.ABORTED]
        if aborted:
            # an aborted sample has no complete response: training on it would be silently off-policy
            raise EngineError(f"step {step}: samples {aborted} were aborted by the engine; nothing was trained")
        return samples

    def open_weight_sync(self) -> None:
        """Join the trainer's sender and every engine worker in one transfer group (once; ``disk`` needs none)."""
        self.weight_sync = weight_sync_backend(self.cfg)
        self.engine_set = EngineSet(self.engines.urls, self.cfg.rollout.engine.request_timeout_s)
        if self.weight_sync == "disk":
            return
        self.trainers.open_weight_transfer(self.engines.urls, backend=self.weight_sync,
                                           loopback=self.cluster.started_here,
                                           timeout_s=self.cfg.rollout.engine.request_timeout_s,
                                           bucket_bytes=int(self.cfg.rollout.weight_sync.bucket_mb * (1 << 20)))

    def sync_weights(self, version: int) -> None:
        """pause (colocated: wake the sleeping engines' weights only) -> start -> one broadcast per bucket into every
        engine -> finish(version) -> (colocated: wake the KV cache) -> reset prefix cache -> resume."""
        asleep, self.engines_asleep = self.engines_asleep, False
        if asleep:
            self.engine_set.wake_up(["weights"])
        if self.weight_sync == "disk":  # pause, load, reset, label and resume per engine (r3rl.rollout.weights)
            exported = Path(self.trainers.call("export_hf", self.run_dir / "weights"))
            for url in self.engines.urls:
                update_weights_from_hf(url, exported, version)
        else:
            if not asleep:  # sleeping engines were paused by /sleep
                self.engine_set.pause()
            self.trainers.send_weights(version)
        if asleep:
            self.engine_set.wake_up(["kv_cache"])
        if self.weight_sync != "disk":
            self.engine_set.reset_prefix_cache()
            self.engine_set.resume()

    # ------------------------------------------------------------------ save / cleanup
    def save(self, step: int) -> Path:
        meta = checkpoint.CheckpointMeta(step=step, wandb_run_id=self.logger.run_id if self.logger else None,
                                         data_state=self.dataset.state_dict(), weight_version=step,
                                         unlogged_metrics=self.unlogged)
        folder = checkpoint.save(self.run_dir, meta, lambda d: self.trainers.call("save_checkpoint", d / "trainer", {}))
        return folder

    def cleanup(self) -> None:
        if self.engine_set is not None:
            self.engine_set.close()
        for part in (self.engines, self.trainers):
            if part is not None:
                part.shutdown()
        if self.logger is not None:
            self.logger.finish()
        if self.cluster is not None:
            self.cluster.shutdown()


def replay_mismatch_rows(result) -> float:
    """(token, layer) rows Megatron routed otherwise than the rollout under replay: 0 proves the replay, every step;
    NaN when the check saw no row (it must never read as a pass)."""
    if result.replay_mismatch_rows or result.replayed_routes_match:
        return float(result.replay_mismatch_rows)
    return float("nan")


def run_recipe(cfg: R3RLConfig) -> None:
    done = finished_step(cfg)
    if done is not None:  # run.py settles this before Hydra starts; a sweep's job or an in-process caller here
        report_finished(cfg, done)
        return
    recipe = GRPORecipe(cfg)
    code = 0
    try:
        recipe.setup()
        recipe.train()
    except StopRequested as stop:
        console.print(f"[yellow]stopped by SIGTERM after step {stop.args[0]}; checkpoint "
                      f"{checkpoint.latest(recipe.run_dir)}. Run the same command to resume.[/]")
        code = 143
    except EngineError as err:
        console.print(f"[red]error: {err}[/]")
        console.print(f"last checkpoint: {checkpoint.latest(recipe.run_dir) or 'none'}; engine logs: "
                      f"{recipe.run_dir / 'logs'}")
        code = 1
    finally:
        recipe.cleanup()
    if recipe.history:
        print_summary(recipe.history, console=Console(width=160))
    console.print(f"run folder: {recipe.run_dir}")
    if recipe.plan.wandb.mode != "disabled" and recipe.history:
        png, html = write_comparison(read_runs(recipe.run_dir), recipe.run_dir / "plots")
        console.print(f"W&B files: {recipe.run_dir / 'wandb'}\nplots: {png} and {html}\n"
                      f"compare with another run: python -m r3rl.dashboard --runs {recipe.run_dir} <other run folder> "
                      f"--out <folder>")
    if code:
        sys.exit(code)
