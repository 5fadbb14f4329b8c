"""Launch an r3rl recipe.

    python run.py                                   # tiny MoE, GRPO with R3, on this machine
    python run.py model=qwen3_30b rollout=vllm_r3 parallelism=disaggregated_4p4
    python run.py ... run.dry_run=true              # print the launch plan, start nothing
    python run.py -m rollout=vllm,vllm_r3           # R3 and baseline, one run each

A single run is composed and checked (``r3rl.config``'s schema and rules, then ``r3rl.preflight``'s files, environment
and memory plan) before Hydra's app starts, because the app writes ``.hydra/`` and ``run.log``
into the run folder first: a dry run, a refused config and a run that already finished write nothing there.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from r3rl.config import ConfigError, compose, hydra_error, load_config, register_configs, with_named_files
from r3rl.preflight import preflight
from r3rl.platform import with_default_parallelism

# flags of Hydra's app (multirun, --cfg, --help, ...): those command lines go to the app unchecked
_APP_FLAG = "-"


def settle_before_start(argv: list[str]) -> None:
    """Exit here when the single run ``argv`` describes needs no run folder: a dry run (print the plan), a config
    or machine that is refused (exit 2), or a run that already reached ``run.num_steps`` (print its summary)."""
    if any(a.startswith(_APP_FLAG) for a in argv[1:]):
        return
    from hydra.errors import HydraException

    from r3rl.launch import check_machine, dry_run
    from r3rl.platform import visible_gpu_count
    from r3rl.tracking.finished import finished_step, report_finished

    try:
        cfg = compose(argv[1:])
        # a machine that cannot run the layout at all is the first thing to say (before its files and disk)
        problem = None if cfg.run.dry_run else check_machine(cfg, visible_gpu_count())
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)
        # a launch needs its files here; a dry run plans one elsewhere, where they may be mounted
        preflight(cfg, launching=not cfg.run.dry_run)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except HydraException as err:  # a misspelt key, an option that does not exist: refused like any config
        print(f"error: {hydra_error(err)}", file=sys.stderr)
        sys.exit(2)
    if cfg.run.dry_run:
        dry_run(cfg)
        sys.exit(0)
    step = finished_step(cfg)
    if step is not None:
        report_finished(cfg, step)
        sys.exit(0)


def launch(cfg) -> None:
    """Start ``recipes/<recipe.name>.py`` on the validated ``cfg``, on a machine that can run its layout."""
    import importlib

    from r3rl.launch import check_machine, launch_warnings
    from r3rl.platform import visible_gpu_count

    problem = check_machine(cfg, visible_gpu_count())
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    for warning in launch_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    name = cfg.recipe.name  # validated: grpo or sft
    try:
        module = importlib.import_module(f"recipes.{name}")
    except ImportError as err:
        print(f"error: the {name} recipe (recipes/{name}.py) cannot be imported ({err}); "
              "inspect the launch with run.dry_run=true", file=sys.stderr)
        sys.exit(2)
    module.run_recipe(cfg)


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from r3rl.launch import dry_run

    try:
        cfg = preflight(load_config(raw, HydraConfig.get().overrides.task), launching=not raw.run.dry_run)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if cfg.run.dry_run:
        dry_run(cfg)
    else:
        launch(cfg)


if __name__ == "__main__":
    register_configs()
    # a file named on the command line is the user's own: its generation goes off there (r3rl.config.intent)
    sys.argv = sys.argv[:1] + with_named_files(with_default_parallelism(sys.argv[1:]))
    settle_before_start(sys.argv)
    main()
