"""pass@k (unbiased) and the per-set eval figures against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from r3rl.eval.scoring import pass_at_k, set_metrics


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 1 - 3 / 10),         # 1 - C(3,2)/C(5,2)
    (4, 1, 1, 0.25),               # pass@1 is the share correct
    (10, 3, 1, 0.3),
    (10, 3, 5, 1 - 21 / 252),      # 1 - C(7,5)/C(10,5)
    (16, 1, 4, 1 - 1365 / 1820),   # 1 - C(15,4)/C(16,4) = 4/16
    (10, 0, 5, 0.0),               # nothing correct
    (3, 2, 2, 1.0),                # n - c < k: every pair holds a correct one
    (4, 4, 4, 1.0),
    (4, 1, 4, 1.0),                # k = n: pass@k is "any correct"
    (4, 0, 4, 0.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 2), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_set_metrics_hand_computed():
    # two prompts, k=2: prompt 0 gets 1 of 2 right, prompt 1 none; one response of four hit max_tokens
    out = set_metrics("arith", 2, rewards=[1.0, 0.0, 0.0, 0.0], groups=[0, 0, 1, 1], lengths=[4, 6, 10, 16],
                      truncated=[False, False, False, True])
    assert out["eval/arith/avg@2"] == pytest.approx(0.25)
    assert out["eval/arith/pass@2"] == pytest.approx(0.5)
    assert out["eval/arith/response_length_mean"] == pytest.approx(9.0)
    assert out["eval/arith/truncated_share"] == pytest.approx(0.25)
    # per-prompt means 0.5 and 0.0: sample std 0.3536, over sqrt(2) prompts
    assert out["eval/arith/avg@2_stderr"] == pytest.approx(math.sqrt(0.125) / math.sqrt(2))


def test_set_metrics_with_k_below_n_logs_the_unbiased_pass_at_k_beside_pass_at_n():
    """n = 4, k = 2; prompt 0 has 1 of 4 right, prompt 1 has 3: pass@2 = mean(1 - C(3,2)/C(4,2), 1 - C(1,2)/C(4,2))
    = mean(1/2, 1) = 3/4 while pass@4 ("any correct") = 1. Fails if pass@k were computed with k = n, or the
    k = n keys the dashboard reads were renamed."""
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    out = set_metrics("arith", 4, rewards=rewards, groups=[0] * 4 + [1] * 4, lengths=[1] * 8, truncated=[False] * 8,
                      k=2)
    assert out["eval/arith/pass@2"] == pytest.approx(0.75)
    assert out["eval/arith/pass@2_stderr"] == pytest.approx(math.sqrt(0.125) / math.sqrt(2))
    assert out["eval/arith/pass@4"] == pytest.approx(1.0) and out["eval/arith/avg@4"] == pytest.approx(0.5)
    # k = n (or unset) logs the one pass@n key, as before
    same = set_metrics("arith", 4, rewards=rewards, groups=[0] * 4 + [1] * 4, lengths=[1] * 8,
                       truncated=[False] * 8, k=4)
    assert not any(key.startswith("eval/arith/pass@2") for key in same) and same["eval/arith/pass@4"] == 1.0


def test_set_metrics_needs_n_samples_per_prompt():
    with pytest.raises(ValueError, match="n=2"):
        set_metrics("arith", 2, rewards=[1.0, 0.0, 1.0], groups=[0, 0, 1], lengths=[1, 1, 1],
                    truncated=[False] * 3)


def test_run_summary_lists_each_sets_eval_figures_with_baseline_and_last_point():
    from r3rl.tracking.summary import summarize

    history = [{"_step": 0, "eval/arith/avg@2": 0.25, "eval/arith/pass@2": 0.5, "perf/eval_time_s": 1.0},
               {"_step": 1, "train/logprob_abs_diff": 0.1},
               {"_step": 2, "train/logprob_abs_diff": 0.2, "eval/arith/avg@2": 0.5, "eval/arith/pass@2": 1.0}]
    stats = summarize(history)
    assert stats["eval/arith/avg@2"]["first"] == 0.25 and stats["eval/arith/avg@2"]["last"] == 0.5
    assert stats["eval/arith/pass@2"]["steps"] == 2
    assert stats["train/logprob_abs_diff"]["steps"] == 2


def test_eval_errors_are_clustered_by_problem():
    """Four prompts, n = 1: prompts 0 and 1 restate problem x (both right), 2 and 3 problem y (both wrong). Over
    problems the error of avg@1 is sqrt(2 * 2 * 0.5^2) / 4 = 0.5; counting the four prompts as independent gives
    0.289. Fails if ``set_metrics`` ignores ``problems`` (the eval would claim twice the evidence it has)."""
    kw = dict(rewards=[1.0, 1.0, 0.0, 0.0], groups=[0, 1, 2, 3], lengths=[1] * 4, truncated=[False] * 4)
    out = set_metrics("arith", 1, **kw, problems={0: "x", 1: "x", 2: "y", 3: "y"})
    assert out["eval/arith/avg@1_stderr"] == pytest.approx(0.5)
    assert out["eval/arith/pass@1_stderr"] == pytest.approx(0.5)
    assert set_metrics("arith", 1, **kw)["eval/arith/avg@1_stderr"] == pytest.approx(math.sqrt(1 / 3) / 2)


def test_paired_gain_from_records_is_clustered_by_problem(tmp_path):
    """Per-prompt changes +1, +1 (problem x) and 0, 0 (problem y): gain 0.5, clustered error 0.5 over 2 problems.
    Fails if the gain is taken over prompts as if independent (0.289), or if records without problem keys (written
    before this rule) are silently accepted."""
    from r3rl.eval.records import paired_gain, record_path, write_record

    problems = ("x", "x", "y", "y")
    write_record(tmp_path, "arith", 0, [0.0, 0.0, 0.0, 0.0], [0, 1, 2, 3], problems)
    write_record(tmp_path, "arith", 5, [1.0, 1.0, 0.0, 0.0], [0, 1, 2, 3], problems)
    gain, se, count = paired_gain(tmp_path, "arith", 0, 5)
    assert (gain, count) == (0.5, 2) and se == pytest.approx(0.5)
    record_path(tmp_path, "arith", 0).write_text('{"set": "arith", "step": 0, "prompt_means": [0, 0, 0, 0]}')
    with pytest.raises(ValueError, match="problem keys"):
        paired_gain(tmp_path, "arith", 0, 5)
