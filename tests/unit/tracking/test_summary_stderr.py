"""The end-of-run summary shows the learning figures with their standard errors."""

from __future__ import annotations

from r3rl.tracking.summary import fmt_cell, summarize


def test_reward_and_eval_first_and_last_carry_their_standard_errors():
    """Reward mean (clustered by prompt) and eval avg@k / pass@k (clustered by problem) show ``value ± se`` at the
    first and last point, so a user sees at the end of ``make run`` whether the held-out score rose by more than its
    error. Fails if ``metrics.stderr_of`` no longer maps those figures to their ``_stderr`` keys."""
    history = [
        {"_step": 0, "eval/arithmetic/avg@4": 0.1, "eval/arithmetic/avg@4_stderr": 0.02,
         "eval/arithmetic/pass@4": 0.2, "eval/arithmetic/pass@4_stderr": 0.05},
        {"_step": 1, "rollout/reward_mean": 0.3, "rollout/reward_stderr": 0.04},
        {"_step": 2, "rollout/reward_mean": 0.5, "rollout/reward_stderr": 0.03, "eval/arithmetic/avg@4": 0.4,
         "eval/arithmetic/avg@4_stderr": 0.03, "eval/arithmetic/pass@4": 0.6, "eval/arithmetic/pass@4_stderr": 0.06},
    ]
    out = summarize(history)
    assert fmt_cell(out["rollout/reward_mean"], "first") == "0.3 ± 0.04"
    assert fmt_cell(out["rollout/reward_mean"], "last") == "0.5 ± 0.03"
    assert fmt_cell(out["eval/arithmetic/avg@4"], "first") == "0.1 ± 0.02"
    assert fmt_cell(out["eval/arithmetic/pass@4"], "last") == "0.6 ± 0.06"


def test_replay_removes_is_minus_the_paired_delta_with_the_pooled_clustered_error():
    """Two steps of paired deltas -0.02 ± 0.003 and -0.01 ± 0.004 (each step's error clustered by prompt): replay
    removes 0.015 ± sqrt(0.003² + 0.004²) / 2 = 0.0025. Steps without the paired pass (``replay.no_replay_every``)
    are left out. Fails if the sign flips, if the error is taken over the two step means instead of pooled from the
    clustered ones, or if a run without the paired figure (R3 off) gets a headline."""
    from r3rl.tracking.summary import replay_removes, replay_removes_text

    key = "train/logprob_abs_diff_paired_delta"
    history = [{"_step": 1, key: -0.02, f"{key}_stderr": 0.003}, {"_step": 2, "train/logprob_abs_diff": 0.01},
               {"_step": 3, key: -0.01, f"{key}_stderr": 0.004}]
    removed, se, steps = replay_removes(history)
    assert (round(removed, 6), round(se, 6), steps) == (0.015, 0.0025, 2)
    assert replay_removes_text(history).startswith("replay removes 0.015 ± 0.0025 of |log-prob diff| per sample")
    assert replay_removes([{"_step": 1, "train/logprob_abs_diff": 0.03}]) is None


def test_a_run_one_step_off_policy_is_said_to_mix_policy_lag_into_the_r3_figures(capsys):
    """With samples of older weights (``rollout/staleness_mean`` > 0) the replayed routes are the older weights'
    choices in the newer weights, so the paired delta is no clean measure of R3: the headline says so and names
    the fresh figure; an in-turn run's headline does not. Fails if the async headline loses the note (a user would
    read policy lag as R3's effect) or an in-turn run gets it."""
    from rich.console import Console

    from r3rl import metrics as M
    from r3rl.tracking.summary import print_summary, replay_removes_text

    key = M.LOGPROB_ABS_DIFF_PAIRED_DELTA
    in_turn = [{"_step": s, key: -0.02, f"{key}_stderr": 0.003, M.STALENESS_MEAN: 0.0} for s in (1, 2)]
    lagged = [{**in_turn[0], M.STALENESS_MEAN: 0.0}, {**in_turn[1], M.STALENESS_MEAN: 1.0}]
    assert "policy lag" not in replay_removes_text(in_turn)
    text = replay_removes_text(lagged)
    assert "on 1 of them it mixes engine mismatch with policy lag" in text and M.LOGPROB_ABS_DIFF_FRESH in text
    print_summary([{k: v for k, v in row.items() if k != key} for row in lagged], console=Console(width=200))
    assert "mixes engine mismatch with policy lag" in capsys.readouterr().out


def test_the_summary_carries_dapos_generation_rounds_and_the_staleness():
    """Fails if the summary (what a README figure may quote) drops ``rollout/generation_rounds`` or the staleness."""
    from r3rl import metrics as M

    out = summarize([{"_step": 1, M.GENERATION_ROUNDS: 2.0, M.STALENESS_MEAN: 1.0},
                     {"_step": 2, M.GENERATION_ROUNDS: 4.0, M.STALENESS_MEAN: 1.0}])
    assert out[M.GENERATION_ROUNDS]["mean"] == 3.0 and out[M.STALENESS_MEAN]["max"] == 1.0


def test_a_multi_turn_runs_summary_shows_each_turns_mismatch_with_and_without_replay():
    """Fails if the end-of-run table left out a multi-turn run's per-turn figures or episode counters (the summary
    of ``python run.py env=calculator`` must show them), or listed turn 10 before turn 2."""
    from r3rl.tracking.summary import key_metrics, summarize

    history = [{"train/logprob_abs_diff/turn_10": 0.3, "train/logprob_abs_diff/turn_2": 0.2,
                "train/logprob_abs_diff_no_replay/turn_2": 0.25, "train/logprob_abs_diff/turn_1": 0.1,
                "rollout/turns_mean": 1.5, "rollout/tool_errors": 0.0}]
    keys = key_metrics(history)
    turns = [k for k in keys if "/turn_" in k]
    assert turns == ["train/logprob_abs_diff/turn_1", "train/logprob_abs_diff/turn_2",
                     "train/logprob_abs_diff_no_replay/turn_2", "train/logprob_abs_diff/turn_10"]
    assert {"rollout/turns_mean", "rollout/tool_errors"} <= set(keys)
    assert summarize(history)["train/logprob_abs_diff/turn_2"]["mean"] == 0.2
    assert not [k for k in key_metrics([{"train/logprob_abs_diff": 0.1}]) if "turn" in k]  # single turn: none
