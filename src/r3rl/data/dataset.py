"""Prompt datasets read from JSONL, parquet or a ``datasets`` folder, tokenised once, and served in resumable shuffled
batches.

A record holds the prompt under ``data.prompt_key`` and the reference answer under ``data.label_key`` (slime's
dapo-math-17k JSONL uses ``prompt`` and ``label``; verl's parquet ``prompt`` and ``reward_model.ground_truth``, a
dotted key reaching into a struct). ``data.format`` (``r3rl.data.formats``: jsonl, parquet, hf_disk, or auto from the
path) says how the file is read. A prompt is either text or a list of chat messages
(``[{"role": "user", "content": ...}]``); with ``data.apply_chat_template`` it is wrapped in the tokenizer's chat
template with the assistant turn opened.

The sampler is a pure function of (seed, epoch, position): epoch ``e`` is the permutation drawn from
``seed`` and ``e``, so a checkpoint needs only ``{"epoch", "position"}`` to continue at the exact prompt, also
when it was saved right at the end of an epoch (the state then already points at the next epoch's start).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3rl.config.schema import DataConfig
from r3rl.data.formats import (FORMATS, MISSING, DataError, detect_format, jsonl_objects, label_text, lookup,
                               missing_prompts_message, records, table_value, where)

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "DataError", "Prompt", "PromptDataset", "jsonl_objects", "prompt_data_problems",
           "read_prompt_rows"]


@dataclass(frozen=True, eq=False)  # eq would compare the id arrays with ==, which is ambiguous
class Prompt:
    index: int  # position in the dataset (after too-long prompts are dropped)
    line: int  # line of a JSONL file (from 1) or row of a table (from 0), for messages that point at the data
    text: str  # what the engine sees: the chat-templated prompt, or the raw prompt
    prompt_ids: np.ndarray  # int32 [P]
    label: str


def _messages(value: Any, where: str, key: str, config_key: str) -> list[dict[str, str]] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return value
    raise DataError(
        f"{where}: '{key}' must be a string or a non-empty list of {{'role', 'content'}} messages, "
        f"got {type(value).__name__} ({config_key}.prompt_key={key})"
    )


def read_prompt_rows(path: str | Path, pkey: str, lkey: str, config_key: str = "data",
                     fmt: str = "auto") -> list[tuple[int, list[dict[str, str]] | str, str]]:
    """(line or row, prompt, label) of every record of a prompt file in format ``fmt`` (``data.format``; auto:
    from the path); a bad record raises DataError naming the file, the line or row and the ``<config_key>.*_key``
    to check. Needs no tokenizer, so configs are checked before launch."""
    fmt = detect_format(path, fmt, config_key)
    keys = ((pkey, f"{config_key}.prompt_key"), (lkey, f"{config_key}.label_key"))
    rows = []
    for lineno, here, obj in records(path, fmt, keys, config_key):
        for key, cfg_key in keys:
            if lookup(obj, key) is MISSING:
                raise DataError(
                    f"{here}: no key '{key}' ({cfg_key}={key}); the {'line' if fmt == 'jsonl' else 'row'} has "
                    f"{sorted(obj)}. Set {cfg_key} to the key that holds it."
                )
        label = label_text(lookup(obj, lkey), here, lkey, config_key)
        prompt = lookup(obj, pkey)
        if fmt != "jsonl":
            prompt = table_value(prompt)
        rows.append((lineno, _messages(prompt, here, pkey, config_key), label))
    if not rows:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return rows


def prompt_data_problems(data_cfg: DataConfig, *, allow_missing: bool = False,
                         rollout_batch_size: int | None = None) -> list[tuple[str, str]]:
    """(key, reason) for a GRPO prompt file that cannot be used: a missing file that will not be generated (unless
    ``allow_missing``: checked away from the launch, where it may be mounted later), a bad record, a missing column,
    an empty label, named by file, line or row and key, or fewer prompts than ``rollout_batch_size`` (one step's
    batch). A file r3rl will write afresh is not read."""
    path = Path(data_cfg.path)
    if not path.exists():
        return [] if data_cfg.generate_if_missing or allow_missing else \
            [("data.path", missing_prompts_message(data_cfg))]
    if path.is_file() and data_cfg.generate_if_missing:
        from r3rl.data.arithmetic import prompts_fingerprint, used_as_is

        if not used_as_is(path, prompts_fingerprint(data_cfg)):
            return []
    try:
        rows = read_prompt_rows(path, data_cfg.prompt_key, data_cfg.label_key, fmt=data_cfg.format)
    except (DataError, UnicodeDecodeError) as err:
        return [("data.path", str(err))]
    if rollout_batch_size is not None and len(rows) < rollout_batch_size:
        return [("algorithm.rollout_batch_size", f"{rollout_batch_size} prompts a step, but {path} holds "
                                                 f"{len(rows)}: lower it to at most {len(rows)} or use more data")]
    return []


class PromptDataset:
    """The prompts of ``data_cfg.path`` tokenised with ``tokenizer``, and a resumable batch sampler over them."""

    def __init__(self, data_cfg: DataConfig, tokenizer: Any, config_key: str = "data") -> None:
        self.cfg = data_cfg
        self.config_key = config_key  # where the keys live in the config (eval sets: eval.sets.<name>)
        self.path = Path(data_cfg.path)
        self.tokenizer = tokenizer
        self.num_dropped = 0
        self.prompts: list[Prompt] = self._load()
        self._epoch = 0
        self._position = 0

    # -- loading ---------------------------------------------------------------------------------------------------

    def _read(self) -> list[tuple[int, list[dict[str, str]] | str, str]]:
        if not self.path.exists():
            raise FileNotFoundError(missing_prompts_message(self.cfg, self.config_key))
        self.format = detect_format(self.path, self.cfg.format, self.config_key)
        return read_prompt_rows(self.path, self.cfg.prompt_key, self.cfg.label_key, self.config_key, self.format)

    def _render(self, lineno: int, prompt: list[dict[str, str]] | str) -> str:
        if self.cfg.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not getattr(self.tokenizer, "chat_template", None):
                raise DataError(f"data.apply_chat_template=true but the tokenizer has no chat template; "
                                f"set data.apply_chat_template=false to use {self.path} as raw text")
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(prompt, str):
            here = where(self.path, getattr(self, "format", "jsonl"), lineno)
            raise DataError(f"{here}: the prompt is a list of chat messages; set data.apply_chat_template=true to "
                            f"render it")
        return prompt

    def _load(self) -> list[Prompt]:
        rows = self._read()
        texts = [self._render(lineno, prompt) for lineno, prompt, _ in rows]
        # The chat template already holds the special tokens; plain text gets none either, like the engine's input.
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        prompts: list[Prompt] = []
        for (lineno, _, label), text, ids in zip(rows, texts, encoded):
            if len(ids) > self.cfg.max_prompt_length:
                self.num_dropped += 1
                continue
            prompts.append(Prompt(len(prompts), lineno, text, np.asarray(ids, dtype=np.int32), label))
        if self.num_dropped:
            log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                        self.path, self.num_dropped, len(rows), self.cfg.max_prompt_length)
        if not prompts:
            raise DataError(f"{self.path}: every prompt is longer than data.max_prompt_length="
                            f"{self.cfg.max_prompt_length} tokens; raise it")
        return prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    # -- sampling --------------------------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch``: its own permutation of seed and epoch, so no RNG state needs saving."""
        if not self.cfg.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.prompts))

    def batches(self, rollout_batch_size: int) -> Iterator[list[Prompt]]:
        """Batches of ``rollout_batch_size`` prompts, epoch after epoch, without end.

        Each epoch yields only full batches (the remainder of a shuffled epoch is left out, so every step sees
        the same number of prompts). The state advances as a batch is handed out: a checkpoint taken after the
        step that used it resumes with the next batch.
        """
        n = len(self.prompts)
        if not 0 < rollout_batch_size <= n:
            raise ValueError(f"algorithm.rollout_batch_size={rollout_batch_size}: must be between 1 and the "
                             f"{n} prompts of {self.path}")
        while True:
            if self._position + rollout_batch_size > n:
                self._epoch, self._position = self._epoch + 1, 0
            order = self.epoch_order(self._epoch)
            start = self._position
            batch = [self.prompts[i] for i in order[start : start + rollout_batch_size]]
            self._position = start + rollout_batch_size
            if self._position + rollout_batch_size > n:
                # normalise at the epoch's end, so a state saved here names the next epoch's first batch
                self._epoch, self._position = self._epoch + 1, 0
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position, "num_prompts": len(self.prompts),
                "seed": self.cfg.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` was saved; a different prompt set or seed cannot continue and raises."""
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"data sampler state lacks {sorted(missing)}: {state}")
        if state.get("num_prompts", len(self.prompts)) != len(self.prompts):
            raise ValueError(f"data sampler state is for {state['num_prompts']} prompts but {self.path} now has "
                             f"{len(self.prompts)} (after data.max_prompt_length): the data changed since the "
                             f"checkpoint")
        if state.get("seed", self.cfg.seed) != self.cfg.seed:
            raise ValueError(f"data sampler state was saved with data.seed={state['seed']}, the config has "
                             f"data.seed={self.cfg.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.prompts):
            raise ValueError(f"data sampler state out of range: {state}")
        self._epoch, self._position = epoch, position
