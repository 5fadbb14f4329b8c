"""Config schemas, Hydra registration and the one place a composed config becomes a validated, frozen object."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from r3rl.config.intent import named_file_problems, with_named_files
from r3rl.config.schema import R3RLConfig, freeze
from r3rl.config.validate import ConfigError, near, schema_keys, unknown_keys, validate

__all__ = ["R3RLConfig", "ConfigError", "CONF_DIR", "register_configs", "load_config", "compose", "hydra_error",
           "with_named_files"]

# The repository's conf/ (r3rl is installed editable from the repository).
CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def register_configs() -> None:
    """Register the root schema under the name the primary config lists first (``r3rl_schema``)."""
    ConfigStore.instance().store(name="r3rl_schema", node=R3RLConfig)


def load_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> R3RLConfig:
    """Composed Hydra config -> validated, frozen ``R3RLConfig``; raises ConfigError naming the keys at fault.
    ``overrides``: the command line it was composed from, which says which files are the user's own."""
    extra = unknown_keys(cfg, R3RLConfig)
    if extra:
        keys = schema_keys()
        raise ConfigError([(key, f"not a key of the config{near(key, keys)}: remove it, or check its spelling")
                           for key in extra])
    named = named_file_problems(cfg, overrides)
    if named:
        raise ConfigError(named)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, R3RLConfig)
    validate(typed)
    return freeze(typed)


def hydra_error(err: Exception) -> ConfigError:
    """Hydra's refusal of a command line (an override of a key the config lacks, a group option that does not
    exist, a value of the wrong type) as r3rl's own: the key at fault, the near key or the options, and no hint to
    append a key with ``+`` (r3rl refuses keys outside its schema)."""
    import re

    text = str(err)
    key = re.search(r"Could not override '([^']+)'", text)
    if key:
        return ConfigError([(key[1], f"not a key of the config{near(key[1], schema_keys())}")])
    option = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if option:
        group, name = option[1], option[2]
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return ConfigError([(group, f"{group}={name}: no such option{near(name, choices)}; "
                                    f"choose from {', '.join(choices)}")])
    cause = str(err.__cause__ or "")
    typed = re.search(r"full_key: (\S+)", cause)
    if typed:  # a value of the wrong type: omegaconf's first line says which
        return ConfigError([(typed[1], cause.splitlines()[0])])
    said = " ".join(f"{text} {cause}".split()) or type(err).__name__
    return ConfigError([("command line", said)])


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> R3RLConfig:
    """Compose and load a config the way ``run.py`` does, without Hydra's app (tests, tools, notebooks).

    The caller names ``parallelism=`` when it matters; otherwise the group default (``cpu``) applies. A file named
    here is the user's own, as on ``run.py``'s command line (``r3rl.config.intent``).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = with_named_files(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = hydra_compose(config_name, overrides=overrides)
    return load_config(raw, overrides)
