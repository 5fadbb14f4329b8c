"""Supervised fine-tuning data: JSONL records of a prompt and the response to learn, as trainer ``Sample``s.

One JSON object per line, either

- ``{"<data.prompt_key>": ..., "<data.response_key>": "..."}``: the prompt is text or a list of chat messages, the
  response is text; or
- ``{"<data.messages_key>": [{"role": ..., "content": ...}, ...]}``: a whole chat whose last message, from the
  assistant, is the response; the messages before it are the prompt.

Each record becomes the same tokens the GRPO path would see: the prompt rendered like ``PromptDataset`` renders it
(the tokenizer's chat template with the assistant turn opened, or raw text), then the response's tokens and the
tokenizer's end-of-turn token (the engine's stop token), so the model learns to stop. The loss mask covers the
response tokens only. The sampler (shuffled epochs, resumable position) is ``PromptDataset``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from r3rl.config.schema import DataConfig
from r3rl.data.dataset import DataError, PromptDataset, _messages, jsonl_objects
from r3rl.data.formats import label_text
from r3rl.data.overlap import user_texts
from r3rl.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

Row = tuple[int, "list[dict[str, str]] | str", str, "str | None"]  # (line, prompt, response, label)


def read_sft_rows(path: str | Path, cfg: DataConfig, config_key: str = "data") -> list[Row]:
    """(line, prompt, response, label or None) of every record of an SFT file; a bad record raises DataError naming
    the file, the line and the ``<config_key>.*_key`` to check. Needs no tokenizer (configs are checked before
    launch)."""
    rows: list[Row] = []
    for lineno, where, obj in jsonl_objects(path, config_key):
        label = label_text(obj.get(cfg.label_key), where, cfg.label_key, config_key, optional=True)
        if cfg.messages_key in obj:
            chat = _messages(obj[cfg.messages_key], where, cfg.messages_key, config_key)
            if isinstance(chat, str) or len(chat) < 2 or chat[-1]["role"] != "assistant":
                raise DataError(f"{where}: '{cfg.messages_key}' must be a list of {{'role', 'content'}} "
                                f"messages whose last one, the response, has role 'assistant' "
                                f"({config_key}.messages_key={cfg.messages_key})")
            rows.append((lineno, chat[:-1], chat[-1]["content"], label))
            continue
        missing = [k for k in (cfg.prompt_key, cfg.response_key) if k not in obj]
        if missing:
            raise DataError(
                f"{where}: no key {missing[0]!r}; an SFT record holds '{cfg.prompt_key}' and '{cfg.response_key}' "
                f"({config_key}.prompt_key, {config_key}.response_key) or '{cfg.messages_key}' "
                f"({config_key}.messages_key); the line has {sorted(obj)}")
        response = obj[cfg.response_key]
        if not isinstance(response, str) or not response:
            raise DataError(f"{where}: '{cfg.response_key}' must be a non-empty string "
                            f"({config_key}.response_key={cfg.response_key})")
        rows.append((lineno, _messages(obj[cfg.prompt_key], where, cfg.prompt_key, config_key), response, label))
    if not rows:
        raise DataError(f"{path}: no records (the file is empty)")
    return rows


def prompt_texts(data_cfg: DataConfig) -> set[str]:
    """The user prompts of a training file, GRPO's (prompt/label) or SFT's (prompt/response, messages), a chat's
    user turns each on its own: what an eval set must avoid."""
    from r3rl.data.dataset import read_prompt_rows
    from r3rl.data.formats import MISSING, detect_format, jsonl_objects, lookup

    path = Path(data_cfg.path)
    fmt = detect_format(path, data_cfg.format)
    if fmt == "jsonl":  # SFT records are JSONL only: a table is a prompt file
        first = next((obj for _, _, obj in jsonl_objects(path)), {})
        grpo = isinstance(first, dict) and all(lookup(first, k) is not MISSING
                                               for k in (data_cfg.label_key, data_cfg.prompt_key))
    else:
        grpo = True
    if grpo:
        prompts = [prompt for _, prompt, _ in read_prompt_rows(path, data_cfg.prompt_key, data_cfg.label_key,
                                                               fmt=fmt)]
    else:
        prompts = [prompt for _, prompt, _, _ in read_sft_rows(path, data_cfg)]
    return {text for prompt in prompts for text in user_texts(prompt)}


def sft_data_problems(cfg) -> list[tuple[str, str]]:
    """(key, reason) for SFT data that cannot be used: a missing file that is not generated, or a bad record."""
    data = cfg.data
    path = Path(data.path)
    if not path.is_file():
        if not data.generate_if_missing:
            return [("data.path", f"{data.path}: no such file (one JSON object per line with '{data.prompt_key}' "
                                  f"and '{data.response_key}', or '{data.messages_key}')")]
        return []
    try:
        read_sft_rows(path, data)
    except (DataError, UnicodeDecodeError) as err:
        return [("data.path", str(err))]
    return []


class SFTDataset(PromptDataset):
    """The records of ``data_cfg.path`` as ``Sample``s (``self.prompts``; loss mask on the response tokens), and
    ``PromptDataset``'s resumable batch sampler over them."""

    def __init__(self, data_cfg: DataConfig, tokenizer: Any, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens  # longest prompt + response; longer records are dropped
        super().__init__(data_cfg, tokenizer)

    @property
    def examples(self) -> list[Sample]:
        return self.prompts

    def _read(self):
        if not self.path.is_file():
            raise FileNotFoundError(f"data.path={self.cfg.path}: no such file (r3rl.data.arithmetic.ensure_sft_data "
                                    f"generates the arithmetic solutions when data.generate_if_missing=true)")
        return read_sft_rows(self.path, self.cfg)

    def _load(self) -> list[Sample]:
        rows = self._read()
        texts = [self._render(lineno, prompt) for lineno, prompt, _, _ in rows]
        eos = self.tokenizer.eos_token_id
        prompts = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        responses = self.tokenizer([r for _, _, r, _ in rows], add_special_tokens=False)["input_ids"]
        out: list[Sample] = []
        dropped = 0
        for (lineno, _, _, label), p, r in zip(rows, prompts, responses):
            r = list(r) + ([eos] if eos is not None and (not r or r[-1] != eos) else [])
            if len(p) > self.cfg.max_prompt_length or (self.max_tokens and len(p) + len(r) > self.max_tokens):
                dropped += 1
                continue
            n = len(r)
            out.append(Sample(
                index=len(out), group=len(out), request_id=f"sft-{self.path.name}:{lineno}",
                prompt_ids=np.asarray(p, dtype=np.int32), response_ids=np.asarray(r, dtype=np.int32),
                rollout_logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.float32),
                finish_reason="stop", status=SampleStatus.COMPLETED, label=label, extra={"line": lineno}))
        self.num_dropped = dropped
        if dropped:
            log.warning(
                "%s: dropped %d of %d records whose prompt exceeds data.max_prompt_length=%d tokens or whose prompt "
                "+ response exceeds %s tokens", self.path, dropped, len(rows), self.cfg.max_prompt_length,
                self.max_tokens)
        if not out:
            raise DataError(f"{self.path}: every record is too long (data.max_prompt_length="
                            f"{self.cfg.max_prompt_length}, {self.max_tokens} tokens in all)")
        return out
