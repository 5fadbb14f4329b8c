"""Config schemas, Hydra registration and the one place a composed config becomes a validated, frozen object."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from r3rl.config.schema import R3RLConfig, freeze
from r3rl.config.validate import ConfigError, unknown_keys, validate

__all__ = ["R3RLConfig", "ConfigError", "CONF_DIR", "register_configs", "load_config", "compose"]

# The repository's conf/ (r3rl is installed editable from the repository).
CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def register_configs() -> None:
    """Register the root schema under the name the primary config lists first (``r3rl_schema``)."""
    ConfigStore.instance().store(name="r3rl_schema", node=R3RLConfig)


def load_config(cfg: DictConfig) -> R3RLConfig:
    """Composed Hydra config -> validated, frozen ``R3RLConfig``; raises ConfigError naming the keys at fault."""
    extra = unknown_keys(cfg, R3RLConfig)
    if extra:
        raise ConfigError([(key, "not a key of the schema (remove it, or check its spelling)") for key in extra])
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, R3RLConfig)
    validate(typed)
    return freeze(typed)


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> R3RLConfig:
    """Compose and load a config the way ``run.py`` does, without Hydra's app (tests, tools, notebooks).

    The caller names ``parallelism=`` when it matters; otherwise the group default (``cpu``) applies.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = hydra_compose(config_name, overrides=list(overrides))
    return load_config(raw)
