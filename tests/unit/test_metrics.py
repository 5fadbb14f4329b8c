"""Each metric on cases small enough to compute by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3rl import metrics as M

# Sample 0: |diff| 0.2, 0.4 (both valid) -> 0.3.
# Sample 1: |diff| 0, 0, 0, 0.6 valid, 5.0 masked -> 0.6 / 4 = 0.15.
# Per sample then mean: (0.3 + 0.15) / 2 = 0.225; a flat token mean would give 1.2 / 6 = 0.2.
ROLLOUT = [np.array([-1.0, -2.0]), np.array([-1.0, -1.0, -1.0, -1.0, -1.0])]
TRAINER = [np.array([-1.2, -1.6]), np.array([-1.0, -1.0, -1.0, -0.4, 4.0])]
MASKS = [np.array([1, 1]), np.array([1, 1, 1, 1, 0])]


def test_logprob_abs_diff_is_per_sample_mean_then_mean_over_samples():
    value = M.logprob_abs_diff(TRAINER, ROLLOUT, MASKS)
    assert value == pytest.approx(0.225)
    assert value != pytest.approx(0.2)  # the flat token mean, which weighs long samples more


def test_logprob_abs_diff_ignores_masked_tokens_and_empty_samples():
    # an aborted sample with no valid token neither adds 0 nor divides by 0
    trainer = TRAINER + [np.array([9.0, 9.0])]
    rollout = ROLLOUT + [np.array([0.0, 0.0])]
    masks = MASKS + [np.array([0, 0])]
    assert M.logprob_abs_diff(trainer, rollout, masks) == pytest.approx(0.225)
    assert math.isnan(M.logprob_abs_diff([np.array([1.0])], [np.array([0.0])], [np.array([0])]))


def test_logprob_abs_diff_accepts_padded_batches():
    trainer = np.array([[-1.2, -1.6, 0, 0, 0], [-1.0, -1.0, -1.0, -0.4, 4.0]])
    rollout = np.array([[-1.0, -2.0, 7, 7, 7], [-1.0, -1.0, -1.0, -1.0, -1.0]])
    masks = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    assert M.logprob_abs_diff(trainer, rollout, masks) == pytest.approx(0.225)


def test_token_mult_prob_error_is_token_mean_of_exp_abs_diff():
    # |diff| ln2, 0 in sample 0 and ln4 in sample 1 (its second token is masked): (2 + 1 + 4) / 3
    trainer = [np.array([math.log(2), 0.0]), np.array([-math.log(4), 50.0])]
    rollout = [np.array([0.0, 0.0]), np.array([0.0, 0.0])]
    masks = [np.array([1, 1]), np.array([1, 0])]
    assert M.token_mult_prob_error(trainer, rollout, masks) == pytest.approx(7 / 3)
    assert M.token_mult_prob_error(rollout, rollout, masks) == pytest.approx(1.0)


def test_mismatched_shapes_name_the_sample():
    with pytest.raises(ValueError, match="sample 1: token counts differ"):
        M.logprob_abs_diff(TRAINER, [ROLLOUT[0], ROLLOUT[1][:3]], MASKS)
    with pytest.raises(ValueError, match="sample counts differ"):
        M.token_mult_prob_error(TRAINER[:1], ROLLOUT, MASKS)


def test_routing_flip_metrics_average_the_layers():
    out = M.routing_flip_metrics([0.5, 0.25])
    assert out == {"r3/routing_flip_rate": pytest.approx(0.375), "r3/routing_flip_rate/layer_00": 0.5,
                   "r3/routing_flip_rate/layer_01": 0.25}
    with_prompt = M.routing_flip_metrics([0.5, 0.25], [0.1, 0.3])
    assert with_prompt["r3/routing_flip_rate_prompt"] == pytest.approx(0.2)
    assert with_prompt["r3/routing_flip_rate"] == pytest.approx(0.375)


def test_clustered_stderr_accounts_for_samples_of_one_prompt():
    """Values 1, 2 (prompt a) and 3, 6 (prompt b): centred sums -3 and 3, sqrt(2 / 1 * 18) / 4 = 1.5, where the
    plain standard error would be sqrt(14 / 3) / 2 = 1.08. With one value per cluster it is the plain one.

    Fails if ``clustered_stderr`` ignores the clusters (the plain stderr), drops the G / (G - 1) factor, or sums
    squared deviations per sample instead of squaring each cluster's sum."""
    assert M.clustered_stderr([1.0, 2.0, 3.0, 6.0], ["a", "a", "b", "b"]) == pytest.approx(1.5)
    assert M.stderr([1.0, 2.0, 3.0, 6.0]) == pytest.approx(math.sqrt(14 / 3) / 2)
    assert M.clustered_stderr([1.0, 2.0, 3.0, 6.0], [0, 1, 2, 3]) == pytest.approx(M.stderr([1.0, 2.0, 3.0, 6.0]))
    assert math.isnan(M.clustered_stderr([1.0, 2.0], [7, 7]))  # one prompt: no between-prompt spread to measure
    with pytest.raises(ValueError, match="equal length"):
        M.clustered_stderr([1.0, 2.0], [0])


def test_paired_delta_is_replayed_minus_unreplayed_per_sample_with_prompt_clustered_error():
    """Per sample replayed 0.3, 0.15 and unreplayed 0.5, 1.0: deltas -0.2 and -0.85, mean -0.525; two prompts of one
    sample each: standard error 0.325. Fails if the delta is taken as a difference of the two means' errors, the
    sign flipped, or the groups ignored (tested by ``clustered_stderr``)."""
    no_replay = [ROLLOUT[0] + 0.5, ROLLOUT[1] - 1.0]
    out = M.step_metrics(rollout_logprobs=ROLLOUT, trainer_logprobs=TRAINER, loss_masks=MASKS,
                         trainer_logprobs_no_replay=no_replay, sample_groups=[0, 1])
    assert out[M.LOGPROB_ABS_DIFF_PAIRED_DELTA] == pytest.approx(-0.525)
    assert out[M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR] == pytest.approx(0.325)
    assert M.STDERR_OF[M.LOGPROB_ABS_DIFF_PAIRED_DELTA] == M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR
    same_prompt = M.step_metrics(rollout_logprobs=ROLLOUT, trainer_logprobs=TRAINER, loss_masks=MASKS,
                                 trainer_logprobs_no_replay=no_replay, sample_groups=[3, 3])
    assert math.isnan(same_prompt[M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR])
    assert M.LOGPROB_ABS_DIFF_PAIRED_DELTA not in M.step_metrics(rollout_logprobs=ROLLOUT, trainer_logprobs=TRAINER,
                                                                 loss_masks=MASKS, sample_groups=[0, 1])


def test_mismatch_stderrs_are_clustered_by_prompt():
    """Four samples, two prompts, per-sample figures 0.3, 0.3 (prompt a: the same response twice) and 0.15, 0.15
    (prompt b): the clustered error is sqrt(2 * 2 * 0.15^2) / 4 = 0.075, not the plain 0.0433 that counts the copies
    as independent. Fails if ``step_metrics`` goes back to the per-sample ``stderr`` for either mismatch figure."""
    trainer, rollout, masks = TRAINER * 2, ROLLOUT * 2, MASKS * 2
    no_replay = [r + 0.5 for r in rollout]
    out = M.step_metrics(rollout_logprobs=rollout, trainer_logprobs=trainer, loss_masks=masks,
                         trainer_logprobs_no_replay=no_replay, sample_groups=["a", "b", "a", "b"])
    assert out[M.LOGPROB_ABS_DIFF_STDERR] == pytest.approx(0.075)
    assert M.stderr([0.3, 0.15, 0.3, 0.15]) == pytest.approx(0.0433, abs=1e-4)
    assert out[M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR] == pytest.approx(0.0, abs=1e-12)  # 0.5 everywhere
    one_prompt = M.step_metrics(rollout_logprobs=rollout, trainer_logprobs=trainer, loss_masks=masks,
                                sample_groups=[1, 1, 1, 1])
    assert math.isnan(one_prompt[M.LOGPROB_ABS_DIFF_STDERR])  # one prompt: nothing independent to compare


def test_mean_and_stderr_counts_one_problem_once():
    """Eval prompts 'a + b' and 'b + a' are one problem: four per-prompt scores 1, 1 (problem x) and 0, 0 (problem
    y) carry two independent draws, error sqrt(2 * 2 * 0.5^2) / 4 = 0.5, not the plain 0.289. Fails if the eval,
    the learning bench or the learning test clusters by prompt instead of by problem."""
    mean, se = M.mean_and_stderr([1.0, 1.0, 0.0, 0.0], ["x", "x", "y", "y"])
    assert mean == 0.5 and se == pytest.approx(0.5)
    assert M.stderr([1.0, 1.0, 0.0, 0.0]) == pytest.approx(0.2887, abs=1e-4)
    assert all(math.isnan(v) for v in M.mean_and_stderr([], []))


def test_seq_mult_prob_error_does_not_bound_the_log_ratio():
    """NeMo-RL's per-sequence error takes exp(|d|) unbounded: a token 30 nats off gives (e^30 + 1) / 2. Fails if the
    old clamp of |d| at 20 comes back (it would give (e^20 + 1) / 2)."""
    err = M.seq_mult_prob_error([np.array([30.0, 0.0])], [np.zeros(2)], [np.ones(2)])
    assert err[0] == pytest.approx((math.exp(30) + 1) / 2)


def test_logprob_abs_diff_stderr_is_over_samples():
    # per-sample figures 0.3 and 0.15: std (ddof 1) 0.106066, over sqrt(2) -> 0.075
    assert M.stderr(M.logprob_abs_diff_per_sample(TRAINER, ROLLOUT, MASKS)) == pytest.approx(0.075)
    assert math.isnan(M.stderr([0.3]))
    # identical per-sample figures: no spread, however many tokens
    assert M.stderr([0.2, 0.2, 0.2]) == pytest.approx(0.0, abs=1e-15)


def test_step_metrics_assembles_every_prefix_with_prior_art_names():
    no_replay = [ROLLOUT[0] + 0.5, ROLLOUT[1] - 1.0]  # |diff| 0.5 everywhere, 1.0 everywhere -> 0.75
    out = M.step_metrics(
        rollout_logprobs=ROLLOUT, trainer_logprobs=TRAINER, loss_masks=MASKS,
        trainer_logprobs_no_replay=no_replay, rewards=[1.0, 0.0, 1.0, 0.0], response_lengths=[2, 5],
        prompt_lengths=[3, 10], routing_flip_per_layer=[0.5, 0.25], replay_mismatch_rows=0,
        loss=0.125, grad_norm=2.0,
        timings_s={"rollout": 2.0, "logprobs": 0.5, "train": 1.0, "weight_sync": 0.5},
    )
    assert out["train/logprob_abs_diff"] == pytest.approx(0.225)
    assert out["train/logprob_abs_diff_no_replay"] == pytest.approx(0.75)
    assert out["train/logprob_abs_diff_stderr"] == pytest.approx(0.075)
    assert out["train/logprob_abs_diff_no_replay_stderr"] == pytest.approx(0.25)  # per sample 0.5 and 1.0
    assert out["r3/routing_flip_rate"] == pytest.approx(0.375)
    assert out["r3/routing_flip_rate/layer_01"] == 0.25
    assert out["r3/replay_mismatch_rows"] == 0.0
    assert out["rollout/reward_mean"] == 0.5 and out["rollout/reward_std"] == 0.5
    assert out["rollout/response_length_mean"] == 3.5 and out["rollout/response_length_max"] == 5
    assert out["train/loss"] == 0.125 and out["train/grad_norm"] == 2.0
    assert out["perf/rollout_time_s"] == 2.0 and out["perf/weight_sync_time_s"] == 0.5
    assert out["perf/step_time_s"] == 4.0  # sum of the stages when no step time is given
    assert out["perf/tokens_per_s"] == pytest.approx(20 / 4.0)  # (2 + 5 + 3 + 10) tokens over 4 s
    assert out["perf/rollout_tokens_per_s"] == pytest.approx(7 / 2.0)
    # NeMo-RL's figure is logged by r3rl.train.correction, with the mask after its sequence gate
    assert "train/token_mult_prob_error" not in out
    assert "train/k3_kl" not in out and M.K3_KL == "rollout_corr/k3_kl"  # verl's key, logged once, by correction
    # rollout_corr/ comes from r3rl.train.correction, r2/ from R2's training forwards, eval/ from r3rl.eval
    assert {k.split("/", 1)[0] for k in out} == set(M.STEP_PREFIXES) - {"r2", "rollout_corr"}


def test_step_metrics_without_replay_logs_the_same_figure_twice():
    out = M.step_metrics(rollout_logprobs=ROLLOUT, trainer_logprobs=TRAINER, loss_masks=MASKS)
    assert out["train/logprob_abs_diff_no_replay"] == out["train/logprob_abs_diff"] == pytest.approx(0.225)
    assert out["train/logprob_abs_diff_no_replay_stderr"] == out["train/logprob_abs_diff_stderr"]
    assert not any(k.startswith(("r3/", "perf/", "rollout/")) for k in out)  # inputs not given are not logged


def test_router_margin_is_the_gap_between_the_kth_and_the_next_logit():
    """Top-2 of logits [3.0, 1.0, 0.9, -2] leaves out 0.9: margin 1.0 - 0.9 = 0.1; of [0.5, 0.5, 0.5, 0.0] the 2nd
    and 3rd tie: margin 0 (a flip is one rounding away). Fails if the margin is taken between the 1st and 2nd logit,
    or after a softmax, or if the row order is lost."""
    logits = np.array([[3.0, 1.0, 0.9, -2.0], [0.5, 0.5, 0.0, 0.5]])
    assert np.allclose(M.router_margins(logits, 2), [0.1, 0.0])
    assert np.allclose(M.router_margins(logits[:, [3, 2, 1, 0]], 2), [0.1, 0.0])  # column order does not matter
    assert np.allclose(M.router_margins(logits, 1), [2.0, 0.0])
    with pytest.raises(ValueError, match="E > k"):
        M.router_margins(logits, 4)


def test_max_vio_is_max_load_over_mean_load_minus_one():
    """Loads 6, 2, 2, 2 (mean 3): MaxVio 1; a balanced layer 0; one expert taking all top-1 tokens of 4 experts: 3.
    Fails if it divides by the min or the total, or forgets the -1."""
    assert M.max_vio([6, 2, 2, 2]) == pytest.approx(1.0)
    assert M.max_vio([5, 5, 5, 5]) == 0.0
    assert M.max_vio([8, 0, 0, 0]) == pytest.approx(3.0)
    assert math.isnan(M.max_vio([0, 0]))


def test_router_metrics_average_layers_and_keep_one_max_vio_per_layer():
    out = M.router_metrics([0.2, 0.4], [0.5, 0.0], [1.0, 3.0])
    assert out[M.ROUTER_MARGIN_MEAN] == pytest.approx(0.3)
    assert out[M.ROUTER_MARGIN_SMALL_SHARE] == pytest.approx(0.25)
    assert out[M.EXPERT_LOAD_MAX_VIO] == pytest.approx(2.0)
    assert out["r3/expert_load_max_vio/layer_01"] == 3.0
    step = M.step_metrics(rollout_logprobs=ROLLOUT, trainer_logprobs=TRAINER, loss_masks=MASKS,
                          router_per_layer=(np.array([0.2, 0.4]), np.array([0.5, 0.0]), np.array([1.0, 3.0])))
    assert step[M.EXPERT_LOAD_MAX_VIO] == pytest.approx(2.0)


def test_t_tail_matches_the_tables_and_check_four_states_its_false_alarm_rate():
    """Student's t survival function against table values (t_{5, 0.95} = 2.015, t_{6, 0.95} = 1.943, Cauchy
    P(T > 1) = 1/4, P(T > 3 | 7) = 0.00997) and the normal's limit; check 4 states the rate for its prompt count.
    Fails if the tail were the normal's (0.00135 at 3 whatever the count: a false-alarm rate 7x too small at 8
    prompts) or an odd or even degree of the series were off."""
    from r3rl.doctor.checks import replay_exact

    assert M.t_sf(2.015, 5) == pytest.approx(0.05, abs=2e-4) and M.t_sf(1.943, 6) == pytest.approx(0.05, abs=2e-4)
    assert M.t_sf(1.0, 1) == pytest.approx(0.25) and M.t_sf(0.0, 4) == pytest.approx(0.5)
    assert M.t_sf(3.0, 7) == pytest.approx(0.00997, abs=1e-5) and M.t_sf(3.0, 2000) == pytest.approx(0.00136, abs=1e-5)
    prompts = np.repeat(np.arange(8), 4)
    rng = np.random.default_rng(0)
    unreplayed = rng.uniform(1e-3, 2e-3, 32)
    check = replay_exact(0, True, unreplayed - 1e-5, unreplayed, unreplayed + 1.0, prompts, layout="packed")
    assert check.values["false_alarm_rate"] == pytest.approx(M.t_sf(3.0, 7))
    assert "at most 1.0% of the time (Student's t, 7 degrees of freedom)" in check.bound


def test_t_isf_inverts_t_sf_at_the_tables_quantiles():
    """Student's t quantiles from the tables (97.5%: 12.706 at 1 degree of freedom, 4.303 at 2, 2.228 at 10) and the
    normal's 2 at many; fails if the inversion's bracket or bisection were off, or it returned t_sf's argument for
    another tail."""
    assert M.t_isf(0.025, 1) == pytest.approx(12.706, abs=2e-3)
    assert M.t_isf(0.025, 2) == pytest.approx(4.303, abs=1e-3)
    assert M.t_isf(0.025, 10) == pytest.approx(2.228, abs=1e-3)
    assert M.t_isf(0.5 * math.erfc(2 / math.sqrt(2)), 5000) == pytest.approx(2.0, abs=2e-3)
    with pytest.raises(ValueError, match="tail"):
        M.t_isf(0.7, 3)
