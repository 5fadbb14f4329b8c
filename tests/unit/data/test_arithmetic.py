"""The generated arithmetic prompt set: deterministic, correct labels, written atomically where the config says."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from r3rl.data.arithmetic import (SPLITS, ProblemSpace, ensure_prompts, fingerprint_path, generate_heldout,
                                  generate_problems, problems_of, split_of)
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
    # no temporary file left behind: the file and its fingerprint
    assert sorted((tmp_path / "prompts").iterdir()) == [path, fingerprint_path(path)]
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


def canonical(prompt: str) -> tuple:
    x, op, y = re.match(r"What is (\d+) ([-+*]) (\d+)\?", prompt).groups()
    a, b = int(x), int(y)
    return (op, *sorted((a, b))) if op in "+*" else (op, a, b)


def test_splits_partition_the_space_and_keep_twins_together():
    """sft, rl and heldout are disjoint and cover the space, and a + b always falls with b + a (so a held-out
    problem is never a training problem with its operands swapped). Fails if the split hashed the operands in
    their given order, or if the shares overlapped or left a gap."""
    space = {split: problems_of(ProblemSpace("+-*", 19, split)) for split in SPLITS}
    whole = problems_of(ProblemSpace("+-*", 19, "all"))
    keys = {split: {(op, *pair) for op, pairs in ops.items() for pair in pairs} for split, ops in space.items()}
    assert sum(len(k) for k in keys.values()) == sum(len(v) for v in whole.values())
    assert not (keys["sft"] & keys["rl"] or keys["sft"] & keys["heldout"] or keys["rl"] & keys["heldout"])
    for op in "+*":
        for a in range(20):
            for b in range(20):
                assert split_of(a, op, b) == split_of(b, op, a)
    assert all(len(k) > 20 for k in keys.values())


def test_the_train_split_is_every_share_but_the_held_out_one():
    """``data.split=train`` (the CPU default's GRPO prompts) draws exactly the sft and rl shares, listed or sampled,
    and never a held-out problem. Fails if it let the held-out share in (the eval would score trained problems) or
    left the warm start's share out."""
    train = problems_of(ProblemSpace("+-*", 19, "train"))
    keys = {split: {(op, *pair) for op, pairs in problems_of(ProblemSpace("+-*", 19, split)).items()
                    for pair in pairs} for split in SPLITS}
    assert {(op, *pair) for op, pairs in train.items() for pair in pairs} == keys["sft"] | keys["rl"]
    drawn = generate_problems(400, 3, ProblemSpace("+", 2000, "train", min_operand=1000))  # too large to list
    operands = [re.match(r"What is (\d+) \+ (\d+)\?", p["prompt"]).groups() for p in drawn]
    assert {split_of(int(a), "+", int(b)) for a, b in operands} == {"sft", "rl"}


def test_generated_sets_stay_in_their_split():
    """GRPO's prompts (rl), the warm start's (sft) and the held-out eval (heldout) never share a problem, whatever
    their seeds. Fails if generation ignored the split (every draw would come from the whole space)."""
    rl = generate_problems(300, 1, ProblemSpace("+", 29, "rl"))
    sft = generate_problems(300, 2, ProblemSpace("+", 29, "sft"))
    held = generate_heldout(40, 3, [p["prompt"] for p in rl], ProblemSpace("+", 29, "heldout"))
    assert len({canonical(p["prompt"]) for p in held}) == 40
    sets = [{canonical(p["prompt"]) for p in group} for group in (rl, sft, held)]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert {split_of(a, op, b) for op, a, b in sets[2]} == {"heldout"}


def test_a_generated_file_is_redrawn_when_its_space_changes(tiny_cfg, tmp_path):
    """A prompt file r3rl generated is drawn again when the config asks for another space (its fingerprint differs);
    one r3rl did not write is never touched. Fails if the cache were keyed by the path alone (a run would train on
    the previous configuration's prompts)."""
    cfg = dataclasses.replace(tiny_cfg.data, path=str(tmp_path / "p.jsonl"), num_generated_prompts=50, ops="+",
                              max_operand=19, split="rl")
    first = ensure_prompts(cfg).read_text()
    assert ensure_prompts(cfg).read_text() == first
    wider = ensure_prompts(dataclasses.replace(cfg, ops="-", max_operand=99, split="all")).read_text()
    assert wider != first and " - " in wider and " + " not in wider
    fingerprint_path(cfg.path).unlink()
    assert ensure_prompts(cfg).read_text() == wider  # no fingerprint: not r3rl's file any more, kept as it is


def test_an_empty_split_is_refused():
    """A space with no problem in its split fails naming it (products of 0 and 1 have none held out). Fails if an
    empty split gave an empty draw instead."""
    assert all(split_of(a, "*", b) != "heldout" for a in range(2) for b in range(2))
    with pytest.raises(ValueError, match="split 'heldout'"):
        problems_of(ProblemSpace("*", 1, "heldout"))
