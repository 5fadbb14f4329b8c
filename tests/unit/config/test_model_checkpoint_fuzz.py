"""A ``model.checkpoint`` folder's ``config.json`` is outside data (a download, another run's export, a hand edit):
whatever it holds, the preflight accepts it or refuses naming ``model.checkpoint`` and the file, never another
exception. Reproductions first, then Hypothesis over the fields the checks read."""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3rl.preflight import checkpoint_problems

FUZZ = settings(max_examples=400, derandomize=True, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FOLDER = Path(tempfile.mkdtemp(prefix="r3rl-model-fuzz-"))
READ = ("model_type", "num_hidden_layers", "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace",
        "moe_layer_freq", "n_routed_experts", "num_experts", "num_local_experts", "hidden_size", "head_dim",
        "num_experts_per_tok", "moe_intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads")


@functools.cache
def model():
    from r3rl.config import compose

    m = compose(["model=tiny_moe", "parallelism=cpu", f"run.output_dir={FOLDER / 'run'}"]).model
    return dataclasses.replace(m, checkpoint=str(FOLDER), generate_if_missing=False)


def tiny_config() -> dict:
    """The fields of the generated tiny model's config.json that the checks read."""
    return {"model_type": "qwen3_moe", "num_hidden_layers": model().num_layers, "num_experts": model().num_experts,
            "mlp_only_layers": [], "decoder_sparse_step": 1}


def problems_for(text: str) -> list[tuple[str, str]]:
    (FOLDER / "config.json").write_text(text)
    found = checkpoint_problems(model())
    for key, reason in found:
        assert key == "model.checkpoint" and str(FOLDER / "config.json") in reason, (key, reason)
    return found


@pytest.mark.parametrize("text", ["[1, 2]", "3", "null", '"qwen3_moe"', "{", "\x00",
                                  json.dumps({**{"model_type": "qwen3_moe", "num_hidden_layers": 4},
                                              "decoder_sparse_step": 0}),
                                  json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4,
                                              "mlp_only_layers": 5}),
                                  json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4,
                                              "mlp_only_layers": [[0]]}),
                                  "[" * 100_000 + "]" * 100_000])
def test_reproductions_are_refused_by_name(text):
    """Each crashed the check before (a list has no .get, a zero step divides by zero, an int or a nested list is no
    set of layers, deep nesting overflows the parser). Fails if one raises instead of naming model.checkpoint."""
    assert problems_for(text)


def test_the_tiny_models_own_fields_pass():
    """The control: the generated model's config is accepted."""
    assert problems_for(json.dumps(tiny_config())) == []


values = st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | st.integers() | st.floats() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3), max_leaves=8)


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(READ), values, max_size=8), keep=st.booleans())
def test_any_config_json_is_accepted_or_refused_by_name(fields, keep):
    """Fails if any config.json makes the check raise, or refuse naming another key or file."""
    base = tiny_config() if keep else {}
    problems_for(json.dumps({**base, **fields}, allow_nan=True))
