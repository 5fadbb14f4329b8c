"""The calculator environment: exact arithmetic through ``ast``, refusals as error observations, and the turn rule
(a tool call continues the episode, an answer or plain text ends it)."""

from __future__ import annotations

import pytest

from r3rl.env.calculator import CalcError, CalculatorEnv, evaluate


@pytest.mark.parametrize("expr, value", [
    ("4821 + 3967", "8788"), ("12 * (3 - 5)", "-24"), ("7 / 2", "3.5"), ("1 / 3", "1/3"), ("-(2)", "-2"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("0.1 + 0.2", "0.3"), (" 99999999 * 99999999 ", "9999999800000001"),
])
def test_evaluates_exactly(expr, value):
    """Fails if the evaluator went through floats (0.1 + 0.2 would read 0.30000000000000004) or lost a sign."""
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "unsupported Call"), ("2 ** 10", "unsupported BinOp"), ("x + 1", "Name"),
    ("1 / 0", "division by zero"), ("1 +", "cannot parse"), ("", "empty"), ("9" * 30 + " * " + "9" * 30, "digits"),
    ("1" * 300, "longer than"),
])
def test_refuses_what_it_must_not_evaluate(expr, why):
    """Fails if a name, call or power reached evaluation (``eval`` would run the import), or if huge results were
    built."""
    with pytest.raises(CalcError, match=why):
        evaluate(expr)


def test_turns_continue_on_a_call_and_end_on_an_answer():
    """Fails if a boxed answer were taken as another tool call, or a bad expression ended the episode instead of
    coming back as an error observation."""
    episode = CalculatorEnv().start("What is 4821 + 3967?", "8788")
    call = episode.step("<calc>4821 + 3967</calc>")
    assert call.observation == "<result>8788</result>" and call.tool_call and not call.tool_error and not call.done
    bad = episode.step("<calc>4821 +</calc>")
    assert bad.observation.startswith("<result>error: cannot parse") and bad.tool_error and not bad.done
    last = episode.step("<calc>1+1</calc> <calc>2 * 3</calc>")
    assert last.observation == "<result>6</result>"  # the last call of a turn is the one answered
    assert episode.step("so \\boxed{8788}").done
    plain = episode.step("8788")
    assert plain.done and plain.observation is None and plain.reward is None  # the run's grader decides


def test_a_number_past_float_range_is_an_error_in_the_result_wrapper():
    """``1e999`` parses as a float infinity: the calculator answered with a bare ValueError before (issue 59), which
    ended the episode outside its protocol. Fails if it raises, or answers outside ``<result>...</result>``."""
    from r3rl.env.calculator import CalculatorEnv

    episode = CalculatorEnv().start("What is 1 + 1?", "2")
    for call in ("1e999", "-1e999", "1e300", "9" * 199):
        turn = episode.step(f"<calc>{call}</calc>")
        assert turn.observation.startswith("<result>error: ") and turn.observation.endswith("</result>"), call
        assert turn.tool_error


def test_any_tool_call_is_answered_in_the_result_wrapper():
    """Hypothesis over any text inside a tool call (sizes, nesting, numbers past float range): the episode answers
    ``<result>...</result>`` (a value or an error) and never raises. Fails if an expression escapes the
    calculator's errors."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from r3rl.env.calculator import CalculatorEnv

    env = CalculatorEnv()
    expressions = st.one_of(st.text(max_size=250), st.from_regex(r"[-+*/%() 0-9.eE]{1,80}", fullmatch=True),
                            st.builds(lambda n: "(" * n + "1" + ")" * n, st.integers(0, 120)))

    @settings(max_examples=300, derandomize=True, deadline=5000, database=None)
    @given(expressions)
    def check(expression):
        turn = env.start("q", "1").step(f"<calc>{expression}</calc>")
        if turn.observation is not None:  # no call found (the text closed it early) or a box: the episode ends
            assert turn.observation.startswith("<result>") and turn.observation.endswith("</result>")

    check()


def test_any_answers_give_the_reflect_episode_exactly_its_turns():
    """``env=reflect`` reads nothing of what the policy writes: whatever the answers (empty, huge, tool calls,
    boxes, control characters), an episode has exactly ``turns`` policy turns, each but the last followed by the
    request. Fails if ``ReflectEpisode`` starts reacting to the text, or miscounts."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from r3rl.env.reflect import ReflectEnv

    answers = st.lists(st.one_of(st.text(max_size=200), st.just("\\boxed{3}"), st.just("<calc>1e999</calc>"),
                                 st.text(alphabet="\x00\n\r\t\\{}<>", max_size=50)), min_size=6, max_size=6)

    @settings(max_examples=150, derandomize=True, deadline=5000, database=None)
    @given(st.integers(1, 5), answers)
    def check(turns, texts):
        env = ReflectEnv(turns=turns)
        episode = env.start("q", "3")
        for i, text in enumerate(texts[:turns], start=1):
            turn = episode.step(text)
            assert turn.done == (i == turns)
            assert turn.observation == (None if i == turns else env.request)

    check()
