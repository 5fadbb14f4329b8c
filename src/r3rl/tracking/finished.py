"""A run that already reached ``run.num_steps``: recognised from its checkpoint before anything starts.

Relaunching the same command would otherwise start Ray, the trainer, an engine and a new W&B segment only to train
nothing. Instead the run's summary table is printed from its W&B files, with where its files are and how to go on.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from r3rl import checkpoint
from r3rl.config.schema import R3RLConfig
from r3rl.tracking.offline_reader import WandbFileError, read_runs
from r3rl.tracking.summary import print_summary


def finished_step(cfg: R3RLConfig) -> int | None:
    """The step the run in ``run.output_dir`` completed when it is ``run.num_steps`` or more (and the run would
    resume from it), else None."""
    if not cfg.run.resume:
        return None
    folder = checkpoint.latest(Path(cfg.run.output_dir))
    if folder is None:
        return None
    meta = checkpoint.read_meta(folder)
    if meta.unlogged_metrics is not None:  # SIGTERM interrupted the last step's eval: the relaunch redoes it
        return None
    return meta.step if meta.step >= cfg.run.num_steps else None


def report_finished(cfg: R3RLConfig, step: int, console: Console | None = None) -> None:
    """Print the finished run's summary, where its files are, and how to continue or start over."""
    console = console or Console(width=160)
    run_dir = Path(cfg.run.output_dir).resolve()
    try:
        runs = read_runs(run_dir / "wandb") if (run_dir / "wandb").is_dir() else []
    except WandbFileError as err:
        runs = []
        console.print(f"[yellow]its W&B files cannot be read: {err}[/]")
    if len(runs) == 1:
        print_summary(runs[0].history, console=console, title=f"r3rl run summary, {cfg.run.name}")
    console.print(f"[bold]{cfg.run.name} already finished: step {step} of run.num_steps={cfg.run.num_steps}; "
                  f"nothing started.[/]")
    console.print(f"run folder: {run_dir}")
    if runs:
        console.print(f"W&B files: {run_dir / 'wandb'}")
    plots = run_dir / "plots" / "comparison.png"
    if plots.is_file():
        console.print(f"plots: {plots} and {plots.with_suffix('.html')}")
    console.print(f"continue it: the same command with run.num_steps=N for any N > {step} (e.g. "
                  f"make run ARGS=\"run.num_steps={2 * step}\"); start over: remove {run_dir} or choose another "
                  f"run.output_dir=...")
