"""The ``reward=`` group: math-verify grading (``math_verify``), the hand-written graders it leaves in place
(``boxed_exact``, ``exact``), the per-response deadline, and the config keys that name a reward."""

from __future__ import annotations

import math
import signal
import threading
import time

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from r3rl.config import CONF_DIR, ConfigError
from r3rl.preflight import compose
from r3rl.config.schema import RewardConfig
from r3rl.data.reward import GRADERS, GradingTimeout, deadline, grade, math_reward

MV = RewardConfig(name="math_verify", timeout_s=5.0)
BOXED = RewardConfig(name="boxed_exact", timeout_s=5.0)
EXACT = RewardConfig(name="exact", timeout_s=5.0)

# (response, label, math-verify's grade): each pair as math-verify 0.9.0 grades it, the label boxed
MATH_VERIFY_TABLE = [
    # fractions, \frac, \dfrac, \tfrac, decimals
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),
    ("\\boxed{\\tfrac{3}{4}}", "0.75", True),
    ("\\boxed{\\frac34}", "\\frac{3}{4}", True),  # brace-less \frac (boxed_exact cannot read it)
    ("\\boxed{\\frac{6}{8}}", "\\frac{3}{4}", True),  # unreduced
    ("\\boxed{3/4}", "\\dfrac{3}{4}", True),
    ("3/4 of it", "0.75", True),  # no box: math-verify's plain-expression extraction
    ("\\boxed{0.3333}", "\\frac{1}{3}", False),  # rounded decimal is not the fraction
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),  # symbolic equality
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
    ("\\boxed{2x+2}", "2(x+1)", True),
    ("\\boxed{x = 5}", "5", True),  # an assignment's right-hand side
    ("\\boxed{\\pi}", "3.14159", False),
    # integers, signs, separators
    ("7 + 5 = 12, so the answer is \\boxed{12}.", "12", True),
    ("The answer is 12.", 12, True),
    ("The answer is 12.", "13", False),
    ("\\boxed{ 1,000 }", "1000", True),
    ("\\boxed{1{,}000}", "1000", True),
    ("\\boxed{$-7$}", "-7", True),
    ("\\boxed{+7}", "7", True),
    ("\\boxed{007}", "7", True),
    ("\\boxed{7.}", "7", False),  # a trailing period inside the box is not read as 7
    # units
    ("\\boxed{12 \\text{ cm}}", "12", True),
    ("\\boxed{12\\text{ cm}^2}", "12", True),
    ("\\boxed{30^\\circ}", "30", True),
    ("\\boxed{\\$5}", "5", True),
    ("\\boxed{50\\%}", "50", False),  # the percent sign is kept
    # sets and tuples
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3, 2, 1\\}", True),
    ("\\boxed{1, 2, 3}", "\\{1,2,3\\}", True),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2, 3\\}", False),
    ("\\boxed{(2, 1)}", "(1,2)", False),
    # intervals
    ("\\boxed{(0, 1]}", "(0, 1]", True),
    ("\\boxed{[0, 1]}", "(0, 1]", False),
    ("\\boxed{(-\\infty, 2) \\cup (3, \\infty)}", "(-\\infty,2)\\cup(3,\\infty)", True),
    ("\\boxed{x \\in (0, 1]}", "(0,1]", True),
    # \boxed nesting
    ("\\boxed{\\boxed{5}}", "5", True),
    ("\\boxed{\\text{\\boxed{5}}}", "5", True),
    ("\\boxed{\\frac{\\boxed{1}}{2}}", "\\frac{1}{2}", False),  # the inner box is the answer: 1
    # text and letters
    ("\\boxed{\\text{yes}}", "yes", True),
    ("\\boxed{\\text{(B)}}", "B", True),
    ("\\boxed{12}", "twelve", False),
    # no answer
    ("", "12", False),
    ("I do not know.", "12", False),
    ("\\boxed{}", "0", False),
    ("\\boxed{1/0}", "1", False),
]


@pytest.mark.parametrize(("response", "label", "right"), MATH_VERIFY_TABLE)
def test_math_verify_grades_the_table(response, label, right):
    """Fails if reward=math_verify stops calling math-verify the way the table was made (label boxed, response
    parsed with math-verify's default LaTeX and expression extraction, ``verify(gold, answer)``), e.g. if the label
    is no longer boxed (``\\frac34`` then stops parsing) or a hand-written parser answers instead."""
    assert grade(MV, response, label) == (1.0 if right else 0.0)


@pytest.mark.parametrize(("response", "label"), [
    ("First \\boxed{3}, then corrected: \\boxed{4}", "4"),  # math-verify reads the two boxes as the set {3, 4}
    ("the answer is \\boxed{12", "12"),  # cut off by the token limit: math-verify finds no answer
])
def test_boxed_exact_stays_where_math_verify_cannot_serve(response, label):
    """Why the arithmetic task keeps the hand-written grader: a self-corrected answer (the last box counts) and a box
    cut off by the CPU profile's 16-token limit (the last number counts) are right to it and wrong to math-verify.
    Fails if boxed_exact is replaced by math-verify, or if math-verify starts grading these the hand-written way
    (then this test, and the reason for the hand parser, can go)."""
    assert grade(BOXED, response, label) == 1.0
    assert grade(MV, response, label) == 0.0


def test_partial_credit_is_the_hand_written_graders_only():
    """math-verify has no notion of a near miss; ``data.partial_credit`` rests on the hand-written number parser.
    Fails if math_verify starts giving partial credit (its answers would no longer be 0 or 1) or exact loses it."""
    assert GRADERS["math_verify"].answer is None
    assert grade(MV, "it is 13", "12", partial_credit=0.1) == 0.0
    assert grade(EXACT, "13", "12", partial_credit=0.1) == pytest.approx(0.1 * math.exp(-1 / 13))


BOXED_EXACT_CASES = [  # tests/unit/data/test_reward.py's responses, and near misses for the partial credit
    ("7 + 5 = 12, so the answer is \\boxed{12}.", "12"), ("First \\boxed{3}, then corrected: \\boxed{4}", "4"),
    ("First \\boxed{3}, then corrected: \\boxed{4}", "3"), ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{ 1,000 }", "1000"),
    ("\\boxed{$-7$}", "-7"), ("\\boxed{\\text{yes}}", "yes"), ("\\boxed{12} and later 13", "12"), ("12 - 7 = 5", "5"),
    ("so x = -5", "-5"), ("3/4 of it", "0.75"), ("The answer is 12.", 12), ("The answer is 12.", "13"),
    ("\\boxed{12}", "twelve"), ("", "12"), ("I do not know.", "12"), ("\\boxed{}", "0"), ("\\boxed{1/0}", "1"),
    ("the answer is \\boxed{12", "12"), ("the answer is \\boxed{\\frac{1}{", "12"), ("it is 13", "12"),
    ("it is 90", "12"), ("7 + 12 = \\boxed{20}", "19"), ("no number here", "12"),
]


@pytest.mark.parametrize(("response", "label"), BOXED_EXACT_CASES)
@pytest.mark.parametrize("partial_credit", [0.0, 0.1])
def test_boxed_exact_grades_exactly_as_before(response, label, partial_credit):
    """The learning run and its CI test depend on the arithmetic reward bit for bit: reward=boxed_exact through
    ``grade`` (the GRPO step's call) equals ``math_reward`` on a right answer and stays below partial_credit on a
    wrong one (the formula itself is pinned in test_reward.py). Fails if the deadline or the registry changes a
    score."""
    correct = math_reward(response, label)
    assert grade(BOXED, response, label) == correct
    shaped = grade(BOXED, response, label, partial_credit)
    assert shaped == correct if correct or not partial_credit else 0.0 <= shaped < partial_credit


@pytest.mark.parametrize(("response", "label", "reward"), [
    ("12", "12", 1.0), (" $12$ ", "12", 1.0), ("12.", "12", 1.0), ("\\text{yes}", "yes", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0), ("1,000", "1000", 1.0),
    ("The answer is 12.", "12", 0.0), ("\\boxed{12}", "12", 0.0), ("", "", 0.0),
])
def test_exact_matches_the_whole_response(response, label, reward):
    """reward=exact extracts nothing: the normalised response is the answer. Fails if exact starts extracting a box
    or a last number (it would be boxed_exact) or stops normalising ``$``, ``\\text{}`` and the final period."""
    assert grade(EXACT, response, label) == reward


PATHOLOGICAL = "so the answer is \\boxed{9^{9^{9^{9}}}}"  # math-verify evaluates this for as long as it is let


def test_a_pathological_answer_is_cut_off_at_the_timeout_and_scores_zero(caplog):
    """A tower of powers keeps math-verify's comparison busy far past any step (its own 5 s alarm per comparison is
    switched off). The deadline cuts the whole request at reward.timeout_s, the response scores 0 with a warning, and
    SIGALRM is left as it was. Fails if ``grade`` stops arming the deadline (the test then runs unbounded), if the
    timeout stops scoring 0, or if the timer or handler leaks into the caller."""
    grade(MV, "\\boxed{1}", "1")  # imports and first-use costs out of the measured call
    before = signal.getsignal(signal.SIGALRM)
    started = time.perf_counter()
    assert grade(RewardConfig(name="math_verify", timeout_s=0.5), PATHOLOGICAL, "1") == 0.0
    elapsed = time.perf_counter() - started
    assert 0.5 <= elapsed < 2.5  # the deadline plus the unwinding, with room for a loaded machine
    assert "reward.timeout_s=0.5" in caplog.text
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
    assert grade(MV, "\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # the next response grades normally


def test_deadline_raises_past_its_time_and_not_after_it():
    """Fails if the deadline stops interrupting pure-Python work, or if its repeating alarm outlives the block."""
    with pytest.raises(GradingTimeout):
        with deadline(0.05):
            while True:
                pass
    with deadline(0.05):
        pass
    time.sleep(0.15)  # a leaked repeating alarm would raise GradingTimeout here


def test_math_verify_refuses_a_thread_where_no_deadline_can_be_armed():
    """SIGALRM belongs to the main thread (where the recipes grade). Fails if math_verify silently runs without a
    deadline in a worker thread, or if the hand-written graders (linear, no deadline needed) stop working there."""
    out: dict[str, object] = {}

    def work() -> None:
        out["boxed"] = grade(BOXED, "\\boxed{12}", "12")
        try:
            grade(MV, "\\boxed{12}", "12")
        except RuntimeError as err:
            out["mv"] = str(err)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out["boxed"] == 1.0
    assert "main thread" in str(out["mv"])


def test_defaults_keep_the_arithmetic_reward_and_name_math_verify_for_math_eval_sets():
    """Fails if the default run stops grading with boxed_exact (the learning run's reward) or the shipped AIME and
    MATH-500 eval sets stop naming math_verify."""
    cfg = compose(["parallelism=cpu"])
    assert (cfg.reward.name, cfg.eval.sets["arithmetic"].reward) == ("boxed_exact", "boxed_exact")
    for name in ("aime24", "math500"):  # composing these needs their data file (tests/unit/config has one)
        assert OmegaConf.load(CONF_DIR / "eval" / f"{name}.yaml").sets[name].reward == "math_verify"


@pytest.mark.parametrize(("overrides", "key"), [
    (["reward.name=nope"], "reward.name"),
    (["eval.sets.arithmetic.reward=nope"], "eval.sets.arithmetic.reward"),
    (["reward=math_verify", "data.partial_credit=0.1"], "data.partial_credit"),
    (["reward.timeout_s=0"], "reward.timeout_s"),
])
def test_config_refuses_a_reward_that_cannot_grade_naming_the_key(overrides, key):
    """Fails if an unknown reward (training or eval), partial credit from math_verify or a zero timeout gets past
    validation, or the refusal stops naming the key to change."""
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", *overrides])
    assert key in [k for k, _ in err.value.problems]


def test_unknown_reward_option_is_refused_by_hydra_naming_the_group():
    """Fails if ``reward=`` stops being a config group (an unknown option would then not be refused by name)."""
    with pytest.raises(HydraException, match="reward"):
        compose(["parallelism=cpu", "reward=nope"])


@pytest.mark.parametrize("option", ["exact", "boxed_exact", "math_verify"])
def test_every_reward_option_composes_with_its_name(option):
    """Fails if a conf/reward option and its grader part ways."""
    assert compose(["parallelism=cpu", f"reward={option}"]).reward.name == option


def test_math_stays_accepted_as_an_eval_reward():
    """Eval configs written before reward= named ``math`` (today's boxed_exact). Fails if the alias goes."""
    cfg = compose(["parallelism=cpu", "eval.sets.arithmetic.reward=math"])
    assert cfg.eval.sets["arithmetic"].reward == "math"
    assert grade(RewardConfig(name="math", timeout_s=1.0), "7 + 12 = 19", "19") == 1.0
