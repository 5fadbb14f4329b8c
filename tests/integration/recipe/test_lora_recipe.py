"""``python run.py trainer.lora.rank=8``: LoRA GRPO on the real CPU stack, the adapted weights merged into every
weight sync, R3 exact, and the run's checkpoint exported as a merged HF model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from r3rl import metrics as M
from r3rl.config import compose
from r3rl.models.tiny_moe import ensure_checkpoint

from .conftest import REPO, assert_nothing_left, run_recipe, wandb_runs
from .test_grpo_recipe import train_rows

pytestmark = pytest.mark.integration

LORA = ("trainer.lora.rank=8", "trainer.lr=5e-3")


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_lora_run_replays_exactly_and_exports_the_merged_model(tmp_path):
    """Two steps with rank-8 adapters: 0 mismatched replay rows on every step, replay lowers the mismatch on the
    same batches, and ``python -m r3rl.export`` of the run's checkpoint writes an HF model whose attention and expert
    weights differ from the base checkpoint's (the adapters merged in) while the routers, norms and embeddings are
    the base's bit for bit. Fails if the weight sync or the export sent the frozen base, if a router or a norm
    trained, or if LoRA broke replay."""
    run_dir = tmp_path / "lora"
    out = run_recipe(run_dir, *LORA, "run.num_steps=2", "run.eval_every=0", "run.save_every=2")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = train_rows(wandb_runs(run_dir)[0])
    assert len(rows) == 2 and all(row[M.REPLAY_MISMATCH_ROWS] == 0.0 for row in rows)
    assert np.mean([r[M.LOGPROB_ABS_DIFF] for r in rows]) < np.mean([r[M.LOGPROB_ABS_DIFF_NO_REPLAY] for r in rows])
    hf = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "r3rl.export", str(run_dir), "--out", str(hf)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    exported = tensors(hf)
    base = tensors(ensure_checkpoint(compose(["parallelism=cpu"]).model))  # the run's start: no warm start here
    assert not any("lora" in name for name in exported) and exported.keys() == base.keys()
    moved = {n for n in base if not torch.equal(base[n], exported[n])}
    assert any("self_attn.q_proj" in n for n in moved) and any("experts.0.down_proj" in n for n in moved)
    frozen = ("mlp.gate.weight", "norm", "embed", "lm_head")
    assert not any(part in n for n in moved for part in frozen), sorted(moved)
    assert_nothing_left(run_dir)
