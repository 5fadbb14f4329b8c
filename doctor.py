"""``python doctor.py [the run's Hydra overrides]``: start the run's stack briefly and check the R3 contract on
it (``recipes/doctor.py``); a table, ``doctor.json`` and ``doctor.md`` in ``<run.output_dir>/doctor``; exit 1 when
a check failed, 2 when the config is refused (before anything starts).

``python doctor.py --slice [overrides]``: the same on the run's model cut to 2 layers of random weights
(``r3rl.doctor.slice``), a go/no-go in minutes.

``python doctor.py --trace <run folder>/trace``: a run's route trace (``debug.route_trace``) read back, naming
the first boundary where a sample's tokens or routes changed.

It sits beside ``run.py`` for the same reason: both start a recipe, and the library under ``src/`` never imports
``recipes/`` (docs/development.md).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.errors import HydraException
from rich.console import Console

from r3rl.config import ConfigError, compose, hydra_error, register_configs
from r3rl.config.modes import replay_mode
from r3rl.config.schema import freeze
from r3rl.doctor.slice import with_slice
from r3rl.launch import check_machine
from r3rl.platform import visible_gpu_count, with_default_parallelism
from r3rl.preflight import preflight


def doctor_config(overrides: Sequence[str], *, cut: bool = False):
    """The run's config (``cut``: its slice's, ``r3rl.doctor.slice``), checked as ``run.py`` checks it, then made the
    doctor's: its own folder beside the run's, no W&B run, no eval points and no resume (it trains one step it never
    saves)."""
    overrides = with_default_parallelism(list(overrides))
    cfg = compose(with_slice(overrides, compose) if cut else overrides)
    problem = check_machine(cfg, visible_gpu_count())
    if problem:
        raise ConfigError([("parallelism", problem)])
    preflight(cfg, launching=True)
    run = dataclasses.replace(cfg.run, output_dir=str(Path(cfg.run.output_dir) / "doctor"), eval_every=0,
                              resume=False)
    logger = dataclasses.replace(cfg.logger, wandb=dataclasses.replace(cfg.logger.wandb, mode="disabled"))
    # the trace of the doctor's batch, where there are routes to trace (validated as a run's would be)
    trace = cfg.recipe.name == "grpo" and replay_mode(cfg) == "r3"
    debug = dataclasses.replace(cfg.debug, route_trace=trace)
    return freeze(dataclasses.replace(cfg, run=run, logger=logger, debug=debug))


def check_trace(folder: Path, console: Console) -> int:
    """``--trace DIR``: a run's trace (``debug.route_trace``) read back; 1 when a sample changed on its way."""
    from r3rl.route_trace import check

    report = check(folder)
    if not report.samples:
        print(f"error: no trace in {folder} (step_*.jsonl files; a run writes them with debug.route_trace=true)",
              file=sys.stderr)
        return 2
    console.print(f"{report.steps} steps, {report.samples} samples traced through {' -> '.join(report.boundaries)}")
    for found in report.breaks[:20]:
        console.print(f"[red]{found}[/]")
    if report.breaks:
        console.print(f"[red]{len(report.breaks)} of {report.samples} samples changed on their way[/]")
        return 1
    console.print("[green]every sample identical at every boundary[/]")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cut = args[:1] == ["--slice"]
    if cut:
        args = args[1:]
    if args[:1] == ["--trace"]:
        if len(args) != 2:
            print("usage: python doctor.py --trace <run folder>/trace", file=sys.stderr)
            return 2
        return check_trace(Path(args[1]), Console(width=160))
    register_configs()
    try:
        cfg = doctor_config(args, cut=cut)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except HydraException as err:  # an override Hydra cannot apply, refused as run.py refuses it
        print(f"error: {hydra_error(err)}", file=sys.stderr)
        return 2
    from r3rl.doctor.report import write
    from recipes.doctor import run_doctor

    results = run_doctor(cfg)
    command = shlex.join(["python", "doctor.py", *(["--slice"] if cut else []), *args])
    return write(results, Path(cfg.run.output_dir), command, Console(width=160))


if __name__ == "__main__":
    sys.exit(main())
