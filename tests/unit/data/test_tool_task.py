"""The calculator task: 4-digit additions drawn by split without listing the space, and worked tool episodes whose
SFT tokens are exactly the tokens ``env=calculator`` runs (prompt, call, end of turn, observation turn, answer)."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from r3rl.data.arithmetic import (_PROBLEM, ProblemSpace, draw_problem, generate_heldout, generate_sft_examples,
                                  split_of)
from r3rl.data.sft import SFTDataset
from r3rl.env.calculator import CalculatorEnv


def test_large_operands_are_sampled_within_range_and_split():
    """Fails if a space of 81 million problems were listed (it would not finish) or the split or range were not
    kept (held-out problems would leak into training)."""
    space = ProblemSpace("+", 9999, "heldout", min_operand=1000)
    assert not space.enumerable
    rng = random.Random(0)
    for _ in range(200):
        a, op, b = _PROBLEM.search(draw_problem(rng, space)["prompt"]).groups()
        assert 1000 <= int(a) <= 9999 and 1000 <= int(b) <= 9999 and split_of(int(a), op, int(b)) == "heldout"
    held = generate_heldout(128, 3, [], space)
    assert len({p["prompt"] for p in held}) == 128


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_worked_tool_episodes_are_the_tokens_the_environment_runs(tiny_cfg, tokenizer, tmp_path, compose_cfg):
    """Fails if the SFT records of a tool episode rendered other tokens than the episode loop produces (a different
    observation wrapping, a missing end-of-turn token, the call's result not the calculator's), so the warm start
    would teach a format GRPO never sees."""
    records = generate_sft_examples(40, 1, ProblemSpace("+", 9999, "sft", 1000), tool_share=0.5)
    tools = [r for r in records if "messages" in r]
    assert tools and len(tools) % 2 == 0 and any("response" in r for r in records)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = dataclasses.replace(tiny_cfg.data, path=str(path), max_prompt_length=256)
    examples = SFTDataset(data, tokenizer).examples
    by_line = {s.extra["line"]: s for s in examples}
    env_cfg = compose_cfg("model=tiny_moe", "parallelism=cpu", "env=calculator").env
    eos = tokenizer.eos_token_id
    call_line = next(i + 1 for i, r in enumerate(records) if "messages" in r)
    call, answer = by_line[call_line], by_line[call_line + 1]
    prompt = records[call_line - 1]["prompt"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(call.prompt_ids, prompt_ids)
    call_text = tokenizer.decode(call.response_ids, skip_special_tokens=True)
    turn = CalculatorEnv().start(prompt, None).step(call_text)
    assert turn.tool_call and not turn.tool_error and int(call.response_ids[-1]) == eos
    observation = tokenizer.encode(env_cfg.observation_template.format(observation=turn.observation),
                                   add_special_tokens=False)
    # the answer record's prompt: the episode's context at its second turn
    np.testing.assert_array_equal(answer.prompt_ids, list(prompt_ids) + list(call.response_ids) + observation)
    assert tokenizer.decode(answer.response_ids, skip_special_tokens=True) == \
        f"\\boxed{{{records[call_line - 1]['label']}}}"
