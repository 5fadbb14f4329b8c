"""Eval sets against the training prompts, by normalised problem, whatever their source (a cached held-out file, a
JSONL set); the count left out at validation, at loading and in the eval metrics; ``eval.sets.<name>.k``."""

from __future__ import annotations

import io
import json
import logging
import re

import numpy as np
import pytest
from rich.console import Console

from r3rl.config import ConfigError
from r3rl.preflight import compose
from r3rl.config.schema import EvalSetConfig
from r3rl.data.arithmetic import ensure_prompts
from r3rl.data.dataset import Prompt, read_prompt_rows
from r3rl.eval.runner import Evaluator
from r3rl.eval.sets import EvalSet, ensure_heldout, load_sets, training_prompts
from r3rl.sample import Sample, SampleStatus

CPU_EVAL = ["parallelism=cpu"]
_PLUS = re.compile(r"What is (\d+) \+ (\d+)\?")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def left_out(caplog, name: str) -> tuple[int, int] | None:
    m = re.search(rf"eval\.sets\.{name}: left out (\d+) of its (\d+) problems", caplog.text)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def test_a_cached_heldout_file_is_checked_again_and_its_training_problems_left_out(tmp_path, caplog, tokenizer):
    """A cached held-out file (its fingerprint still matching) that holds a training prompt verbatim and, in other
    spacing and case, the b + a twin of another: validation counts 2 left out, loading leaves them out and says so.
    Fails if a cached file were used unchecked (ensure_heldout returns it as it is), or compared by exact text."""
    overrides = [*CPU_EVAL, f"run.data_dir={tmp_path}"]
    cfg = compose(overrides)
    training = training_prompts(cfg)
    path = ensure_heldout(cfg.eval.sets["arithmetic"], cfg.data, training)
    train_rows = read_prompt_rows(ensure_prompts(cfg.data), "prompt", "label")
    a, b = next((int(m.group(1)), int(m.group(2))) for _, p, _ in train_rows
                if (m := _PLUS.match(p)) and m.group(1) != m.group(2))
    lines = path.read_text().splitlines()
    lines[0] = json.dumps({"prompt": train_rows[0][1], "label": train_rows[0][2]})
    lines[1] = json.dumps({"prompt": f"what is  {b}+{a}?  Think step by step and put the final answer in "
                                     "\\boxed{}.", "label": str(a + b)})
    path.write_text("\n".join(lines) + "\n")

    with caplog.at_level(logging.WARNING, logger="r3rl.eval.sets"):
        compose(overrides)
    assert left_out(caplog, "arithmetic") == (2, len(lines))

    (s,) = load_sets(cfg, tokenizer)
    assert s.overlaps_removed == 2
    assert [p.line for p in s.prompts] == list(range(3, len(lines) + 1))
    assert [p.index for p in s.prompts] == list(range(len(lines) - 2))


def test_the_heldout_file_is_drawn_again_when_the_training_problems_change(tmp_path):
    """Fails if the cache key of the generated split held the training config only (a training file of one's own
    that changed would keep a held-out file drawn against the old one)."""
    cfg = compose([*CPU_EVAL, f"run.data_dir={tmp_path}"])
    s = cfg.eval.sets["arithmetic"]
    training = training_prompts(cfg)
    first = read_prompt_rows(ensure_heldout(s, cfg.data, training), "prompt", "label")
    taken = first[0][1]
    again = read_prompt_rows(ensure_heldout(s, cfg.data, [*training, taken]), "prompt", "label")
    assert taken not in {p for _, p, _ in again}


def math500_config(tmp_path, train_rows: list[dict], eval_rows: list[dict]):
    train, evalf = tmp_path / "train.jsonl", tmp_path / "math500.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    evalf.write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    return [*CPU_EVAL, "data=dapo_math", f"data.path={train}", "data.max_prompt_length=128", "eval=math500",
            f"eval.sets.math500.path={evalf}", "eval.sets.math500.sampling.top_p=1",
            "eval.sets.math500.sampling.max_tokens=16",
            # a step of 2 prompts: the file holds 2 (fewer than a step of dapo_math is refused before launch)
            "algorithm.rollout_batch_size=2", "algorithm.global_batch_size=8", "algorithm.n_samples_per_prompt=4"]


TRAIN = [{"prompt": "Find the sum of the roots of x^2 - 5x + 6 = 0.", "label": "5"},
         {"prompt": [{"role": "user", "content": "How many primes are below 20?"}], "label": "8"}]


def test_a_jsonl_set_leaves_out_a_problem_that_is_a_training_prompt_after_normalisation(tmp_path, caplog):
    """math500 holds a training prompt in other spacing and case, and the text of a chat training prompt: 2 of its 3
    problems are left out at validation. Fails if JSONL sets were never compared with the training data (only the
    generated split was), or if the comparison were not normalised."""
    overrides = math500_config(tmp_path, TRAIN, [
        {"problem": "find the sum of the roots of  x^2 - 5x + 6 = 0. ", "answer": "5"},
        {"problem": "How many primes are below 20?", "answer": "8"},
        {"problem": "What is 2^10?", "answer": "1024"}])
    with caplog.at_level(logging.WARNING, logger="r3rl.eval.sets"):
        compose(overrides)
    assert left_out(caplog, "math500") == (2, 3)


def test_a_set_whose_every_problem_is_a_training_problem_is_refused_naming_it(tmp_path):
    """Fails if a set with nothing held out were let through (its eval figures would measure memorisation)."""
    overrides = math500_config(tmp_path, TRAIN, [{"problem": "How many primes are below 20?", "answer": "8"}])
    with pytest.raises(ConfigError, match=r"eval\.sets\.math500: every one of its 1 problems is a training problem"):
        compose(overrides)


@pytest.mark.parametrize("k", [0, 5])
def test_k_outside_1_to_n_is_refused_naming_the_key(k):
    """Fails if ``eval.sets.<name>.k`` were not checked against n (pass_at_k would raise at the first eval point)."""
    with pytest.raises(ConfigError, match=r"eval\.sets\.arithmetic\.k: must be in \[1, "
                                          r"eval\.sets\.arithmetic\.n_samples_per_prompt=4\]"):
        compose([*CPU_EVAL, "eval.sets.arithmetic.n_samples_per_prompt=4", f"eval.sets.arithmetic.k={k}"])


def test_k_defaults_to_n():
    """Fails if an unset k were not n (the default configs would log another pass@ key than before)."""
    s = compose(CPU_EVAL).eval.sets["arithmetic"]
    assert s.k is None and EvalSet("arithmetic", s, []).k == s.n_samples_per_prompt


class _Client:
    """Answers sample i of prompt g right when i < correct[g] (the response id 1 decodes to the right answer)."""

    def __init__(self, correct: list[int]):
        self.correct = correct

    async def generate(self, prompts, n, sampling, *, step, stop_token_ids, labels, progress_label):
        return [Sample(index=g * n + i, group=g, request_id=f"{g}-{i}", prompt_ids=np.asarray(ids, dtype=np.int32),
                       response_ids=np.asarray([int(i < self.correct[g])], dtype=np.int32),
                       rollout_logprobs=np.zeros(1, np.float32), loss_mask=np.ones(1, np.float32),
                       finish_reason="stop", status=SampleStatus.COMPLETED, label=label)
                for g, (ids, label) in enumerate(zip(prompts, labels)) for i in range(n)]


class _Tokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "\\boxed{5}" if ids[0] == 1 else "\\boxed{0}"


def test_an_eval_point_logs_pass_at_k_beside_pass_at_n_and_the_count_left_out():
    """n = 4, k = 2, prompts with 1 and 2 of 4 right: pass@2 = mean(1 - C(3,2)/C(4,2), 1 - C(2,2)/C(4,2)) = 2/3,
    pass@4 = 1, avg@4 = 0.375, and the 3 problems left out. Fails if the runner did not pass k on (no pass@2) or
    dropped the count."""
    cfg = EvalSetConfig(path="unused.jsonl", n_samples_per_prompt=4, k=2)
    prompts = [Prompt(i, i + 1, "q", np.asarray([7], dtype=np.int32), "5") for i in range(2)]
    ev = Evaluator([EvalSet("arith", cfg, prompts, overlaps_removed=3)], _Client([1, 2]), _Tokenizer(),
                   Console(file=io.StringIO()))
    out = ev.evaluate(step=0, stop=lambda: False)
    assert out["eval/arith/pass@2"] == pytest.approx(2 / 3)
    assert out["eval/arith/pass@4"] == pytest.approx(1.0)
    assert out["eval/arith/avg@4"] == pytest.approx(0.375)
    assert out["eval/arith/overlaps_removed"] == 3.0
