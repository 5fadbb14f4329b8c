"""``python -m r3rl.doctor [the run's Hydra overrides]``: start the run's stack briefly and check the R3 contract on
it (``recipes/doctor.py``); a table, ``doctor.json`` and ``doctor.md`` in ``<run.output_dir>/doctor``; exit 1 when
a check failed, 2 when the config is refused (before anything starts)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from r3rl.config import ConfigError, compose, register_configs
from r3rl.config.schema import freeze
from r3rl.launch import check_machine
from r3rl.platform import visible_gpu_count, with_default_parallelism
from r3rl.preflight import preflight


def doctor_config(overrides: Sequence[str]):
    """The run's config, checked as ``run.py`` checks it, then made the doctor's: its own folder beside the run's,
    no W&B run, no eval points and no resume (it trains one step it never saves)."""
    cfg = compose(with_default_parallelism(list(overrides)))
    problem = check_machine(cfg, visible_gpu_count())
    if problem:
        raise ConfigError([("parallelism", problem)])
    preflight(cfg, launching=True)
    run = dataclasses.replace(cfg.run, output_dir=str(Path(cfg.run.output_dir) / "doctor"), eval_every=0,
                              resume=False)
    logger = dataclasses.replace(cfg.logger, wandb=dataclasses.replace(cfg.logger.wandb, mode="disabled"))
    return freeze(dataclasses.replace(cfg, run=run, logger=logger))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    try:
        cfg = doctor_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from r3rl.doctor.report import write
    from recipes.doctor import run_doctor

    results = run_doctor(cfg)
    command = shlex.join(["python", "-m", "r3rl.doctor", *args])
    return write(results, Path(cfg.run.output_dir), command, Console(width=160))


if __name__ == "__main__":
    sys.exit(main())
