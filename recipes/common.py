"""What every recipe runs on, set up and torn down the same way: Ray, the Megatron trainer ranks, the vLLM engines
with their weight sync, the eval sets, W&B, checkpoints, SIGTERM, and the end-of-run summary and plots.

A recipe (``recipes/grpo.py``, ``recipes/sft.py``) subclasses ``Recipe`` and reads top to bottom: its ``setup()``
calls ``prepare()`` then ``start()``, its ``train()`` is its own loop, and ``run()`` launches it from ``run.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from r3rl import checkpoint
from r3rl.config.lora import adapter_slots
from r3rl.config.schema import R3RLConfig
from r3rl.dashboard.local import write_comparison
from r3rl.dashboard.panels import PANELS, Panel
from r3rl.eval.runner import EvalInterrupted, Evaluator
from r3rl.eval.sets import eval_due, load_sets
from r3rl.models.tiny_moe import ensure_checkpoint
from r3rl.orchestration.groups import EngineGroup, TrainerGroup
from r3rl.orchestration.ray_cluster import start_or_attach
from r3rl.plan import WandbNaming, build_plan, weight_sync_backend
from r3rl.rollout import auth
from r3rl.rollout.engine import EngineError, route_store_failure
from r3rl.sync.protocol import EngineSet
from r3rl.rollout.wire import foreign_weight_labels
from r3rl.sync import adapter as adapter_sync
from r3rl.sync.disk import update_weights_from_hf, weight_version
from r3rl.tracking.finished import finished_step, report_finished
from r3rl.tracking.offline_reader import read_runs
from r3rl.tracking.summary import print_summary
from r3rl.tracking.wandb_logger import WandbLogger

console = Console()


class StopRequested(Exception):
    """SIGTERM arrived (Slurm preemption, scancel): checkpoint and leave."""


class Recipe:
    """The parts both recipes share. Subclasses set ``self.dataset`` (with ``state_dict``/``load_state_dict``)
    before ``start()`` and implement ``setup()`` and ``train()``."""

    # the dashboard panels of this recipe's runs
    panels: Sequence[Panel] = PANELS

    def __init__(self, cfg: R3RLConfig):
        self.cfg = cfg
        self.plan = build_plan(cfg)
        self.run_dir = Path(cfg.run.output_dir).resolve()
        self.cluster = self.trainers = self.engines = self.logger = self.engine_set = self.evaluator = None
        self.dataset = None
        self.history: list[dict[str, float]] = []
        self.colocated = self.plan.placement.colocated
        self.engines_asleep = False
        # colocated: what happened to the shared GPUs, in order ("yield" with the bytes the trainer ranks still
        # reserved, at most over ranks; "wake" with the tags); GRPO logs the bytes of its step
        self.handoffs: list[tuple[str, Any]] = []
        self.engine_version: int | None = None  # the weight version the engines serve (None: the HF checkpoint's)
        self.adapter: str | None = None  # trainer.lora.sync=adapter: the adapter requests name (None: the base)
        self.stop = False
        self.unlogged: dict[str, float] | None = None  # a step's metrics whose eval point SIGTERM interrupted
        self.pending_save: tuple[Path, checkpoint.CheckpointMeta] | None = None  # written in the background
        self.start_step = 1

    # ------------------------------------------------------------------ setup
    def prepare(self) -> tuple[Path | None, checkpoint.CheckpointMeta | None]:
        """SIGTERM handling, the run folder, the model checkpoint and its tokenizer, the eval sets and the checkpoint
        to resume from: everything before a process starts. Returns (checkpoint folder, its meta) or (None, None)."""
        cfg = self.cfg
        # from here on SIGTERM (Slurm preemption, scancel) ends the run at the next step boundary with a checkpoint
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # one line per HTTP request drowns the progress bars
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        model_dir = ensure_checkpoint(cfg.model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        resume_from = checkpoint.latest(self.run_dir) if cfg.run.resume else None
        meta = checkpoint.read_meta(resume_from) if resume_from else None
        self.start_step = (meta.step if meta else 0) + 1
        self.unlogged = meta.unlogged_metrics if meta else None
        return resume_from, meta

    def start(self, resume_from: Path | None, meta: checkpoint.CheckpointMeta | None, *, engines: bool = True,
              wandb: WandbNaming | None = None) -> None:
        """Ray, the trainer ranks (restored from ``resume_from``), the engines with the evaluator and the weight sync
        (``engines``; a resumed run's engines get its weights), the process table and the W&B run."""
        cfg = self.cfg
        if meta is not None:
            self.dataset.load_state_dict(meta.data_state)
        eval_sets = load_sets(cfg, self.tokenizer) if engines and cfg.run.eval_every > 0 else []
        if engines:
            self.engine_token()
        self.cluster = start_or_attach(cfg, self.plan)
        if engines and not self.colocated:  # their own GPUs: the servers come up while the trainer ranks start
            self.engines = EngineGroup(cfg, self.plan, self.run_dir / "logs", None)
        with console.status("starting trainer ranks"):
            self.trainers = TrainerGroup(cfg, self.plan, loopback=self.loopback)
        if resume_from is not None:
            self.trainers.call("load_checkpoint", resume_from / checkpoint.TRAINER_DIR)
        if engines:
            with console.status(f"starting {len(self.plan.engines) or 1} vLLM engine(s)"):
                if self.engines is None:  # colocated: they share the trainer ranks' GPUs and placement group
                    self.engines = EngineGroup(cfg, self.plan, self.run_dir / "logs", self.trainers)
                self.engines.wait_ready()
            self.evaluator = Evaluator.from_config(cfg, eval_sets, self.engines.urls, self.tokenizer, console,
                                                   record_dir=self.run_dir / "eval")
            self.engines_started()
        self._write_process_table()
        if engines:
            self.open_weight_sync()
            if meta is not None:  # engines load the HF checkpoint; a resumed policy has moved on from it
                self.sync_weights(version=meta.step)
            elif self.plan.attach_url:
                self.adopt_attached_engines()
        self.logger = WandbLogger(cfg, wandb or self.plan.wandb, self.run_dir,
                                  resume_id=meta.wandb_run_id if meta else None)
        # again: ray.init installs its own SIGTERM handler in the driver (it aborts the process)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if meta is not None:
            console.print(f"resumed from step {meta.step} ({resume_from})")

    @property
    def loopback(self) -> bool:
        """Whether the trainer rendezvous and the weight-transfer stores listen on 127.0.0.1: a one-node job
        (``LaunchPlan.loopback``), or a cluster this process started (every process on this machine)."""
        return self.plan.loopback or self.cluster.started_here

    def engine_token(self) -> None:
        """The token every route of the run's engines demands (``r3rl.rollout.auth``): new for each launch, in this
        process's environment (every client here sends it; Ray's actors get it as an argument) and in the run
        folder's 0600 ``engine_token``. An attached engine's comes from the user's environment."""
        if self.plan.attach_url:
            return
        os.environ[auth.TOKEN_ENV] = token = auth.new_token()
        auth.write_token_file(self.run_dir, token)

    def engines_started(self) -> None:
        """Called once the engines answer, before the weight sync opens (GRPO: its rollout client)."""

    def adopt_attached_engines(self) -> None:
        """A fresh run on an attached engine that still serves weights another run labelled (any label but vLLM's
        initial one): its samples would come from that run's policy, with versions this run never published. The
        run's own initial weights are sent first, as version 0."""
        foreign = foreign_weight_labels({url: weight_version(url) for url in self.engines.urls})
        if foreign:
            named = ", ".join(f"{url} (weights labelled {label!r})" for url, label in foreign.items())
            console.print(f"[yellow]attached engine(s) {named} serve another run's weights; sending this run's "
                          "initial weights as version 0 before the first step[/]")
            self.sync_weights(version=0)

    def _write_process_table(self) -> None:
        """What this run started, by PID, so operators and tests can check that all of it is gone afterwards."""
        engines = [] if self.engines is None else \
            (self.engines.info or [{"url": u, "pid": None} for u in self.engines.urls])
        table = {
            "driver_pid": os.getpid(),
            "ray_temp_dir": str(self.cluster.temp_dir) if self.cluster.temp_dir else None,
            "trainers": self.trainers.devices,
            "engines": engines,
        }
        (self.run_dir / "processes.json").write_text(json.dumps(table, indent=2))

    def _on_sigterm(self, signum, frame) -> None:
        self.stop = True
        # a step in flight completes first (Slurm's --signal=B:TERM@120 leaves time for one step)
        console.print("[yellow]SIGTERM: finishing this step, then checkpointing[/]")

    def engine_fault(self, step: int, err: Exception) -> EngineError | None:
        """The engine fault behind ``err``, raised by step ``step``, if there is one: an engine whose node went down
        surfaces as whatever call reached it first, and an engine error may come from a route store that filled up;
        either way the error names it."""
        if dead := self.engines.dead():
            first = (str(err).splitlines() or [""])[0]
            return EngineError(f"step {step}: engine(s) {', '.join(dead)} went down ({type(err).__name__}: {first}); "
                               "this step was not saved")
        if isinstance(err, EngineError) and (store := route_store_failure(self.run_dir / "logs")):
            return EngineError(f"step {step}: {store}; this step was not saved")
        return None

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
                self.before_eval(step)
                values = {**values, **self.evaluator.evaluate(step, stop=lambda: self.stop)}
            except EvalInterrupted:
                console.print(f"[yellow]SIGTERM: eval of step {step} abandoned; it is redone after resume[/]")
                self.unlogged = dict(values)
                return
            finally:
                self.after_eval(step)
        self.logger.log(values, step=step)
        self.history.append({"step": step, **values})

    def before_eval(self, step: int) -> None:
        """Make the engines serve the weights after ``step`` (GRPO's engines always do: they sync every step)."""

    def after_eval(self, step: int) -> None:
        """Hand the devices back to training after an eval point (colocated SFT: the engines sleep again)."""

    # ------------------------------------------------------------------ weight sync
    def open_weight_sync(self) -> None:
        """Join the trainer's sender and every engine worker in one transfer group (once; ``disk`` needs none)."""
        self.weight_sync = weight_sync_backend(self.cfg)
        self.engine_set = EngineSet(self.engines.urls, self.cfg.rollout.engine.request_timeout_s)
        if self.weight_sync in ("disk", "adapter"):
            return
        self.trainers.open_weight_transfer(self.engines.urls, backend=self.weight_sync,
                                           loopback=self.loopback,
                                           timeout_s=self.cfg.rollout.engine.request_timeout_s,
                                           bucket_bytes=int(self.cfg.rollout.weight_sync.bucket_mb * (1 << 20)),
                                           shared_memory=self.cfg.rollout.weight_sync.shared_memory)

    def sync_weights(self, version: int, *, in_flight: bool = False) -> None:
        """pause (colocated: wake the sleeping engines' weights only) -> start -> one broadcast per bucket into every
        engine -> finish(version) -> (colocated: wake the KV cache) -> reset prefix cache -> resume.
        ``in_flight``: under the requests in flight, which freeze with their KV cache and continue on the new
        weights (``/pause?mode=keep``); the prefix cache is not reset (they hold its blocks): requests sent from
        then on carry the new version as their cache salt (``RolloutClient.serve_version``)."""
        asleep, self.engines_asleep = self.engines_asleep, False
        if asleep:
            self.wake_engines(["weights"])
        if self.weight_sync == "disk":  # pause, load, reset, label and resume per engine (r3rl.sync.disk)
            exported = Path(self.trainers.call("export_hf", self.run_dir / "weights"))
            for url in self.engines.urls:
                update_weights_from_hf(url, exported, version, in_flight=in_flight)
        elif self.weight_sync == "adapter":  # the adapters alone, loaded under a name per version (r3rl.sync.adapter)
            info = {"run": str(self.run_dir), "step": version}
            self.trainers.call("export_adapter", adapter_sync.adapter_folder(self.run_dir, version), info,
                               per_expert=True)
            if not asleep:  # requests in flight finish on their own adapter; sleeping engines were paused by /sleep
                self.engine_set.pause(keep=False)
            self.adapter = adapter_sync.sync_adapters(self.engines.urls, self.run_dir, version,
                                                      adapter_slots(self.cfg),
                                                      timeout_s=self.cfg.rollout.engine.request_timeout_s)
        else:
            if not asleep:  # sleeping engines were paused by /sleep
                self.engine_set.pause(keep=in_flight)
            self.trainers.send_weights(version)
        if asleep:  # the send's buckets are freed by now; their cached blocks go back before the KV cache comes
            self.wake_engines(["kv_cache"])
        if self.weight_sync != "disk":
            if not in_flight and self.weight_sync != "adapter":  # an adapter's prefix blocks are keyed by its name
                self.engine_set.reset_prefix_cache()
            self.engine_set.resume()
        self.engine_version = version

    def wake_engines(self, tags: list[str]) -> None:
        """Colocated: the trainer ranks give back what the engines are about to allocate (the optimizer state to host
        memory, the allocator's cached blocks to the driver), then the engines wake. vLLM allocates what it wakes
        with cudaMalloc: memory torch still holds cached would fail it."""
        reserved = max(self.trainers.call_all("yield_device"))
        self.handoffs.append(("yield", reserved))
        self.engine_set.wake_up(tags)
        self.handoffs.append(("wake", tuple(tags)))

    # ------------------------------------------------------------------ save / cleanup
    def data_state(self) -> dict:
        """The data sampler's state a checkpoint saves."""
        return self.dataset.state_dict()

    def save(self, step: int) -> Path:
        """Step ``step``'s checkpoint (its folder). With ``trainer.checkpoint.async_save`` the trainer ranks write it
        in the background and it is published at a later step (``poll_save``), except after the last step or
        SIGTERM, which wait for it."""
        self.finish_save()  # one background save at a time
        meta = checkpoint.CheckpointMeta(step=step, wandb_run_id=self.logger.run_id if self.logger else None,
                                         data_state=self.data_state(), weight_version=step,
                                         unlogged_metrics=self.unlogged)
        folder = checkpoint.begin(self.run_dir, step)
        self.trainers.call("save_checkpoint", folder / checkpoint.TRAINER_DIR, {})
        self.pending_save = (folder, meta)
        if not self.cfg.trainer.checkpoint.async_save or self.stop or step == self.cfg.run.num_steps:
            self.finish_save()
        return checkpoint.checkpoint_root(self.run_dir) / checkpoint.step_dir_name(step)

    def poll_save(self) -> None:
        """Publish the background save once every trainer rank finished writing it (a collective check)."""
        if self.pending_save is not None and self.trainers.call("poll_saves"):
            self._publish_save()

    def finish_save(self) -> None:
        """Wait for the background save, if any, and publish it."""
        if self.pending_save is not None:
            self.trainers.call("finish_saves")
            self._publish_save()

    def _publish_save(self) -> None:
        folder, meta = self.pending_save
        self.pending_save = None
        checkpoint.publish(self.run_dir, folder, meta, keep=self.cfg.run.keep_checkpoints)

    def cleanup(self) -> None:
        if self.pending_save is not None and self.trainers is not None:
            try:  # a save still in the background when the run ended otherwise (an error): keep it if it completes
                self.finish_save()
            except Exception as err:  # the trainer ranks themselves may be what failed
                console.print(f"[yellow]the background checkpoint was not finished: {err}[/]")
        if self.engine_set is not None:
            self.engine_set.close()
        for part in (self.engines, self.trainers):
            if part is not None:
                part.shutdown()
        if self.logger is not None:
            self.logger.finish()
        if self.cluster is not None:
            self.cluster.shutdown()

    def report(self) -> None:
        """After the run: the summary table, where the files are, the plots."""
        if self.history:
            print_summary(self.history, console=Console(width=160))
        console.print(f"run folder: {self.run_dir}")
        if (checkpoint.checkpoint_root(self.run_dir) / checkpoint.LATEST).is_file():
            from r3rl.export import command

            console.print(f"export its weights (HF): {command(self.run_dir)}", soft_wrap=True)
        if self.plan.wandb.mode != "disabled" and self.history:
            png, html = write_comparison(read_runs(self.run_dir), self.run_dir / "plots", self.panels)
            console.print(f"W&B files: {self.run_dir / 'wandb'}\nplots: {png} and {html}\n"
                          f"compare with another run: python -m r3rl.dashboard --runs {self.run_dir} <other run "
                          f"folder> --out <folder>")


def run(make: Callable[[R3RLConfig], Recipe], cfg: R3RLConfig, on_finished: Callable[[R3RLConfig], None] | None = None
        ) -> None:
    """Launch a recipe: report a run that already finished, else set up, train, clean up and report; exit 143 after
    SIGTERM (checkpoint written) and 1 after an engine failure."""
    done = finished_step(cfg)
    if done is not None:  # run.py settles this before Hydra starts; a sweep's job or an in-process caller here
        report_finished(cfg, done)
        if on_finished is not None:
            on_finished(cfg)
        return
    recipe = make(cfg)
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
    recipe.report()
    if code:
        sys.exit(code)
