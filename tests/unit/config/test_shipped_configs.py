"""Every shipped config composes, validates and is documented; schema and YAML stay in step."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from dataclasses import fields, is_dataclass

import pytest
from omegaconf import OmegaConf

from r3rl.config import CONF_DIR
from r3rl.preflight import compose
from r3rl.config.schema import GROUP_SCHEMAS, R3RLConfig

GROUPS = sorted(GROUP_SCHEMAS)
# the eval sets that take a path (AIME 2024, MATH-500) are composed around this small file of the same shape
EVAL_SAMPLE = Path(__file__).parent / "data" / "math_eval_sample.jsonl"
YAMLS = sorted(p for p in CONF_DIR.rglob("*.yaml") if "hydra" not in p.relative_to(CONF_DIR).parts)


GPU_LAYOUT = {"qwen3_30b": ["parallelism=disaggregated_4p4"], "glm45_air": ["experiment=glm45_air_r3_2n"],
              "moonlight_16b": ["experiment=moonlight_16b_r3_4p4"]}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def overrides_for(group: str, option: str) -> list[str]:
    """A valid combination around one option: GPU layouts for the real models, GPU model for GPU layouts is not
    needed."""
    ov = [f"{group}={option}"]
    if group == "model" and option in GPU_LAYOUT:
        ov += GPU_LAYOUT[option]
    elif group != "parallelism":
        ov.append("parallelism=cpu")
    if group == "eval" and option != "arithmetic":
        ov += [f"eval.sets.{option}.path={EVAL_SAMPLE}", f"eval.sets.{option}.sampling.top_p=1.0",
               f"eval.sets.{option}.sampling.max_tokens=16"]
    return ov


def schema_keys(schema: type, prefix: str = "") -> set[str]:
    keys = set()
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        if f.name.startswith("_"):
            continue
        if is_dataclass(hints[f.name]):
            keys |= schema_keys(hints[f.name], f"{prefix}{f.name}.")
        elif typing.get_origin(hints[f.name]) is dict and is_dataclass(typing.get_args(hints[f.name])[1]):
            # named entries (eval.sets.<name>): each entry spells out every field of the entry schema
            keys |= schema_keys(typing.get_args(hints[f.name])[1], f"{prefix}{f.name}.*.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def yaml_keys(node, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in node.items():
        if k == "defaults":
            continue
        # env.environment holds the arguments of a user's class (its _target_): free-form, like extra_env
        if isinstance(v, dict) and v and k != "environment" and \
                not prefix.endswith(("extra_env.", "transformer_overrides.")):
            # named entries are compared with their schema under one wildcard name
            keys |= yaml_keys(v, f"{prefix}*." if prefix.endswith("sets.") else f"{prefix}{k}.")
        else:
            keys.add(f"{prefix}{k}")
    return keys


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose(overrides_for(group, option))
    assert isinstance(cfg, R3RLConfig)
    assert getattr(cfg, group).name == option


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_validates(experiment):
    cfg = compose([f"experiment={experiment}"])
    assert cfg.parallelism.device == "cuda", "experiments are GPU recipes"
    assert cfg.run.name == f"{cfg.model.name}-{cfg.parallelism.name}-{cfg.rollout.name}"


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_group_yaml_has_every_schema_key_and_no_other(group, option):
    """Nothing shipped needs `+key=`: each option spells out every field of its schema (verl#7430's drift)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    if global_package(CONF_DIR / group / f"{option}.yaml"):  # its group's keys under the group's name (env=...)
        raw = raw[group]
    parent = [d for d in raw.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    present = yaml_keys(raw)
    for base in parent:  # an option that extends another (vllm_r3 -> vllm) inherits the base's keys
        present |= yaml_keys(OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{base}.yaml")))
    expected = schema_keys(GROUP_SCHEMAS[group])
    assert present - expected == set(), f"{group}/{option}.yaml has keys the schema lacks"
    assert expected - present == set(), f"{group}/{option}.yaml lacks schema keys"


def global_package(path: Path) -> bool:
    return path.read_text().startswith("# @package _global_")


def test_overlays_only_set_schema_keys():
    """Fails if an overlay (scale, experiment, or a group option in the global package, such as env=calculator
    bringing its task) set a key the schema lacks."""
    allowed = schema_keys(R3RLConfig)
    for path in YAMLS:
        if path.parent.name not in ("scale", "experiment") and path.name != "config.yaml" and \
                not global_package(path):
            continue
        raw = OmegaConf.to_container(OmegaConf.load(path))
        raw.pop("hydra", None)
        unknown = {k for k in yaml_keys(raw) if k not in allowed}
        assert not unknown, f"{path.relative_to(CONF_DIR)} sets keys outside the schema: {unknown}"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_file_opens_with_its_command_and_every_key_has_a_comment(path):
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert any("python run.py" in h or "sbatch" in h for h in header), f"{path.name}: header must give the command"
    in_defaults = False
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w]*):", line)
        if not m:
            continue
        key, indent = m.group(2), m.group(1)
        if key == "defaults" and not indent:
            in_defaults = True
            continue
        if in_defaults and indent:
            continue
        in_defaults = False
        if key == "hydra" and not indent:
            continue
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        assert prev.strip().startswith("#"), (
            f"{path.name}:{i + 1}: key {key!r} has no comment above it"
        )




def test_frozen_after_load():
    cfg = compose(["parallelism=cpu"])
    with pytest.raises(AttributeError, match="frozen"):
        cfg.rollout.sampling.temperature = 0.0  # type: ignore[misc]
