"""The math reward on boxed, last-number, wrong and malformed answers."""

from __future__ import annotations

import math

import pytest

from r3rl.data.reward import extract_answer, math_reward


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("7 + 5 = 12, so the answer is \\boxed{12}.", "12", 1.0),
        ("First \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),  # the last box counts
        ("First \\boxed{3}, then corrected: \\boxed{4}", "3", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # nested braces, compared as numbers
        ("\\boxed{ 1,000 }", "1000", 1.0),
        ("\\boxed{$-7$}", "-7", 1.0),
        ("\\boxed{\\text{yes}}", "yes", 1.0),  # not a number: compared as text
        ("\\boxed{12} and later 13", "12", 1.0),  # a box wins over a later bare number
        ("12 - 7 = 5", "5", 1.0),  # no box: the last number, not "-7" or "-5"
        ("so x = -5", "-5", 1.0),
        ("3/4 of it", "0.75", 1.0),
        ("The answer is 12.", 12, 1.0),  # integer labels
        ("The answer is 12.", "13", 0.0),
        ("\\boxed{12}", "twelve", 0.0),
    ],
)
def test_math_reward(response, label, reward):
    assert math_reward(response, label) == reward


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("", "12"),  # nothing generated
        ("I do not know.", "12"),  # no number at all
        ("\\boxed{}", "0"),  # an empty box is an empty answer, not a fallback to other numbers
        ("\\boxed{1/0}", "1"),  # division by zero is no number
    ],
)
def test_malformed_answers_get_zero(response, label):
    assert math_reward(response, label) == 0.0


def test_unclosed_box_falls_back_to_the_last_number():
    # a response cut off inside the box has no complete box: the last number decides
    assert extract_answer("the answer is \\boxed{12") == "12"
    assert math_reward("the answer is \\boxed{12", "12") == 1.0
    assert math_reward("the answer is \\boxed{\\frac{1}{", "12") == 0.0


def test_shaped_reward_gives_graded_partial_credit_below_a_right_answer():
    """reward=boxed_exact with data.partial_credit (the GRPO step's call): a right answer 1, a near miss
    0.1 * exp(-|13 - 12| / 13), a far one less, no number 0. Fails if the formula, its scale or its order changes."""
    from r3rl.config.schema import RewardConfig
    from r3rl.data.reward import grade

    boxed = RewardConfig(name="boxed_exact", timeout_s=5.0)
    assert grade(boxed, "so \\boxed{12}", "12", 0.1) == 1.0
    near, far = grade(boxed, "it is 13", "12", 0.1), grade(boxed, "it is 90", "12", 0.1)
    assert 0.1 > near > far > 0.0
    assert near == pytest.approx(0.1 * math.exp(-1 / 13))
    assert grade(boxed, "no number here", "12", 0.1) == 0.0
    assert grade(boxed, "it is 13", "12", 0.0) == 0.0
