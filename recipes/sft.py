"""Supervised fine-tuning on the GRPO recipe's trainer: ``python run.py recipe=sft [data=...]``.

Each step reads top to bottom: the next batch of records -> one optimizer step of the mean NLL of their response
tokens (``MegatronTrainer.sft_step``, micro batches as GRPO packs them) -> log -> save. The same Megatron ranks,
parallelism, checkpoints and resume, W&B run and eval points as GRPO (``recipes/common.py``); the vLLM engines are
started only for the eval sets, and get the trainer's weights just before each eval point. At the end the weights
are written as an HF checkpoint folder (``sft.export_dir``), which ``model.checkpoint=`` takes for a GRPO run.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from r3rl import metrics as M
from r3rl.config.schema import R3RLConfig
from r3rl.dashboard.panels import SFT_PANELS
from r3rl.data.arithmetic import ensure_sft_data
from r3rl.data.sft import SFTDataset
from r3rl.eval.sets import eval_due
from r3rl.plan import WandbNaming
from r3rl.rollout.engine import EngineError
from r3rl.sample import Sample
from recipes import common
from recipes.common import StopRequested, console

__all__ = ["SFTRecipe", "run_recipe"]


class SFTRecipe(common.Recipe):
    panels = SFT_PANELS

    def __init__(self, cfg: R3RLConfig):
        super().__init__(cfg)
        self.export_dir = Path(cfg.sft.export_dir).resolve()
        # the eval sets run on vLLM engines: without an eval point there is no engine to start
        self.evaluates = any(eval_due(cfg, s) for s in (0, cfg.run.num_steps))

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """The records (generated when the data config allows), then Ray, the trainer ranks, the engines for the
        eval sets and W&B (``common.Recipe.start``); a resumed run continues from its checkpoint."""
        resume_from, meta = self.prepare()
        ensure_sft_data(self.cfg.data)
        self.dataset = SFTDataset(self.cfg.data, self.tokenizer, max_tokens=self.cfg.model.max_position_embeddings)
        console.print(f"SFT data: {len(self.dataset)} records of {self.dataset.path}")
        self.start(resume_from, meta, engines=self.evaluates, wandb=sft_naming(self.plan.wandb, self.cfg))

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        batches = self.dataset.batches(cfg.sft.batch_size)
        self.eval_before_training()
        self.engines_yield()
        with Progress(TextColumn("[bold]SFT step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("steps", total=cfg.run.num_steps, completed=self.start_step - 1)
            for step in range(self.start_step, cfg.run.num_steps + 1):
                if self.stop:  # arrived during setup: nothing new to save
                    raise StopRequested(step - 1)
                self.train_step(step, next(batches))
                bar.advance(task)
                if step % cfg.run.save_every == 0 or step == cfg.run.num_steps or self.stop:
                    self.save(step)
                else:
                    self.poll_save()
                if self.stop:
                    raise StopRequested(step)
        self.export()

    def train_step(self, step: int, samples: list[Sample]) -> None:
        started = time.perf_counter()
        out = self.trainers.call("sft_step", ray.put(samples))
        train_s = time.perf_counter() - started
        values = {
            M.SFT_LOSS: out["loss"],
            M.SFT_GRAD_NORM: out["grad_norm"],
            M.SFT_TOKENS_PER_S: sum(s.num_tokens - 1 for s in samples) / train_s,  # the tokens fed, per second
            M.SFT_LOSS_TOKENS: out["loss_tokens"],
            M.SFT_LR: out["lr"],
            M.perf_time_key("train"): train_s,
            M.PERF_STEP_TIME: time.perf_counter() - started,
        }
        self.log_with_eval(step, values)

    # ------------------------------------------------------------------ eval: the engines serve the trained weights
    def before_eval(self, step: int) -> None:
        if dead := self.engines.dead():
            raise EngineError(f"engine(s) {', '.join(dead)} died before the eval of step {step}; see "
                              f"{self.run_dir / 'logs'}")
        if self.engine_version != step and (step > 0 or self.engine_version is not None):
            t = time.perf_counter()
            self.sync_weights(version=step)
            console.print(f"weights of step {step} synced into the engines in {time.perf_counter() - t:.1f} s")

    def after_eval(self, step: int) -> None:
        self.engines_yield()

    def engines_yield(self) -> None:
        """Colocated engines sleep while the trainer steps (they wake in the next sync, before an eval point)."""
        if self.colocated and self.engines is not None and not self.engines_asleep:
            self.engine_set.sleep(self.cfg.rollout.weight_sync.sleep_level)
            self.engines_asleep = True
            self.trainers.call("onload_optimizer_state")

    # ------------------------------------------------------------------ the result
    def export(self) -> Path:
        t = time.perf_counter()
        folder = Path(self.trainers.call("export_hf", self.export_dir))
        console.print(f"[bold]SFT checkpoint (HF) written in {time.perf_counter() - t:.1f} s: {folder}[/]\n"
                      f"start GRPO from it: python run.py model.checkpoint={folder}")
        return folder


def sft_naming(naming: WandbNaming, cfg: R3RLConfig) -> WandbNaming:
    """GRPO's W&B naming with the tags of an SFT run: ``recipe:sft`` instead of the replay and correction tags
    (nothing is replayed or corrected), so the dashboard never files it under R3 on or off."""
    kept = [t for t in naming.tags if not t.startswith(("r3:", "replay:", "correction:"))]
    return dataclasses.replace(naming, tags=("recipe:sft", *kept))


def report_export(cfg: R3RLConfig) -> None:
    """A finished run's HF folder, when it is there (the relaunch of a finished run prints it again)."""
    folder = Path(cfg.sft.export_dir).resolve()
    if (folder / "config.json").is_file():
        console.print(f"SFT checkpoint (HF): {folder}\nstart GRPO from it: python run.py model.checkpoint={folder}")


def run_recipe(cfg: R3RLConfig) -> None:
    common.run(SFTRecipe, cfg, on_finished=report_export)
