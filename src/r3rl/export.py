"""``python -m r3rl.export outputs/<run> [--step N] --out DIR [--adapter DIR]``: a run's checkpoint as an HF checkpoint
folder, and a LoRA run's adapters as a PEFT adapter folder.

The folder (safetensors, ``model.safetensors.index.json``, config, tokenizer, chat template) loads in
``transformers`` and vLLM, and ``model.checkpoint=DIR`` takes it for a new run. It is written the way the run
itself writes weights: the run's resolved config (``<run>/.hydra/config.yaml``) starts the trainer ranks with the
run's parallelism (Ray; logical GPUs on a CPU), every rank loads its own shard of the weights of checkpoint
``step_N`` (default: the latest; Megatron's distributed format, so the optimizer state is never read), and every rank
writes its own tensors bucket by bucket (``MegatronTrainer.export_hf``); rank 0 writes the index, config and
tokenizer files. No process ever holds the whole model. ``--adapter DIR`` (LoRA runs) writes the adapters alone
as ``peft`` writes them (``r3rl.train.peft_adapter``), for the base the run adapted; ``--out`` may then be left out.
Everything started here is stopped by handle before the command returns.

Not to be confused with ``r3rl.train.export``, the trainer-side bucketed HF stream this command drives.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from r3rl import checkpoint

HYDRA_CONFIG = Path(".hydra") / "config.yaml"


class ExportError(Exception):
    """A reason the export cannot run, found before anything starts (or reported after cleanup)."""


@dataclass(frozen=True)
class Source:
    run_dir: Path
    step: int
    folder: Path  # checkpoints/step_NNNNNN


def command(run_dir: str | Path, out: str = "<folder>") -> str:
    """The export command line for ``run_dir`` (what the end of a run prints)."""
    return f"python -m r3rl.export {run_dir} --out {out}"


def available_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of a run folder (meta.json and a complete trainer state), ascending."""
    root = checkpoint.checkpoint_root(run_dir)
    steps = []
    for folder in root.glob("step_*") if root.is_dir() else []:
        tail = folder.name.removeprefix("step_")
        complete = folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE
        if tail.isdigit() and (folder / checkpoint.META).is_file() and complete.is_file():
            steps.append(int(tail))
    return sorted(steps)


def find_checkpoint(run_dir: str | Path, step: int | None) -> Source:
    """The checkpoint of ``run_dir`` at ``step`` (None: the latest), or ExportError saying what is there."""
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise ExportError(f"no such run folder: {run_dir}")
    steps = available_steps(run_dir)
    if not steps:
        raise ExportError(f"{run_dir} has no checkpoint (nothing under {checkpoint.checkpoint_root(run_dir)}); a run "
                          f"writes one every run.save_every steps and at its end")
    if step is None:
        try:
            latest = checkpoint.latest(run_dir)
        except FileNotFoundError as err:
            raise ExportError(f"{err}; choose one of the complete steps with --step: "
                              f"{', '.join(map(str, steps))}") from None
        step = checkpoint.read_meta(latest).step if latest is not None else steps[-1]
    if step not in steps:
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; steps available: "
                          f"{', '.join(map(str, steps))}")
    return Source(run_dir, step, checkpoint.checkpoint_root(run_dir) / checkpoint.step_dir_name(step))


def check_out(out: str | Path) -> Path:
    """``--out``: a folder that does not exist yet or is empty (an export never overwrites files)."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new folder or remove it")
    return out


def load_run_config(run_dir: Path):
    """The run's resolved config (``.hydra/config.yaml``, written by ``run.py``), validated as at launch."""
    from omegaconf import OmegaConf

    from r3rl.config import ConfigError, load_config
    from r3rl.config.schema import R3RLConfig

    path = run_dir / HYDRA_CONFIG
    if not path.is_file():
        raise ExportError(f"{run_dir} has no {HYDRA_CONFIG} (the config run.py writes into a run folder): not a run "
                          f"folder of `python run.py`")
    try:
        raw = OmegaConf.merge(OmegaConf.structured(R3RLConfig), OmegaConf.load(path))
        return load_config(raw)
    except ConfigError as err:
        raise ExportError(f"{path} is not a valid config today: {err}") from None
    except Exception as err:  # omegaconf: a key the schema no longer has, a value of the wrong type
        raise ExportError(f"{path} cannot be read as an r3rl config: {err}") from None


def check_format(source: Source) -> dict:
    """The trainer state must be in the distributed format this version reads (any layout: the run's own
    parallelism loads it, resharded where it differs)."""
    try:
        return checkpoint.read_complete(source.folder / checkpoint.TRAINER_DIR)
    except checkpoint.CheckpointFormatError as err:
        raise ExportError(str(err)) from None


def check_adapter(cfg, adapter: Path | None) -> None:
    """``--adapter`` needs a run that trained adapters."""
    if adapter is not None and cfg.trainer.lora.rank <= 0:
        raise ExportError(f"--adapter: {cfg.run.name} trained no adapters (trainer.lora.rank=0): export the model "
                          "with --out")


def export(cfg, source: Source, out: Path | None, console, adapter: Path | None = None,
           adapter_info: dict | None = None) -> list[Path]:
    """Start the run's trainer ranks, load ``source`` into them, write ``out`` (the merged HF model) and/or
    ``adapter`` (the PEFT adapter folder); stop everything started here. Returns the folders written."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from r3rl.orchestration.groups import TrainerGroup
    from r3rl.orchestration.ray_cluster import start_or_attach
    from r3rl.plan import build_plan

    plan = build_plan(cfg)
    ranks = len(plan.placement.trainer)
    cluster = trainers = None
    stages = [("ray", "Ray" + (" (logical GPUs)" if plan.placement.logical_gpus else "")),
              ("ranks", f"{ranks} trainer rank(s), parallelism={cfg.parallelism.name}"),
              ("load", f"checkpoint of step {source.step} into every rank"),
              *([("write", f"HF checkpoint, rank by rank: {out}")] if out is not None else []),
              *([("adapter", f"PEFT adapter folder: {adapter}")] if adapter is not None else []),
              ("stop", "stopping the trainer ranks and Ray")]
    with Progress(SpinnerColumn(finished_text="[green]done"), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks = {key: progress.add_task(text, total=1, start=False) for key, text in stages}

        def stage(key: str) -> None:
            progress.start_task(tasks[key])

        def done(key: str) -> None:
            progress.update(tasks[key], completed=1)
            progress.stop_task(tasks[key])

        try:
            stage("ray")
            cluster = start_or_attach(cfg, plan)
            done("ray")
            stage("ranks")
            trainers = TrainerGroup(cfg, plan, loopback=cluster.started_here)
            done("ranks")
            stage("load")
            trainers.call("load_checkpoint", source.folder / checkpoint.TRAINER_DIR, optimizer=False)
            done("load")
            written = []
            if out is not None:
                stage("write")
                written.append(Path(trainers.call("export_hf", out)))
                done("write")
            if adapter is not None:
                stage("adapter")
                written.append(Path(trainers.call("export_adapter", adapter, adapter_info or {})))
                done("adapter")
        finally:
            stage("stop")
            if trainers is not None:
                trainers.shutdown()
            if cluster is not None:
                cluster.shutdown()
            done("stop")
    return written


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m r3rl.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the run folder (run.output_dir, e.g. outputs/tiny_moe-cpu-vllm_r3)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    ap.add_argument("--out", default=None, help="the HF folder to write (new or empty): the model, LoRA merged in")
    ap.add_argument("--adapter", default=None, help="LoRA runs: the PEFT adapter folder to write (new or empty)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console

    console = Console(stderr=False)
    try:
        if args.out is None and args.adapter is None:
            raise ExportError("nothing to write: give --out (the HF model) and/or --adapter (a LoRA run's adapters)")
        source = find_checkpoint(args.run, args.step)
        out = check_out(args.out) if args.out is not None else None
        adapter = check_out(args.adapter) if args.adapter is not None else None
        if out is not None and out == adapter:
            raise ExportError(f"--out and --adapter are the same folder ({out}): give each its own")
        cfg = load_run_config(source.run_dir)
        check_adapter(cfg, adapter)
        complete = check_format(source)
        from r3rl.launch import check_machine
        from r3rl.platform import visible_gpu_count

        problem = check_machine(cfg, visible_gpu_count())
        if problem:
            raise ExportError(problem)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    console.print(f"exporting {cfg.run.name}, step {source.step} ({source.folder})")
    started = time.perf_counter()
    from r3rl.orchestration.groups import PlacementTimeout
    from r3rl.orchestration.ray_cluster import ClusterError

    try:
        info = {"run": str(source.run_dir), "step": source.step, "lora": complete.get("lora")}
        export(cfg, source, out, console, adapter, info)
    except (ClusterError, PlacementTimeout) as err:  # the machine cannot hold the run's trainer ranks
        print(f"error: {err}", file=sys.stderr)
        return 1
    took = f"{time.perf_counter() - started:.1f} s"
    if out is not None:
        console.print(f"[bold]HF checkpoint of step {source.step} written in {took}: {out}[/]\nload it with "
                      "transformers (AutoModelForCausalLM.from_pretrained) or vLLM, or start a run from it: "
                      f"python run.py model.checkpoint={out}", soft_wrap=True)
    if adapter is not None:
        console.print(f"[bold]PEFT adapter of step {source.step} written in {took}: {adapter}[/]\nload it onto the "
                      "base with PeftModel.from_pretrained(model, DIR) or model.load_adapter(DIR) (peft >= 0.20)",
                      soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
