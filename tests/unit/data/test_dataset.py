"""PromptDataset with the tiny model's real tokenizer: keys, chat template, length filter, errors, resumable order."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from r3rl.data.dataset import DataError, PromptDataset


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def data_cfg(tiny_cfg, tmp_path):
    def make(rows: list, **overrides):
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        return dataclasses.replace(tiny_cfg.data, path=str(path), **overrides)

    return make


def numbered(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(n)]


def test_keys_are_configurable(data_cfg, tokenizer):
    cfg = data_cfg([{"question": "What is 2 + 2?", "answer": 4, "other": "x"}, {"question": "3 * 3?", "answer": "9"}],
                   prompt_key="question", label_key="answer", apply_chat_template=False)
    ds = PromptDataset(cfg, tokenizer)
    assert [p.text for p in ds.prompts] == ["What is 2 + 2?", "3 * 3?"]
    assert [p.label for p in ds.prompts] == ["4", "9"]  # numeric labels become text
    assert [p.line for p in ds.prompts] == [1, 2]
    assert list(ds[0].prompt_ids) == tokenizer("What is 2 + 2?", add_special_tokens=False)["input_ids"]


def test_chat_template_is_applied(data_cfg, tokenizer):
    ds = PromptDataset(data_cfg([{"prompt": "What is 2 + 2?", "label": "4"}]), tokenizer)
    text = ds[0].text
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ids = ds[0].prompt_ids
    assert ids.dtype == np.int32
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert list(ids) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_messages_prompts(data_cfg, tokenizer):
    # dapo-math-17k as slime ships it: the prompt is already a list of chat messages
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    ds = PromptDataset(data_cfg([{"prompt": msgs, "label": "2"}]), tokenizer)
    assert ds[0].text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 1?")
    with pytest.raises(DataError, match=r"prompts\.jsonl:1: the prompt is a list of chat messages"):
        PromptDataset(data_cfg([{"prompt": msgs, "label": "2"}], apply_chat_template=False), tokenizer)


def test_too_long_prompts_are_dropped_with_a_count(data_cfg, tokenizer, caplog):
    long = {"prompt": "seven " * 60, "label": "7"}
    rows = [numbered(3)[0], long, numbered(3)[1], long, numbered(3)[2]]
    cfg = data_cfg(rows, max_prompt_length=40)
    with caplog.at_level(logging.WARNING, logger="r3rl.data.dataset"):
        ds = PromptDataset(cfg, tokenizer)
    assert len(ds) == 3 and ds.num_dropped == 2
    assert [p.line for p in ds.prompts] == [1, 3, 5]
    assert [p.index for p in ds.prompts] == [0, 1, 2]
    assert all(len(p.prompt_ids) <= 40 for p in ds.prompts)
    assert "dropped 2 of 5 prompts longer than data.max_prompt_length=40" in caplog.text
    with pytest.raises(DataError, match="every prompt is longer than data.max_prompt_length=4 tokens"):
        PromptDataset(data_cfg(rows, max_prompt_length=4), tokenizer)


def test_malformed_line_names_file_and_line(data_cfg, tokenizer):
    cfg = data_cfg([numbered(1)[0], "", '{"prompt": "broken", "label": ', numbered(1)[0]])
    with pytest.raises(DataError, match=r"prompts\.jsonl:3: not valid JSON") as err:
        PromptDataset(cfg, tokenizer)
    assert str(Path(cfg.path)) in str(err.value)


def test_missing_key_names_line_and_config_key(data_cfg, tokenizer):
    cfg = data_cfg([numbered(1)[0], {"prompt": "no label here", "answer": "1"}])
    with pytest.raises(DataError, match=r"prompts\.jsonl:2: no key 'label' \(data\.label_key=label\)"):
        PromptDataset(cfg, tokenizer)
    with pytest.raises(DataError, match=r":1: no key 'question' \(data\.prompt_key=question\)"):
        PromptDataset(data_cfg(numbered(2), prompt_key="question"), tokenizer)
    with pytest.raises(DataError, match=r":1: expected a JSON object, got list"):
        PromptDataset(data_cfg(["[1, 2]"]), tokenizer)


def _take(ds: PromptDataset, batch_size: int, n: int) -> list[list[int]]:
    it = ds.batches(batch_size)
    return [[p.index for p in next(it)] for _ in range(n)]


def test_batches_shuffle_per_epoch_and_drop_the_remainder(data_cfg, tokenizer):
    ds = PromptDataset(data_cfg(numbered(10)), tokenizer)
    batches = _take(ds, 3, 6)  # 10 prompts, batches of 3: three per epoch, one prompt left out each epoch
    epoch0, epoch1 = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert epoch0 != epoch1  # a new order each epoch
    assert _take(PromptDataset(data_cfg(numbered(10)), tokenizer), 3, 6) == batches  # the seed fixes it
    other_seed = PromptDataset(data_cfg(numbered(10), seed=7), tokenizer)
    assert _take(other_seed, 3, 6) != batches
    in_order = PromptDataset(data_cfg(numbered(10), shuffle=False), tokenizer)
    assert _take(in_order, 3, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]


@pytest.mark.parametrize("consumed", [1, 2, 3, 5, 6])
def test_resume_continues_at_the_exact_position(data_cfg, tokenizer, consumed):
    cfg = data_cfg(numbered(10))
    reference = _take(PromptDataset(cfg, tokenizer), 3, 8)

    first = PromptDataset(cfg, tokenizer)
    before = _take(first, 3, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    if consumed in (3, 6):
        # right at an epoch's end the state already names the next epoch's first batch
        assert (state["epoch"], state["position"]) == (consumed // 3, 0)

    resumed = PromptDataset(cfg, tokenizer)
    resumed.load_state_dict(state)
    after = _take(resumed, 3, 8 - consumed)
    assert before + after == reference


def test_resume_refuses_a_changed_dataset(data_cfg, tokenizer):
    ds = PromptDataset(data_cfg(numbered(10)), tokenizer)
    _take(ds, 3, 2)
    state = ds.state_dict()
    smaller = PromptDataset(data_cfg(numbered(8)), tokenizer)
    with pytest.raises(ValueError, match="state is for 10 prompts but .* now has 8"):
        smaller.load_state_dict(state)
    with pytest.raises(ValueError, match=f"data.seed={ds.cfg.seed}, the config has data.seed={ds.cfg.seed + 1}"):
        PromptDataset(data_cfg(numbered(10), seed=ds.cfg.seed + 1), tokenizer).load_state_dict(state)
    with pytest.raises(ValueError, match="rollout_batch_size=11"):
        next(ds.batches(11))
