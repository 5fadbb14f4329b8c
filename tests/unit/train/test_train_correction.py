"""Rollout correction against hand-computed cases: weights, masks, effective sample size, the sequence gate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from r3rl import metrics as M
from r3rl.train.correction import Correction, correct
from r3rl.train.grpo import policy_loss

LN = math.log

# two samples; ratios pi_old / pi_rollout per token chosen by hand: [3, 1, 0.25] and [1.5, 1.5 (masked)]
TRAINER = [np.array([LN(3.0), 0.0, LN(0.25)]), np.array([LN(1.5), LN(1.5)])]
ROLLOUT = [np.zeros(3), np.zeros(2)]
MASKS = [np.array([1.0, 1.0, 1.0]), np.array([1.0, 0.0])]


def run(kind="none", **kw):
    return correct(Correction(kind, **kw), TRAINER, ROLLOUT, MASKS)


def test_none_weights_one_keeps_every_token_and_reports_the_plain_ratio():
    out = run("none")
    assert [w.tolist() for w in out.weights] == [[1, 1, 1], [1, 1]]
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [1, 0]]
    m = out.metrics
    # valid ratios 3, 1, 0.25, 1.5: mean 5.75/4
    assert m[M.ROLLOUT_IS_MEAN] == pytest.approx(5.75 / 4)
    # ESS = mean^2 / mean(w^2) = (5.75/4)^2 / ((9 + 1 + 0.0625 + 2.25)/4)
    assert m[M.ROLLOUT_IS_ESS] == pytest.approx((5.75 / 4) ** 2 / (12.3125 / 4))
    # bounds [0.5, 2]: 3 above, 0.25 below, of 4 valid tokens
    assert m[M.ROLLOUT_IS_FRACTION_HIGH] == pytest.approx(0.25)
    assert m[M.ROLLOUT_IS_FRACTION_LOW] == pytest.approx(0.25)
    assert m[M.ROLLOUT_RS_MASKED_FRACTION] == 0.0
    # per-sample |mean log-ratio|: |ln 3 + ln 0.25| / 3 and ln 1.5, averaged
    assert m[M.LOG_PPL_ABS_DIFF] == pytest.approx((abs(LN(0.75)) / 3 + LN(1.5)) / 2)
    # k3 = r - ln r - 1 per token, token mean
    k3 = [r - LN(r) - 1 for r in (3.0, 1.0, 0.25, 1.5)]
    assert m[M.ROLLOUT_CORR_K3_KL] == pytest.approx(np.mean(k3))
    # |log-ratio| > ln 2: ln 3 and ln 4 of 4 tokens
    assert m[M.EXTREME_TOKEN_FRACTION] == pytest.approx(0.5)
    assert M.SEQ_ERROR_GATED_FRACTION not in m
    assert set(M.ROLLOUT_CORR_KEYS) <= set(m)


def test_tis_truncates_weights_from_above_only():
    out = run("tis", ratio_high=2.0)
    assert np.allclose(out.weights[0], [2.0, 1.0, 0.25]) and np.allclose(out.weights[1], [1.5, 1.5])
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [1, 0]]
    assert out.metrics[M.ROLLOUT_IS_MEAN] == pytest.approx((2 + 1 + 0.25 + 1.5) / 4)
    assert out.metrics[M.ROLLOUT_IS_ESS] == pytest.approx((4.75 / 4) ** 2 / ((4 + 1 + 0.0625 + 2.25) / 4))
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == 0.0


def test_icepop_drops_tokens_outside_the_band_and_weights_the_rest_by_their_ratio():
    out = run("icepop", ratio_low=0.5, ratio_high=2.0)
    assert [m.tolist() for m in out.loss_masks] == [[0, 1, 0], [1, 0]]
    assert np.allclose(out.weights[0], [3.0, 1.0, 0.25])
    # 2 of 4 valid tokens dropped
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.5)
    wide = run("icepop", ratio_low=0.2, ratio_high=5.0)
    assert [m.tolist() for m in wide.loss_masks] == [[1, 1, 1], [1, 0]]


def test_seq_mask_tis_drops_sequences_by_their_geometric_mean_ratio():
    # geometric means: (3 * 1 * 0.25)^(1/3) = 0.9086 and 1.5 (the masked token does not count)
    out = run("seq_mask_tis", seq_ratio_low=0.9, seq_ratio_high=1.2)
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [0, 0]]
    assert np.allclose(out.weights[0], [3.0, 1.0, 0.25])  # untruncated token ratios
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.25)
    # fractions count sequences against the sequence bounds: 1.5 above, none below
    assert out.metrics[M.ROLLOUT_IS_FRACTION_HIGH] == pytest.approx(0.5)
    assert out.metrics[M.ROLLOUT_IS_FRACTION_LOW] == 0.0
    tight = run("seq_mask_tis", seq_ratio_low=0.999, seq_ratio_high=1.002)
    assert [m.sum() for m in tight.loss_masks] == [0, 0]


def test_gate_drops_sequences_whose_multiplicative_error_exceeds_the_threshold():
    # exp(mean |log-ratio|): exp((ln 3 + ln 4) / 3) = 12^(1/3) = 2.289 and 1.5
    out = run("none", seq_error_threshold=2.0)
    assert [m.tolist() for m in out.loss_masks] == [[0, 0, 0], [1, 0]]
    assert out.metrics[M.SEQ_ERROR_GATED_FRACTION] == pytest.approx(0.5)
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.75)
    assert [w.tolist() for w in out.weights] == [[1, 1, 1], [1, 1]]
    # combined with tis: weights truncated, the gate still drops sample 0
    both = run("tis", seq_error_threshold=2.3)
    assert [m.tolist() for m in both.loss_masks] == [[1, 1, 1], [1, 0]]
    assert both.metrics[M.SEQ_ERROR_GATED_FRACTION] == 0.0


def test_equal_log_probs_give_unit_weights_full_ess_and_no_mismatch():
    same = [np.array([-1.0, -2.0]), np.array([-0.5])]
    out = correct(Correction("tis"), same, same, [np.ones(2), np.ones(1)])
    assert out.metrics[M.ROLLOUT_IS_MEAN] == 1.0 and out.metrics[M.ROLLOUT_IS_ESS] == 1.0
    assert out.metrics[M.LOG_PPL_ABS_DIFF] == 0.0 and out.metrics[M.EXTREME_TOKEN_FRACTION] == 0.0


def test_bad_input_names_the_sample_and_the_option():
    with pytest.raises(ValueError, match="sample 1: token counts differ"):
        correct(Correction(), TRAINER, [np.zeros(3), np.zeros(3)], MASKS)
    with pytest.raises(ValueError, match="correction.name"):
        Correction("is")


def test_weights_and_masks_enter_the_loss_per_token():
    lp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = lp.detach().clone()
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    out = correct(Correction("icepop", ratio_low=0.5, ratio_high=2.0), TRAINER[:1], ROLLOUT[:1], MASKS[:1])
    w = torch.from_numpy(out.weights[0])[None]
    mask = torch.from_numpy(out.loss_masks[0])[None]
    terms = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, is_weights=w)
    # ratio to pi_old is 1: each kept token contributes -A * w, here only the middle one (w = 1)
    assert float(terms.loss.detach()) == pytest.approx(-1.0) and float(terms.tokens) == 1.0
    terms.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.0, 0.0]]))
    plain = policy_loss(lp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2,
                        is_weights=torch.tensor([[2.0, 1.0, 0.25]]))
    assert float(plain.loss) == pytest.approx(-3.25) and float(plain.pg) == pytest.approx(-3.25)


def test_only_none_without_the_gate_leaves_the_loss_alone():
    assert not Correction("none").changes_training
    assert Correction("none", seq_error_threshold=1.5).changes_training
    assert all(Correction(kind).changes_training for kind in ("tis", "icepop", "seq_mask_tis"))
