"""The locally generated tiny Qwen3-MoE: deterministic, cached by config, never overwriting a real checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from r3rl.models.tiny_moe import MARKER, ensure_checkpoint


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def shrink(model, path, **changes):
    """A smaller tiny model (2 layers) so generation stays quick; frozen configs are copied, not mutated."""
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    fields.update(num_layers=2, checkpoint=str(path), **changes)
    return type(model)(**fields)


def test_same_config_same_bytes_and_a_changed_config_regenerates(tmp_path, tiny_cfg):
    a = ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "a"))
    b = ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "b"))
    assert digest(a) == digest(b)
    first = digest(a)
    assert digest(ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "a"))) == first  # cached, not rewritten
    reseeded = ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "a", init_seed=5))
    assert digest(reseeded) != first


def test_a_checkpoint_of_someone_elses_is_used_as_is(tmp_path, tiny_cfg):
    made = ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "ckpt"))
    (made / MARKER).unlink()  # now it looks like a checkpoint r3rl did not make
    before = digest(made)
    ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "ckpt", init_seed=9))
    assert digest(made) == before


def test_missing_real_checkpoint_names_the_key(tmp_path, tiny_cfg):
    model = shrink(tiny_cfg.model, tmp_path / "nothing", generate_if_missing=False)
    with pytest.raises(FileNotFoundError, match="model.checkpoint="):
        ensure_checkpoint(model)


def test_no_embedding_row_is_zero(tmp_path, tiny_cfg):
    # a zero row (HF's init of the pad token) blows the gradient up 1/sqrt(rms_norm_eps)-fold when it is sampled
    from safetensors.numpy import load_file

    made = ensure_checkpoint(shrink(tiny_cfg.model, tmp_path / "m"))
    rows = np.linalg.norm(load_file(made / "model.safetensors")["model.embed_tokens.weight"], axis=1)
    assert rows.min() > 0.5 * tiny_cfg.model.init_std * tiny_cfg.model.hidden_size ** 0.5, rows.argmin()
