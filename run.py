"""Launch an r3rl recipe.

    python run.py                                   # tiny MoE, GRPO with R3, on this machine
    python run.py model=qwen3_30b rollout=vllm_r3 parallelism=disaggregated_4p4
    python run.py ... run.dry_run=true              # print the launch plan, start nothing
    python run.py -m rollout=vllm,vllm_r3           # R3 and baseline, one run each
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from r3rl.config import ConfigError, load_config, register_configs
from r3rl.platform import default_parallelism


def _with_default_parallelism(argv: list[str]) -> list[str]:
    """Pick parallelism from the machine when the command line does not (an experiment may set it too)."""
    if any(a.split("=", 1)[0].lstrip("~+") in ("parallelism", "experiment") for a in argv[1:]):
        return argv
    if any(a in ("--help", "-h", "--info", "--cfg", "-c", "--hydra-help") for a in argv[1:]):
        return argv
    return argv + [f"parallelism={default_parallelism()}"]


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    from r3rl.launch import dry_run, launch

    try:
        cfg = load_config(raw)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if cfg.run.dry_run:
        dry_run(cfg)
    else:
        launch(cfg)


if __name__ == "__main__":
    register_configs()
    sys.argv = _with_default_parallelism(sys.argv)
    main()
