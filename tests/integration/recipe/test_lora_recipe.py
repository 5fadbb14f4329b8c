"""``python run.py trainer.lora.rank=8``: LoRA GRPO on the real CPU stack, the adapted weights merged into every
weight sync, R3 exact, and the run's checkpoint exported as a merged HF model."""

from __future__ import annotations

import json
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


def test_lora_run_replays_exactly_and_exports_the_merged_model_and_the_adapter(tmp_path):
    """Two steps with rank-8 adapters: 0 mismatched replay rows on every step, replay lowers the mismatch on the
    same batches, and ``python -m r3rl.export`` of the run's checkpoint writes an HF model whose attention and expert
    weights differ from the base checkpoint's (the adapters merged in) while the routers, norms and embeddings are
    the base's bit for bit, and, in the same command, a PEFT adapter folder: the base with that adapter (peft) gives
    the merged model's logits. Fails if the weight sync or the export sent the frozen base, if a router or a norm
    trained, if LoRA broke replay, or if the adapter export lost an expert-parallel rank's experts, mapped a
    Megatron linear to another HF module, or dropped alpha / r."""
    run_dir = tmp_path / "lora"
    out = run_recipe(run_dir, *LORA, "run.num_steps=2", "run.eval_every=0", "run.save_every=2")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = train_rows(wandb_runs(run_dir)[0])
    assert len(rows) == 2 and all(row[M.REPLAY_MISMATCH_ROWS] == 0.0 for row in rows)
    assert np.mean([r[M.LOGPROB_ABS_DIFF] for r in rows]) < np.mean([r[M.LOGPROB_ABS_DIFF_NO_REPLAY] for r in rows])
    hf, adapter = tmp_path / "hf", tmp_path / "adapter"
    done = subprocess.run([sys.executable, "-m", "r3rl.export", str(run_dir), "--out", str(hf), "--adapter",
                           str(adapter)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    exported = tensors(hf)
    base_dir = ensure_checkpoint(compose(["parallelism=cpu"]).model)  # the run's start: no warm start here
    base = tensors(base_dir)
    assert not any("lora" in name for name in exported) and exported.keys() == base.keys()
    moved = {n for n in base if not torch.equal(base[n], exported[n])}
    assert any("self_attn.q_proj" in n for n in moved) and any("experts.0.down_proj" in n for n in moved)
    frozen = ("mlp.gate.weight", "norm", "embed", "lm_head")
    assert not any(part in n for n in moved for part in frozen), sorted(moved)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(base_dir)
    assert json.loads((adapter / "r3rl_adapter.json").read_text())["step"] == 2
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                            adapter)
        got = adapted(ids).logits
        bare = adapted.get_base_model()
        with adapted.disable_adapter():
            untouched = bare(ids).logits
    assert (want - untouched).abs().max() > 1e-3  # the adapters change the logits ...
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # ... and the PEFT folder holds exactly them
    assert_nothing_left(run_dir)
