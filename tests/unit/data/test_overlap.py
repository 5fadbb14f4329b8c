"""Normalised problem keys (r3rl.data.overlap) and the held-out draw that excludes training problems by them."""

from __future__ import annotations

import json

import pytest

from r3rl.data.arithmetic import PROMPT_TEMPLATE, ProblemSpace, generate_heldout
from r3rl.data.overlap import problem_key, problem_keys
from r3rl.data.sft import prompt_texts


def ask(a: int, op: str, b: int) -> str:
    return PROMPT_TEMPLATE.format(a=a, op=op, b=b)


def test_whitespace_case_and_unicode_do_not_make_another_problem():
    """Fails if the key compared raw text (an eval copy with other spacing or case would pass as held out)."""
    assert problem_key("Find  the  ROOTS of\n x^2 - 1. ") == problem_key("find the roots of x^2 - 1.")
    assert problem_key("Ｆind the roots of x^2 - 1.") == problem_key("find the roots of x^2 - 1.")  # NFKC
    assert problem_key("find the roots of x^2 - 1.") != problem_key("find the roots of x^2 - 4.")


def test_commutative_twins_share_a_key_and_the_rest_do_not():
    """``a + b`` and ``b + a`` (``*`` alike) are one problem, whatever the instruction after the question; ``a - b``
    and ``b - a`` are two. Fails if the operands were not put in order for + and * (twins slip through), or were for
    - (a different problem would be dropped from the eval set)."""
    assert problem_key(ask(3, "+", 47)) == problem_key(ask(47, "+", 3)) == problem_key("what is 47+3? answer briefly")
    assert problem_key(ask(4, "*", 5)) == problem_key(ask(5, "*", 4))
    assert problem_key(ask(9, "-", 2)) != problem_key(ask(2, "-", 9))
    assert problem_key(ask(3, "+", 47)) != problem_key(ask(3, "*", 47))
    # a number after the question makes it another problem (not keyed as 3 + 4)
    assert problem_key("What is 3 + 4? Then add 5.") != problem_key("What is 4 + 3? Then add 5.")


def test_a_chat_is_keyed_by_its_user_turns():
    """Fails if a chat prompt's system turn counted as the problem (a chat copy of a training prompt would pass)."""
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": ask(2, "+", 7)}]
    assert problem_key(chat) == problem_key(ask(7, "+", 2))
    assert problem_keys([chat]) == {problem_key(ask(2, "+", 7))}


def test_heldout_draw_excludes_the_twin_of_a_training_prompt_and_draws_each_problem_once():
    """The training prompts hold every problem of a small space but 1 + 2 and 0 + 3, and only one order of each: the
    draw can give one ordering of each of those two problems and nothing else. Fails if the exclusion went back to
    exact prompt text (the b + a twins of the training prompts would be drawn), or if the draw were distinct by text
    again (1 + 2 and 2 + 1 would be two held-out prompts of one problem, counted as independent)."""
    space = ProblemSpace("+", 3, "all")
    training = [ask(a, "+", b) for a in range(4) for b in range(a, 4) if (a, b) not in ((1, 2), (0, 3))]
    held = generate_heldout(2, seed=0, exclude=training, space=space)
    assert {problem_key(p["prompt"]) for p in held} == {problem_key(ask(1, "+", 2)), problem_key(ask(0, "+", 3))}
    with pytest.raises(ValueError, match="could draw only 2 of 3"):
        generate_heldout(3, seed=0, exclude=training, space=space)


def test_prompt_texts_of_a_grpo_file_include_its_chat_prompts(tmp_path):
    """Fails if the user turn of a chat prompt in a prompt/label file were skipped (dapo-style data would never be
    checked against the eval sets)."""
    from r3rl.config.schema import DataConfig

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Solve x + 1 = 2."}], "label": "1"}) + "\n"
                    + json.dumps({"prompt": "Solve x + 2 = 3.", "label": "1"}) + "\n")
    assert prompt_texts(DataConfig(name="t", path=str(path))) == {"Solve x + 1 = 2.", "Solve x + 2 = 3."}
