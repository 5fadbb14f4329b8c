"""Config overrides are outside data: any number for any numeric key of the schema either loads into a config that
plans (placement, Megatron settings, memory, the dry run's description) or is refused with ``ConfigError`` naming
keys, before any process starts; never another exception (issue 59). Hydra composes each base once; each example
sets one key on a copy, as an override would, and loads it. A fixed example budget, derandomised."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from r3rl.config import ConfigError, load_config
from r3rl.config.schema import GROUP_SCHEMAS, R3RLConfig

FUZZ = settings(max_examples=600, derandomize=True, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.too_slow])
BASES = {"cpu": ["parallelism=cpu"],
         "qwen3_30b_4p4": ["model=qwen3_30b", "rollout=vllm_r3", "parallelism=disaggregated_4p4"]}


def numeric_keys(schema: type, prefix: str = "") -> dict[str, type]:
    """Dotted key -> int or float, for every numeric leaf of the schema (Optional ones included)."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
        key = f"{prefix}{f.name}"
        if base in (int, float):
            out[key] = base
        elif dataclasses.is_dataclass(base):
            out.update(numeric_keys(base, f"{key}."))
    return out


KEYS = numeric_keys(R3RLConfig)


@functools.cache
def raw(base: str):
    """The base composed by Hydra once (not a fixture: Hypothesis would print the whole config with each example)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from r3rl.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return hydra_compose("config", overrides=BASES[base])


def test_the_schema_has_the_numeric_keys_the_fuzz_covers():
    """Fails if the walk over the schema stops finding its numeric keys (the fuzz would cover nothing)."""
    assert len(KEYS) > 100 and KEYS["trainer.lr"] is float and KEYS["run.num_steps"] is int
    assert set(GROUP_SCHEMAS) <= {k.split(".")[0] for k in KEYS} | {"recipe", "reward", "eval", "data", "replay", "logger"}


@pytest.mark.parametrize("override, key", [
    ("trainer.adam_eps=nan", "trainer.adam_eps"), ("algorithm.kl_coef=nan", "algorithm.kl_coef"),
    ("rollout.sampling.temperature=inf", "rollout.sampling.temperature"),
    ("model.num_layers=0", "model.num_layers"), ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
    ("parallelism.gpu_memory_gib=1e300", "parallelism.gpu_memory_gib"),
    ("rollout.weight_sync.bucket_mb=inf", "rollout.weight_sync.bucket_mb"),
    ("parallelism.gpus_per_node=2147483648", "parallelism.gpus_per_node"),
    ("parallelism.nnodes=170829839", "parallelism.nnodes"),
])
def test_what_the_fuzz_found_is_refused_naming_the_key(compose_cfg, override, key):
    """Each of these was accepted (NaN, infinity) or raised ZeroDivisionError/OverflowError or never finished
    planning. Fails if the key's check goes."""
    with pytest.raises(ConfigError) as info:
        compose_cfg("model=qwen3_30b", "rollout=vllm_r3", "parallelism=disaggregated_4p4", override)
    assert key in [k for k, _ in info.value.problems], info.value.problems


INTS = st.one_of(st.integers(-3, 3), st.sampled_from([-2 ** 31, 2 ** 31, 2 ** 62, 10 ** 30]), st.integers())
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1e300]),
                   st.floats(-2, 2))


def load(raw, key: str, value):
    cfg = raw.copy()
    OmegaConf.update(cfg, key, value, merge=False)
    return load_config(cfg)


@FUZZ
@given(base=st.sampled_from(sorted(BASES)), key=st.sampled_from(sorted(KEYS)), data=st.data())
def test_any_number_for_any_numeric_key_loads_and_plans_or_is_refused_by_key(base, key, data):
    """Found: NaN or infinity accepted for 23 float keys (NaN passes a range check written as ``not (x < low)``;
    ``trainer.adam_eps=nan`` reached the optimizer), ZeroDivisionError for ``model.num_layers``/``head_dim``/
    ``num_query_groups``/``trainer.micro_batch_size`` = 0, OverflowError in the memory plan for a GiB budget of
    1e300 or an infinite ``bucket_mb``, and a plan that never finished for ``parallelism.gpus_per_node=2**31`` or
    ``nnodes=170829839``. Fails if ``number_problems`` or the nnodes rule goes."""
    from omegaconf.errors import ValidationError

    from r3rl.config.validate import float_leaves
    from r3rl.plan import build_plan, describe
    from r3rl.preflight import memory_problems

    value = data.draw(INTS if KEYS[key] is int else st.one_of(FLOATS, INTS.filter(lambda v: abs(v) < 2 ** 53)))
    try:
        cfg = load(raw(base), key, value)
    except ConfigError as err:
        assert err.problems and all(isinstance(k, str) and k for k, _ in err.problems)
        return
    except ValidationError:  # OmegaConf's own refusal of a value the key's type cannot hold (past int64)
        assert KEYS[key] is int and abs(value) >= 2 ** 63, (key, value)
        return
    assert all(math.isfinite(v) for _, v in float_leaves(cfg)), (key, value)
    plan = build_plan(cfg)
    describe(cfg, plan)
    memory_problems(cfg)
