"""A grader never raises on a response: whatever the model wrote grades to a float in [0, 1] (issue 59). The
reproductions first (each raised out of ``grade`` before, ending the run), then Hypothesis over any text, with a
fixed example budget and derandomised so CI is repeatable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3rl.data.reward import GRADERS, grade

FUZZ = settings(max_examples=200, derandomize=True, deadline=5000, database=None)


def reward(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, timeout_s=5.0)


@pytest.mark.parametrize("response, partial", [
    ("\\boxed{\\frac{1}{" + "7" * 5000 + "}}", 0.0),  # int() of over 4300 digits: ValueError outside any try
    ("\\boxed{\\frac{1}{" + "7" * 5000 + "}}", 0.1),
    ("\\boxed{1e400}", 0.1),  # exact rational, then float(): OverflowError in the partial credit
    ("\\boxed{1e99999999}", 0.1),  # an integer of 10^8 digits, built before any deadline could fire
    ("7" * 5000, 0.1),
])
@pytest.mark.parametrize("name", ["boxed_exact", "exact"])
def test_answers_that_broke_the_graders_score_zero(name, response, partial):
    """Fails if any of these raises again, or scores a wrong answer above 0."""
    assert grade(reward(name), response, "3", partial) == 0.0


NUMERIC = st.from_regex(r"-?[0-9]{0,12}([./][0-9]{0,6})?([eE][-+]?[0-9]{1,8})?", fullmatch=True)
BOXED = st.builds(lambda inner: f"the answer is \\boxed{{{inner}}}.",
                  st.one_of(NUMERIC, st.text(max_size=40),
                            st.builds(lambda a, b: f"\\frac{{{a}}}{{{b}}}", NUMERIC, NUMERIC)))
RESPONSES = st.one_of(st.text(max_size=300), BOXED, NUMERIC,
                      st.builds(lambda n: "9" * n, st.integers(min_value=1, max_value=6000)))
LABELS = st.one_of(st.text(max_size=20), st.integers(), st.floats(allow_nan=True, allow_infinity=True), NUMERIC)


@FUZZ
@given(name=st.sampled_from(["exact", "boxed_exact"]), response=RESPONSES, label=LABELS,
       partial=st.sampled_from([0.0, 0.1, 0.5]))
def test_any_response_grades_to_a_score_in_0_1(name, response, label, partial):
    """Fails if a grader or the partial credit raises on some text, or leaves [0, 1]."""
    score = grade(reward(name), response, label, partial)
    assert isinstance(score, float) and 0.0 <= score <= 1.0


@settings(max_examples=40, derandomize=True, deadline=10000, database=None)
@given(response=RESPONSES, label=st.one_of(NUMERIC, st.text(max_size=20)))
def test_math_verify_grades_any_response_within_its_deadline(response, label):
    """math-verify on any text under ``grade``'s deadline: a score in [0, 1], never an exception."""
    assert set(GRADERS) >= {"math_verify"}
    score = grade(reward("math_verify"), response, label)
    assert isinstance(score, float) and 0.0 <= score <= 1.0


@pytest.mark.parametrize("response", ["\\boxed{1.5e-99999999}", "\\boxed{0.5e99999999}", "9" * 5000])
def test_math_verify_scores_numbers_no_deadline_can_stop_zero(response):
    """sympy turns ``1.5e-99999999`` into an exact rational: an integer power computed in C, which SIGALRM cannot
    interrupt (the fuzz suite found the run hanging there). Fails if such a response reaches math-verify again."""
    assert grade(reward("math_verify"), response, "3") == 0.0
