"""The generated arithmetic prompt set: deterministic, correct labels, written atomically where the config says."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from r3rl.data.arithmetic import ensure_prompts, generate_problems
from r3rl.data.reward import math_reward


def test_problems_are_deterministic_and_labels_are_right():
    a, b = generate_problems(64, seed=42), generate_problems(64, seed=42)
    assert a == b
    assert generate_problems(64, seed=43) != a
    assert {p["prompt"].split()[3] for p in a} == {"+", "-", "*"}
    for p in a:
        x, op, y = re.match(r"What is (\d+) ([-+*]) (\d+)\?", p["prompt"]).groups()
        expected = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        assert p["label"] == str(expected)
        assert "\\boxed{}" in p["prompt"]
        assert math_reward(f"... \\boxed{{{expected}}}", p["label"]) == 1.0


def test_ensure_prompts_generates_once_where_the_config_points(tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg.data, path=str(tmp_path / "prompts" / "arith.jsonl"), num_generated_prompts=20)
    path = ensure_prompts(cfg)
    assert path == tmp_path / "prompts" / "arith.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20 and set(rows[0]) == {"prompt", "label"}
    assert list((tmp_path / "prompts").iterdir()) == [path]  # no temporary file left behind
    path.write_text('{"prompt": "mine", "label": "1"}\n')
    assert ensure_prompts(cfg).read_text() == '{"prompt": "mine", "label": "1"}\n'  # an existing file is kept


def test_ensure_prompts_uses_the_configured_keys(tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg.data, path=str(tmp_path / "a.jsonl"), num_generated_prompts=3,
                              prompt_key="question", label_key="answer")
    rows = [json.loads(line) for line in ensure_prompts(cfg).read_text().splitlines()]
    assert all(set(r) == {"question", "answer"} for r in rows)


def test_missing_file_without_generation_names_the_key(tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg.data, path=str(tmp_path / "none.jsonl"), generate_if_missing=False)
    with pytest.raises(FileNotFoundError, match=r"data\.path=.*none\.jsonl: no such file"):
        ensure_prompts(cfg)
    assert not (tmp_path / "none.jsonl").exists()
