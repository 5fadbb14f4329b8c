"""SFT data: the generated worked solutions of the arithmetic prompts, their cache, and records -> Samples."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from r3rl.data.arithmetic import (ensure_sft_data, fingerprint_path, generate_problems, generate_sft_examples,
                                  worked_solution)
from r3rl.data.dataset import PromptDataset
from r3rl.data.reward import math_reward
from r3rl.data.sft import SFTDataset, prompt_texts


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def sft_data(tmp_path):
    from r3rl.preflight import compose

    cfg = compose(["parallelism=cpu", "recipe=sft", f"data.path={tmp_path / 'sft.jsonl'}", "data.generate_if_missing=true",
                   "data.num_generated_prompts=300"])
    return cfg.data


def test_every_solution_is_graded_correct_and_fits_the_cpu_response_limit(tokenizer):
    """Fails if a worked solution's boxed answer is wrong, or if (with its end-of-turn token) it outgrows the CPU
    profile's 16-token responses, so a model that learnt it would be truncated."""
    examples = generate_sft_examples(2000, 7)
    assert [e["prompt"] for e in examples] == [p["prompt"] for p in generate_problems(2000, 7)]
    for e in examples:
        assert e["response"].endswith(f"\\boxed{{{e['label']}}}")
        assert math_reward(e["response"], e["label"]) == 1.0, e
    longest = max(len(tokenizer(e["response"], add_special_tokens=False)["input_ids"]) for e in examples)
    assert longest + 1 <= 16, longest
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        worked_solution("Tell me a story.")


def test_wordy_solutions_are_the_share_asked_for_and_cut_before_their_answer(tokenizer):
    """The warm start's wordy solutions (``verbose_share``) are that share of the records, correct in full, and
    longer than the CPU profile's 16-token responses: cut there, they score 0 (the behaviour GRPO learns to avoid),
    while the concise ones fit. Fails if the share were ignored, or if the wordy style fitted the budget (the
    learning run would have nothing to learn but arithmetic)."""
    examples = generate_sft_examples(1000, 7, verbose_share=0.5)
    wordy = [e for e in examples if e["response"].startswith("Let me")]
    assert 0.45 < len(wordy) / len(examples) < 0.55
    assert [e["prompt"] for e in examples] == [e["prompt"] for e in generate_sft_examples(1000, 7)]
    for e in examples:
        ids = tokenizer(e["response"], add_special_tokens=False)["input_ids"]
        assert math_reward(e["response"], e["label"]) == 1.0
        cut = tokenizer.decode(ids[:16])
        assert (math_reward(cut, e["label"]) == 1.0) == (e not in wordy), e


def test_generated_file_is_cached_by_fingerprint_and_a_users_file_is_never_rewritten(sft_data):
    """Fails if the cached file is rewritten on every run, kept when its fingerprint is stale, or if a file r3rl did
    not make (no fingerprint) is overwritten."""
    path = ensure_sft_data(sft_data)
    marker = fingerprint_path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 300 and {"prompt", "label", "response"} <= set(rows[0])
    stamp = path.stat().st_mtime_ns
    assert ensure_sft_data(sft_data) == path and path.stat().st_mtime_ns == stamp
    marker.write_text(json.dumps({"generator": "arithmetic_sft", "solution_version": 0}))
    ensure_sft_data(sft_data)
    assert path.stat().st_mtime_ns != stamp and json.loads(marker.read_text())["solution_version"] >= 1
    marker.unlink()
    path.write_text(json.dumps({"prompt": "mine", "response": "mine too"}) + "\n")
    ensure_sft_data(sft_data)
    assert path.read_text().count("\n") == 1 and not marker.exists()


def test_samples_train_on_the_response_and_its_stop_token_after_grpos_prompt_tokens(sft_data, tokenizer):
    """Fails if SFT tokenises prompts otherwise than GRPO's data path (the model would learn a prompt format the
    rollouts never show), drops the stop token (the model would never learn to stop), or masks anything but the
    response."""
    ensure_sft_data(sft_data)
    samples = SFTDataset(sft_data, tokenizer).examples
    prompts = PromptDataset(sft_data, tokenizer).prompts
    assert len(samples) == len(prompts) == 300
    for s, p in zip(samples[:50], prompts[:50]):
        np.testing.assert_array_equal(s.prompt_ids, p.prompt_ids)
        assert s.response_ids[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        assert math_reward(text, s.label) == 1.0
        np.testing.assert_array_equal(s.loss_mask, np.ones(s.response_length, dtype=np.float32))


def test_chat_records_give_the_same_tokens_as_prompt_response_records(tmp_path, sft_data, tokenizer):
    """Fails if the last assistant message is not the response, or the chat before it not rendered as the prompt."""
    prompt, response = "What is 2 + 3? Think step by step.", "2 + 3 = \\boxed{5}"
    flat, chat = tmp_path / "flat.jsonl", tmp_path / "chat.jsonl"
    flat.write_text(json.dumps({"prompt": prompt, "response": response}) + "\n")
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": response}]}) + "\n")
    (a,) = SFTDataset(dataclasses.replace(sft_data, path=str(flat)), tokenizer).examples
    (b,) = SFTDataset(dataclasses.replace(sft_data, path=str(chat)), tokenizer).examples
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert len(a.response_ids) == len(b.response_ids)
    assert prompt_texts(dataclasses.replace(sft_data, path=str(chat))) == {prompt}


def test_heldout_split_avoids_the_sft_prompts(tmp_path, sft_data):
    """Fails if the generated eval split may contain a prompt the SFT recipe trains on."""
    from r3rl.eval.sets import ensure_heldout
    from r3rl.preflight import compose

    ensure_sft_data(sft_data)
    s = compose(["parallelism=cpu"]).eval.sets["arithmetic"]
    s = dataclasses.replace(s, path=str(tmp_path / "heldout.jsonl"), num_generated_prompts=50)
    held = {json.loads(line)["prompt"] for line in ensure_heldout(s, sft_data, prompt_texts(sft_data)).read_text().splitlines()}
    assert len(held) == 50 and not held & prompt_texts(sft_data)
