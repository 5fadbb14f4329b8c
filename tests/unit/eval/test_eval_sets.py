"""Eval sets as config: the arithmetic held-out split is disjoint from the training prompts, a bad eval file is
refused before launch naming file and line, and eval points fall where run.eval_every says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from r3rl.config import CONF_DIR, ConfigError
from r3rl.preflight import compose
from r3rl.data.arithmetic import ensure_prompts, generate_heldout, generate_problems
from r3rl.data.dataset import read_prompt_rows
from r3rl.eval.sets import ensure_heldout, eval_due, training_prompts


def test_heldout_split_is_disjoint_from_the_training_prompts_and_drawn_alike(tmp_path):
    cfg = compose(["parallelism=cpu", f"run.data_dir={tmp_path}"])
    train_path = ensure_prompts(cfg.data)
    s = cfg.eval.sets["arithmetic"]
    path = ensure_heldout(s, cfg.data, training_prompts(cfg))
    train = {p for _, p, _ in read_prompt_rows(train_path, "prompt", "label")}
    held = read_prompt_rows(path, s.prompt_key, s.label_key)
    assert len(held) == s.num_generated_prompts
    assert len({p for _, p, _ in held}) == len(held), "held-out prompts repeat"
    assert not train & {p for _, p, _ in held}, "a held-out prompt is a training prompt"
    # drawn like the training prompts: the same template, labels that are the true answers
    for _, prompt, label in held:
        a, op, b = prompt.split("?")[0].removeprefix("What is ").split()
        assert int(label) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_heldout_excludes_the_training_prompts_when_both_draw_from_the_same_seed():
    train = generate_problems(2000, seed=5)
    held = generate_heldout(50, seed=5, exclude=[p["prompt"] for p in train])
    assert len(held) == 50
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}


def test_heldout_file_name_follows_the_training_prompts(tmp_path):
    a = compose(["parallelism=cpu", f"run.data_dir={tmp_path}"]).eval.sets["arithmetic"].path
    b = compose(["parallelism=cpu", f"run.data_dir={tmp_path}", "data.seed=7"]).eval.sets["arithmetic"].path
    assert a != b, "another training draw must not reuse a held-out file made against the first"


@pytest.mark.parametrize("line, lineno, fragment", [
    ('{"problem": "1+1?", "answer": 2}\n{"problem": "2+2?" "answer": 4}\n', 2, "not valid JSON"),
    ('{"problem": "1+1?", "answer": 2}\n\n{"question": "2+2?", "answer": 4}\n', 3, "no key 'problem'"),
    ('{"problem": "1+1?", "answer": null}\n', 1, "'answer' must be a string or a number"),
])
def test_malformed_eval_jsonl_is_refused_at_validation_naming_file_and_line(tmp_path, line, lineno, fragment):
    bad = tmp_path / "aime24.jsonl"
    bad.write_text(line)
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "eval=aime24", f"eval.sets.aime24.path={bad}", "eval.sets.aime24.sampling.top_p=1",
                 "eval.sets.aime24.sampling.max_tokens=16"])
    assert f"eval.sets.aime24.path: {bad}:{lineno}: {fragment}" in str(err.value)


def test_missing_eval_file_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"eval\.sets\.math500\.path: .*nope\.jsonl: no such file"):
        compose(["parallelism=cpu", "eval=math500", f"eval.sets.math500.path={tmp_path}/nope.jsonl",
                 "eval.sets.math500.sampling.top_p=1", "eval.sets.math500.sampling.max_tokens=16"])


def test_malformed_eval_jsonl_fails_in_run_py_before_anything_starts(tmp_path):
    bad = tmp_path / "aime24.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": 2}\n{"problem": "2+2?"}\n')
    out = subprocess.run([sys.executable, "run.py", "parallelism=cpu", f"run.output_dir={tmp_path}/run", "eval=aime24",
                          f"eval.sets.aime24.path={bad}", "eval.sets.aime24.sampling.top_p=1",
                          "eval.sets.aime24.sampling.max_tokens=16"],
                         cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{bad}:2: no key 'answer'" in out.stderr
    assert not (tmp_path / "run").exists(), "nothing may start (not even Hydra's run folder)"


def test_eval_points_baseline_every_n_and_the_end():
    cfg = compose(["parallelism=cpu", "run.num_steps=7", "run.eval_every=3"])
    assert [s for s in range(8) if eval_due(cfg, s)] == [0, 3, 6, 7]
    assert not any(eval_due(compose(["parallelism=cpu", "run.eval_every=0"]), s) for s in range(5))
    with pytest.raises(ConfigError, match="run.eval_every"):
        compose(["parallelism=cpu", "run.eval_every=-1"])


def test_an_eval_sets_min_tokens_past_its_max_tokens_is_refused_naming_the_key():
    """Fails if vLLM were left to refuse the eval's requests at the first eval point (after the engines started)."""
    with pytest.raises(ConfigError, match="eval.sets.arithmetic.sampling.min_tokens"):
        compose(["parallelism=cpu", "eval.sets.arithmetic.sampling.min_tokens=17"])


def test_eval_sets_are_frozen():
    cfg = compose(["parallelism=cpu"])
    with pytest.raises(AttributeError, match="frozen"):
        cfg.eval.sets["arithmetic"].n_samples_per_prompt = 1  # type: ignore[misc]


def test_loaded_sets_name_each_prompts_problem(tmp_path, tiny_model_dir):
    """Each prompt of a loaded set carries its normalised problem. The generated held-out set draws each problem
    once (as many problems as prompts, each label the problem's sum); a set file of one's own that restates a problem
    ('123 + 456' and '456 + 123') gives both prompts one problem. Fails if ``EvalSet.problems`` is left empty or
    keyed by the templated text (every prompt its own problem, so every eval error would count a restated problem
    twice), or if the generated draw went back to distinct texts (both orderings of a problem held out)."""
    import json

    from transformers import AutoTokenizer

    from r3rl.eval.sets import load_sets

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = compose(["parallelism=cpu", f"run.data_dir={tmp_path}"])
    ensure_prompts(cfg.data)
    (s,) = load_sets(cfg, tok)
    assert len(s.problems) == len(s.prompts) == len(set(s.problems))
    for prompt, problem in zip(s.prompts, s.problems):
        a, _, b = problem.removeprefix("arithmetic: ").split()
        assert int(prompt.label) == int(a) + int(b)
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "label": str(a + b)}) + "\n"
                           for a, b in ((123, 456), (456, 123), (300, 1))))
    cfg = compose(["parallelism=cpu", f"run.data_dir={tmp_path}", f"eval.sets.arithmetic.path={own}",
                   "eval.sets.arithmetic.generate_if_missing=false"])
    (s,) = load_sets(cfg, tok)
    assert len(s.prompts) == 3
    assert s.problems[0] == s.problems[1] != s.problems[2]
