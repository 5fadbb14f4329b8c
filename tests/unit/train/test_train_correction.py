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


def test_none_weights_one_keeps_every_token_and_reports_verls_figures():
    """verl's rollout_corr figures, key by key, at C = ratio_high = 2 on the valid ratios 3, 1, 0.25, 1.5.

    Fails if ``rollout_is_mean``/``max``/``min`` are taken after a truncation or over the masked token, if the std
    or ESS use the unclamped ratios instead of verl's clamp to [1/C, C], if ``fraction_low`` counts below
    ``ratio_low`` instead of 1/C, or if a perplexity, KL or chi-square key departs from verl's formula."""
    out = run("none")
    assert [w.tolist() for w in out.weights] == [[1, 1, 1], [1, 1]]
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [1, 0]]
    m = out.metrics
    assert m[M.ROLLOUT_IS_MEAN] == pytest.approx(5.75 / 4)  # before truncation
    assert m[M.ROLLOUT_IS_MAX] == pytest.approx(3.0) and m[M.ROLLOUT_IS_MIN] == pytest.approx(0.25)
    # clamped to [0.5, 2]: 2, 1, 0.5, 1.5: mean 1.25, mean of squares 7.5 / 4
    assert m[M.ROLLOUT_IS_STD] == pytest.approx(math.sqrt(7.5 / 4 - 1.25 ** 2))
    assert m[M.ROLLOUT_IS_ESS] == pytest.approx(1.25 ** 2 / (7.5 / 4), rel=1e-6)
    # above C = 2: 3; below 1/C = 0.5: 0.25 (of 4 valid tokens)
    assert m[M.ROLLOUT_IS_FRACTION_HIGH] == pytest.approx(0.25)
    assert m[M.ROLLOUT_IS_FRACTION_LOW] == pytest.approx(0.25)
    assert m[M.ROLLOUT_RS_MASKED_FRACTION] == 0.0 and m[M.ROLLOUT_RS_SEQ_MASKED_FRACTION] == 0.0
    mean_t = np.array([LN(0.75) / 3, LN(1.5)])  # per-sample mean trainer log-prob; the rollout's are 0
    assert m[M.ROLLOUT_CORR_KL] == pytest.approx(-LN(3 * 0.25 * 1.5) / 4)
    k3 = [r - LN(r) - 1 for r in (3.0, 1.0, 0.25, 1.5)]
    assert m[M.ROLLOUT_CORR_K3_KL] == pytest.approx(np.mean(k3))
    assert m[M.TRAINING_PPL] == pytest.approx(np.exp(-mean_t).mean())
    assert m[M.TRAINING_LOG_PPL] == pytest.approx((-mean_t).mean())
    assert m[M.ROLLOUT_PPL] == pytest.approx(1.0) and m[M.ROLLOUT_LOG_PPL] == pytest.approx(0.0)
    diff = 0.0 - mean_t  # rollout minus trainer
    assert m[M.LOG_PPL_DIFF] == pytest.approx(diff.mean())
    assert m[M.LOG_PPL_ABS_DIFF] == pytest.approx(np.abs(diff).mean())
    assert m[M.LOG_PPL_DIFF_MAX] == pytest.approx(diff.max()) and m[M.LOG_PPL_DIFF_MIN] == pytest.approx(diff.min())
    assert m[M.PPL_RATIO] == pytest.approx(np.exp(diff).mean())
    assert m[M.CHI2_TOKEN] == pytest.approx((9 + 1 + 0.0625 + 2.25) / 4 - 1)
    assert m[M.CHI2_SEQ] == pytest.approx((0.75 ** 2 + 1.5 ** 2) / 2 - 1)
    # |log-ratio| > ln 2: ln 3 and ln 4 of 4 tokens
    assert m[M.EXTREME_TOKEN_FRACTION] == pytest.approx(0.5)
    # NeMo-RL's per-sequence error: (3 + 1 + 4) / 3 and 1.5
    assert m[M.MEAN_SEQ_MULT_PROB_ERROR] == pytest.approx((8 / 3 + 1.5) / 2)
    assert m[M.MAX_SEQ_MULT_PROB_ERROR] == pytest.approx(8 / 3)
    assert M.SEQ_ERROR_GATED_FRACTION not in m and M.IS_OOB_RATIO not in m
    assert set(M.ROLLOUT_CORR_KEYS) <= set(m)
    assert not any(k.startswith("rollout_corr/") and k not in M.ROLLOUT_CORR_KEYS for k in m), \
        "an r3rl-only figure under verl's prefix"


def test_tis_truncates_weights_from_above_only_and_its_is_figures_are_taken_before_truncation():
    """Fails if ``rollout_is_mean`` is the mean of the truncated weights (verl logs it before truncation) or if
    NeMo-RL's ``is_oob_ratio`` counts tokens below ``ratio_low`` for tis (it has no lower clamp)."""
    out = run("tis", ratio_high=2.0)
    assert np.allclose(out.weights[0], [2.0, 1.0, 0.25]) and np.allclose(out.weights[1], [1.5, 1.5])
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [1, 0]]
    assert out.metrics[M.ROLLOUT_IS_MEAN] == pytest.approx(5.75 / 4)
    assert out.metrics[M.ROLLOUT_IS_ESS] == pytest.approx(run("none").metrics[M.ROLLOUT_IS_ESS])
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == 0.0
    assert out.metrics[M.IS_OOB_RATIO] == pytest.approx(0.25)


def test_icepop_gives_rejected_tokens_weight_zero_and_keeps_them_in_the_count_by_default():
    """Fails if a rejected token keeps its raw ratio as its weight, if ``zero_weight`` (the default, NeMo-RL's and
    IcePop's behaviour) takes rejected tokens out of the loss mask, or if ``drop_from_count`` leaves them in it."""
    out = run("icepop", ratio_low=0.5, ratio_high=2.0)
    assert Correction("icepop").rejected_tokens == "zero_weight"
    assert [w.tolist() for w in out.weights] == [[0.0, 1.0, 0.0], [1.5, 1.5]]
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [1, 0]]
    assert [k.tolist() for k in out.kept] == [[0, 1, 0], [1, 0]]
    assert out.metrics[M.CORRECTION_KEPT_TOKENS] == 4.0
    # 2 of 4 valid tokens rejected, in 1 of 2 samples
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.5)
    assert out.metrics[M.ROLLOUT_RS_SEQ_MASKED_FRACTION] == pytest.approx(0.5)
    assert out.metrics[M.IS_OOB_RATIO] == pytest.approx(0.5)
    dropped = run("icepop", ratio_low=0.5, ratio_high=2.0, rejected_tokens="drop_from_count")
    assert [m.tolist() for m in dropped.loss_masks] == [[0, 1, 0], [1, 0]]
    assert [w.tolist() for w in dropped.weights] == [[0.0, 1.0, 0.0], [1.5, 1.5]]
    assert dropped.metrics[M.CORRECTION_KEPT_TOKENS] == 2.0
    assert dropped.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.5)
    wide = run("icepop", ratio_low=0.2, ratio_high=5.0)
    assert [m.tolist() for m in wide.loss_masks] == [[1, 1, 1], [1, 0]]
    assert np.allclose(wide.weights[0], [3.0, 1.0, 0.25])
    with pytest.raises(ValueError, match="correction.rejected_tokens"):
        Correction("icepop", rejected_tokens="drop")


def test_a_token_icepop_rejects_carries_weight_exactly_zero_however_far_out():
    """A ratio at the e^20 bound (a token the engine gave log-prob -30): its weight is exactly 0, finite, and
    0 x anything stays 0. Fails if rejected tokens keep their raw ratio (up to ~5e8) behind the mask."""
    out = correct(Correction("icepop", ratio_low=0.5, ratio_high=5.0), [np.array([0.0, -1.0])],
                  [np.array([-30.0, -1.0])], [np.ones(2)])
    assert out.weights[0].tolist() == [0.0, 1.0]
    # what reaches the loss: the rejected token's term is 0 even where the surrogate is not finite
    assert np.nan_to_num(out.weights[0] * np.float32(1e30)).tolist()[0] == 0.0


def test_seq_mask_tis_rejects_sequences_by_their_geometric_mean_ratio():
    """Fails if seq_mask_tis counts the masked token in the geometric mean, truncates the kept tokens' ratios,
    leaves the rejected sequence's weights nonzero, or (under the default ``zero_weight``) drops its tokens from
    the count."""
    # geometric means: (3 * 1 * 0.25)^(1/3) = 0.9086 and 1.5 (the masked token does not count)
    out = run("seq_mask_tis", seq_ratio_low=0.9, seq_ratio_high=1.2)
    assert [m.tolist() for m in out.loss_masks] == [[1, 1, 1], [1, 0]]
    assert np.allclose(out.weights[0], [3.0, 1.0, 0.25])  # untruncated token ratios
    assert out.weights[1].tolist() == [0.0, 0.0]
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.25)
    assert out.metrics[M.ROLLOUT_RS_SEQ_MASKED_FRACTION] == pytest.approx(0.5)
    # NeMo-RL's is_oob_ratio counts sequences for seq-mask-tis; verl's fractions stay token-level at C
    assert out.metrics[M.IS_OOB_RATIO] == pytest.approx(0.5)
    assert out.metrics[M.ROLLOUT_IS_FRACTION_HIGH] == pytest.approx(0.25)
    dropped = run("seq_mask_tis", seq_ratio_low=0.9, seq_ratio_high=1.2, rejected_tokens="drop_from_count")
    assert [m.tolist() for m in dropped.loss_masks] == [[1, 1, 1], [0, 0]]
    tight = run("seq_mask_tis", seq_ratio_low=0.999, seq_ratio_high=1.002)
    assert [w.sum() for w in tight.weights] == [0, 0] and [m.sum() for m in tight.loss_masks] == [3, 1]


def test_gate_is_nemo_rls_mean_of_exp_abs_diff_per_sequence():
    """The issue's example: 10 of 200 tokens at |log-ratio| 4, the rest exact. NeMo-RL's per-sequence
    ``mean(exp|d|)`` = (190 + 10 e^4) / 200 = 3.68 exceeds 2.0, so the sequence is gated (weights 0, out of the
    count); ``exp(mean|d|)`` would be e^0.2 = 1.22 and keep it.

    Fails if the gate goes back to ``exp(mean(|d|))``, or if a gated sequence stays in the count or keeps a weight."""
    d = np.zeros(200)
    d[::20] = 4.0
    ok = np.full(5, -0.1)
    out = correct(Correction("none", seq_error_threshold=2.0), [d - 1.0, ok], [np.full(200, -1.0), ok],
                  [np.ones(200), np.ones(5)])
    assert out.metrics[M.MAX_SEQ_MULT_PROB_ERROR] == pytest.approx((190 + 10 * math.exp(4)) / 200)
    assert out.loss_masks[0].sum() == 0 and out.weights[0].sum() == 0
    assert out.loss_masks[1].tolist() == [1.0] * 5 and out.weights[1].tolist() == [1.0] * 5
    assert out.metrics[M.SEQ_ERROR_GATED_FRACTION] == pytest.approx(0.5)
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(200 / 205)


def test_gate_drops_sequences_whose_multiplicative_error_exceeds_the_threshold():
    """Fails if the gate uses exp(mean|d|) (12^(1/3) = 2.289 for sample 0 would pass 2.5) instead of NeMo-RL's
    mean(exp|d|) = 8/3, or if the masked token of sample 1 enters its error."""
    out = run("none", seq_error_threshold=2.0)
    assert [m.tolist() for m in out.loss_masks] == [[0, 0, 0], [1, 0]]
    assert out.metrics[M.SEQ_ERROR_GATED_FRACTION] == pytest.approx(0.5)
    assert out.metrics[M.ROLLOUT_RS_MASKED_FRACTION] == pytest.approx(0.75)
    assert [w.tolist() for w in out.weights] == [[0, 0, 0], [1, 1]]
    # combined with tis: weights truncated, the gate drops sample 0 at 2.5 (8/3 > 2.5) but not at 2.7
    both = run("tis", seq_error_threshold=2.5)
    assert [m.tolist() for m in both.loss_masks] == [[0, 0, 0], [1, 0]]
    assert both.metrics[M.SEQ_ERROR_GATED_FRACTION] == 0.5
    loose = run("tis", seq_error_threshold=2.7)
    assert [m.tolist() for m in loose.loss_masks] == [[1, 1, 1], [1, 0]]
    assert loose.metrics[M.SEQ_ERROR_GATED_FRACTION] == 0.0
    # under zero_weight too, a gated sequence leaves the count (NeMo-RL clears its sample mask)
    gated = run("icepop", ratio_low=0.5, ratio_high=2.0, seq_error_threshold=2.0)
    assert [m.tolist() for m in gated.loss_masks] == [[0, 0, 0], [1, 0]]
    assert gated.metrics[M.CORRECTION_KEPT_TOKENS] == 1.0


def test_equal_log_probs_give_unit_weights_full_ess_and_no_mismatch():
    same = [np.array([-1.0, -2.0]), np.array([-0.5])]
    out = correct(Correction("tis"), same, same, [np.ones(2), np.ones(1)])
    # verl's ESS divides by mean + 1e-8
    assert out.metrics[M.ROLLOUT_IS_MEAN] == 1.0 and out.metrics[M.ROLLOUT_IS_ESS] == pytest.approx(1.0, abs=1e-7)
    assert out.metrics[M.ROLLOUT_IS_STD] == 0.0 and out.metrics[M.CHI2_TOKEN] == 0.0
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
    # ratio to pi_old is 1: each kept token contributes -A * w, here only the middle one (w = 1); the rejected two
    # stay in the token count (zero_weight)
    assert float(terms.loss.detach()) == pytest.approx(-1.0) and float(terms.tokens) == 3.0
    terms.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.0, 0.0]]))
    plain = policy_loss(lp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2,
                        is_weights=torch.tensor([[2.0, 1.0, 0.25]]))
    assert float(plain.loss) == pytest.approx(-3.25) and float(plain.pg) == pytest.approx(-3.25)


def test_only_none_without_the_gate_leaves_the_loss_alone():
    assert not Correction("none").changes_training
    assert Correction("none", seq_error_threshold=1.5).changes_training
    assert all(Correction(kind).changes_training for kind in ("tis", "icepop", "seq_mask_tis"))


def test_nemo_rl_loss_figures_use_the_mask_after_the_gate():
    """NeMo-RL computes ``token_mult_prob_error`` and ``is_oob_ratio`` over ``token_mask * sample_mask`` after its
    sequence gate. With the gate at 2.0 sample 0 (8/3) leaves; what is left is sample 1's one token, ratio 1.5:
    token_mult_prob_error 1.5 and tis's is_oob_ratio 0 (at cap 1.2: 1). Before the gate they would be
    (3 + 1 + 4 + 1.5) / 4 and 1/4. Fails if either figure goes back to the masks from before the gate."""
    gated = run("tis", ratio_high=2.0, seq_error_threshold=2.0)
    assert gated.metrics[M.TOKEN_MULT_PROB_ERROR] == pytest.approx(1.5)
    assert gated.metrics[M.IS_OOB_RATIO] == 0.0
    assert run("tis", ratio_high=1.2, seq_error_threshold=2.0).metrics[M.IS_OOB_RATIO] == 1.0
    ungated = run("tis", ratio_high=2.0)
    assert ungated.metrics[M.TOKEN_MULT_PROB_ERROR] == pytest.approx(9.5 / 4)
    assert ungated.metrics[M.IS_OOB_RATIO] == pytest.approx(0.25)
    seq = run("seq_mask_tis", seq_ratio_low=0.9, seq_ratio_high=1.2, seq_error_threshold=2.0)
    assert seq.metrics[M.IS_OOB_RATIO] == 1.0  # of the one sequence left (geometric mean 1.5), one outside
