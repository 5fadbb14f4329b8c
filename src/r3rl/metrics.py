"""Every metric r3rl logs, defined once, as pure numpy functions; and the names they are logged under.

Names follow prior art so runs compare with other stacks:

- ``train/logprob_abs_diff``: slime's ``train_rollout_logprob_abs_diff`` (per-sample masked mean of
  |trainer - rollout| log-prob, then the mean over samples). With R3 on the trainer's log-probs are computed with
  the rollout's routes replayed; ``train/logprob_abs_diff_no_replay`` is the same figure on the same batch without
  replay, so one run shows what R3 removes. ``..._stderr`` is the standard error of each over the step's samples,
  clustered by prompt (a prompt's samples are correlated, often identical responses).
  ``train/logprob_abs_diff_paired_delta`` (r3rl's): the mean over samples of (replayed - unreplayed) per-sample
  figure, the paired difference on one batch, with ``..._stderr`` clustered by prompt too. Negative when replay
  removes mismatch. With ``algorithm.max_staleness >= 1`` these figures mix the engine mismatch with the policy lag
  (the trainer's weights are newer than the ones that generated the batch): see ``r3rl.tracking.summary``.
- ``train/token_mult_prob_error``: NeMo-RL's masked mean of exp(|trainer - rollout|) over all valid tokens of the
  batch, with NeMo-RL's mask ``token_mask * sample_mask`` after the sequence gate (1.0 is a perfect match; their R3
  recipe gates on its median < 1.02); logged by ``r3rl.train.correction``.
- ``rollout_corr/k3_kl`` (verl's; once, it used to be duplicated as ``train/k3_kl``): the k3 estimator of
  KL(rollout || trainer) on the rollout's tokens, token masked mean.
- ``r3/routing_flip_rate``: share of (token, layer) rows whose top-k expert *set* differs between the trainer's own
  router and the rollout's, overall and per layer (``r3/routing_flip_rate/layer_{i:02d}``), over the rows whose
  output scores a response token in the loss (positions P-1 .. T-2 whose token has loss mask 1: the tokens
  ``train/logprob_abs_diff`` averages; an episode's observation tokens and a masked sample's tokens do not count),
  each real sample once (no micro-batch padding slot); ``r3/routing_flip_rate_prompt``: the same over the prompt
  rows (0 .. P-2). The trainer counts the flips per layer in its router hooks (``r3rl.train.replay.RouteProbe``), this
  module names and averages them.
- ``r3/router_margin_mean``, ``r3/router_margin_small_share``, ``r3/expert_load_max_vio`` (r3rl's; MaxVio's
  definition from the auxiliary-loss-free balancing paper): what explains a flip rate, over the same rows and
  pass, from the trainer's own router logits (``router_margins``, ``max_vio``).
- ``r3/replay_mismatch_rows``: (token, layer) rows where the routing map Megatron used under replay differs from
  the rollout's route stored on the ``Sample`` for that token and layer, mapped back through the inverse of the
  packing; 0 proves that every replayed route reached its token and layer.
- ``rollout_corr/...``: verl's ``rollout_corr`` keys with verl's definitions (``is_metrics``, ``offpolicy_metrics``,
  ``rs_metrics``; verl's token-level IS figures with its cap C = ``correction.ratio_high``), computed by
  ``r3rl.train.correction`` every step whatever ``correction.name``. NeMo-RL's figures under ``train/`` with its
  names (``token_mult_prob_error``, ``is_oob_ratio``, ``mean|max_seq_mult_prob_error``). r3rl's own, also under
  ``train/``: ``extreme_token_fraction`` (share of tokens with |trainer - rollout| > ln 2),
  ``seq_error_gated_fraction``, ``correction_kept_tokens``.
- ``r2/replay_mismatch_rows``: under R2, rows of the training forwards whose routing map differed from the route the
  trainer recorded in its old-log-prob pass (0 proves the replay); ``r2/replayed_rows``: the rows checked.

Token-level inputs are sequences with one 1-D array per sample (ragged) or 2-D arrays ``[samples, tokens]``
(padded; the mask zeroes the padding). Everything is computed in float64.
"""

from __future__ import annotations

import math
import re

from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np

ArrayRows = Union[Sequence[np.ndarray], np.ndarray]

# Each prefix has its own step axis (``<prefix>/step``); the W&B logger defines them from this table. A training
# step logs the first six (r2/ under R2 only, r3/ under R3 only); ``eval/`` points (``r3rl.eval``) come before the
# first step, every run.eval_every steps and at the end, on the same step numbers.
STEP_PREFIXES: tuple[str, ...] = ("train", "rollout", "r3", "r2", "rollout_corr", "perf")
# ``sft/``: a step of the SFT recipe (recipes/sft.py), which logs it with ``perf/`` and its eval points
PREFIXES: tuple[str, ...] = (*STEP_PREFIXES, "eval", "sft")
STEP_AXES: dict[str, str] = {prefix: f"{prefix}/step" for prefix in PREFIXES}

LOGPROB_ABS_DIFF = "train/logprob_abs_diff"
LOGPROB_ABS_DIFF_NO_REPLAY = "train/logprob_abs_diff_no_replay"
LOGPROB_ABS_DIFF_STDERR = "train/logprob_abs_diff_stderr"
LOGPROB_ABS_DIFF_NO_REPLAY_STDERR = "train/logprob_abs_diff_no_replay_stderr"
# r3rl's paired figure: mean over samples of (replayed - unreplayed) |trainer - rollout|, stderr clustered by prompt
LOGPROB_ABS_DIFF_PAIRED_DELTA = "train/logprob_abs_diff_paired_delta"
LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR = "train/logprob_abs_diff_paired_delta_stderr"
# figure -> the key of its standard error (clustered by prompt: the samples of one prompt are not independent)
STDERR_OF: dict[str, str] = {LOGPROB_ABS_DIFF: LOGPROB_ABS_DIFF_STDERR,
                             LOGPROB_ABS_DIFF_NO_REPLAY: LOGPROB_ABS_DIFF_NO_REPLAY_STDERR,
                             LOGPROB_ABS_DIFF_PAIRED_DELTA: LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR,
                             "rollout/reward_mean": "rollout/reward_stderr"}
# eval/<set>/avg@k and pass@k log their standard error, clustered by problem, as <key>_stderr (r3rl.eval.scoring)
_EVAL_FIGURE = re.compile(r"eval/.+/(avg|pass)@\d+")


def stderr_of(key: str) -> str | None:
    """The key of the standard error logged with figure ``key``, if it has one."""
    return STDERR_OF.get(key) or (f"{key}_stderr" if _EVAL_FIGURE.fullmatch(key) else None)
TOKEN_MULT_PROB_ERROR = "train/token_mult_prob_error"
# verl's rollout_corr/k3_kl, logged once by r3rl.train.correction (step_metrics no longer logs a train/ copy)
K3_KL = "rollout_corr/k3_kl"
LOSS = "train/loss"
GRAD_NORM = "train/grad_norm"
ROUTING_FLIP_RATE = "r3/routing_flip_rate"
ROUTING_FLIP_RATE_LAYER = "r3/routing_flip_rate/layer_{layer:02d}"
ROUTING_FLIP_RATE_PROMPT = "r3/routing_flip_rate_prompt"
REPLAY_MISMATCH_ROWS = "r3/replay_mismatch_rows"
# what explains a flip rate, over the same response rows, from the trainer's own router logits: the margin between
# the k-th and (k+1)-th logit (mean, and share of rows under SMALL_ROUTER_MARGIN), and the expert load's MaxVio
ROUTER_MARGIN_MEAN = "r3/router_margin_mean"
ROUTER_MARGIN_SMALL_SHARE = "r3/router_margin_small_share"
EXPERT_LOAD_MAX_VIO = "r3/expert_load_max_vio"
EXPERT_LOAD_MAX_VIO_LAYER = "r3/expert_load_max_vio/layer_{layer:02d}"
# a router margin (in logits) below this is within reach of the engine/trainer numerics: bfloat16 keeps 8 bits of
# mantissa, so logits of magnitude 1-8 round by up to ~0.004-0.03 in the engine before any difference upstream
SMALL_ROUTER_MARGIN = 0.05
# the unit roundoff of each floating-point type (half its relative spacing): rounding moves a value x by at most
# u |x|, so two router logits of an engine in that dtype can swap only where their margin is under u (|a| + |b|)
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# R2: the trainer's own routes, recorded in the old-log-prob pass, replayed in that batch's training forwards
R2_REPLAY_MISMATCH_ROWS = "r2/replay_mismatch_rows"
R2_REPLAYED_ROWS = "r2/replayed_rows"
# rollout correction (r3rl.train.correction): verl's rollout_corr/ keys with verl's definitions (its
# rollout_corr_helper: compute_is_metrics, compute_rollout_rejection_mask, compute_offpolicy_metrics), every step
# whatever correction.name
ROLLOUT_IS_MEAN = "rollout_corr/rollout_is_mean"
ROLLOUT_IS_MAX = "rollout_corr/rollout_is_max"
ROLLOUT_IS_MIN = "rollout_corr/rollout_is_min"
ROLLOUT_IS_STD = "rollout_corr/rollout_is_std"
ROLLOUT_IS_ESS = "rollout_corr/rollout_is_eff_sample_size"
ROLLOUT_IS_FRACTION_HIGH = "rollout_corr/rollout_is_ratio_fraction_high"
ROLLOUT_IS_FRACTION_LOW = "rollout_corr/rollout_is_ratio_fraction_low"
ROLLOUT_RS_MASKED_FRACTION = "rollout_corr/rollout_rs_masked_fraction"
ROLLOUT_RS_SEQ_MASKED_FRACTION = "rollout_corr/rollout_rs_seq_masked_fraction"
ROLLOUT_CORR_KL = "rollout_corr/kl"
ROLLOUT_CORR_K3_KL = K3_KL
TRAINING_PPL = "rollout_corr/training_ppl"
TRAINING_LOG_PPL = "rollout_corr/training_log_ppl"
ROLLOUT_PPL = "rollout_corr/rollout_ppl"
ROLLOUT_LOG_PPL = "rollout_corr/rollout_log_ppl"
LOG_PPL_DIFF = "rollout_corr/log_ppl_diff"
LOG_PPL_ABS_DIFF = "rollout_corr/log_ppl_abs_diff"
LOG_PPL_DIFF_MAX = "rollout_corr/log_ppl_diff_max"
LOG_PPL_DIFF_MIN = "rollout_corr/log_ppl_diff_min"
PPL_RATIO = "rollout_corr/ppl_ratio"
CHI2_TOKEN = "rollout_corr/chi2_token"
CHI2_SEQ = "rollout_corr/chi2_seq"
# NeMo-RL's names and definitions (it logs them under train/): the loss's is_oob_ratio (tis, icepop, seq_mask_tis
# only) and the per-sequence multiplicative probability error its seq_logprob_error_threshold gates on
IS_OOB_RATIO = "train/is_oob_ratio"
MEAN_SEQ_MULT_PROB_ERROR = "train/mean_seq_mult_prob_error"
MAX_SEQ_MULT_PROB_ERROR = "train/max_seq_mult_prob_error"
# r3rl's own
SEQ_ERROR_GATED_FRACTION = "train/seq_error_gated_fraction"
CORRECTION_KEPT_TOKENS = "train/correction_kept_tokens"
EXTREME_TOKEN_FRACTION = "train/extreme_token_fraction"
ROLLOUT_CORR_KEYS: tuple[str, ...] = (
    ROLLOUT_IS_MEAN, ROLLOUT_IS_MAX, ROLLOUT_IS_MIN, ROLLOUT_IS_STD, ROLLOUT_IS_ESS, ROLLOUT_IS_FRACTION_HIGH,
    ROLLOUT_IS_FRACTION_LOW, ROLLOUT_RS_MASKED_FRACTION, ROLLOUT_RS_SEQ_MASKED_FRACTION, ROLLOUT_CORR_KL,
    ROLLOUT_CORR_K3_KL, TRAINING_PPL, TRAINING_LOG_PPL, ROLLOUT_PPL, ROLLOUT_LOG_PPL, LOG_PPL_DIFF, LOG_PPL_ABS_DIFF,
    LOG_PPL_DIFF_MAX, LOG_PPL_DIFF_MIN, PPL_RATIO, CHI2_TOKEN, CHI2_SEQ)
REWARD_MEAN = "rollout/reward_mean"
REWARD_STD = "rollout/reward_std"
REWARD_MIN = "rollout/reward_min"
REWARD_MAX = "rollout/reward_max"
# standard error of rollout/reward_mean, clustered by prompt (a group's samples share their prompt's difficulty)
# DAPO (r3rl.train.dapo): groups dropped for equal raw outcomes, generation rounds of the step, dropped groups put
# back when algorithm.max_generation_rounds ran out, and the mean overlong penalty
FILTERED_GROUPS = "rollout/filtered_groups"
GENERATION_ROUNDS = "rollout/generation_rounds"
PADDED_GROUPS = "rollout/padded_groups"
OVERLONG_PENALTY_MEAN = "rollout/overlong_penalty_mean"
# algorithm.max_staleness >= 1: trainer versions between the weights that generated a sample and the weights it is
# trained from (its log-probs' policy), mean and max over the step's samples; samples taken out of the loss because
# their group holds one past the bound (whole groups go: r3rl.train.staleness.drop_stale)
STALENESS_MEAN = "rollout/staleness_mean"
STALENESS_MAX = "rollout/staleness_max"
DROPPED_STALE = "rollout/dropped_stale"
# the mean response length of the samples taken out as stale (absent when none are): completion-order intake evicts
# the groups that took longest, so it favours short responses, and this shows by how much
EVICTED_RESPONSE_LENGTH_MEAN = "rollout/evicted_response_length_mean"
# the engines' preemptions during the step (vllm:num_preemptions_total); with in-flight updates, the samples that
# spanned an update in a step with preemptions (each may have been recomputed by newer weights than its routes'
# forward: an upper bound, 0 proves none was)
PREEMPTIONS = "rollout/preemptions"
PREEMPTED_SPANNING_SAMPLES = "rollout/preempted_spanning_samples"
PREEMPTIONS_WINDOW_SHARED = "rollout/preemptions_window_shared"
# per response token in the loss: trainer version minus the version that sampled the token (vLLM's spans; the version
# a request was sent under bounds only the sample's own version); and the share of samples whose tokens came from
# more than one version (algorithm.weight_update=in_flight)
STALENESS_TOKEN_MEAN = "rollout/staleness_token_mean"
SPANNING_VERSIONS_SHARE = "rollout/spanning_versions_share"
# algorithm.group_intake=completion: groups drawn and not yet trained once the step took its own (generating, or
# done and waiting), and the step's groups drawn after one of those still pending (they overtook it: a batch intake
# would have waited for it)
GROUPS_PENDING = "rollout/groups_pending"
GROUPS_OVERTAKING = "rollout/groups_overtaking"
# train/logprob_abs_diff over the samples of staleness 0 only: the engine mismatch without the policy lag
# (absent from a step that has none)
LOGPROB_ABS_DIFF_FRESH = "train/logprob_abs_diff_fresh"
# max_staleness >= 1, per response token: the mismatch (replayed, and unreplayed on the paired pass) over the tokens
# the weights pi_old was computed with generated ("current") and over those older weights generated ("older")
LOGPROB_ABS_DIFF_VERSION_TOKENS = "train/logprob_abs_diff_{which}_version_tokens"
LOGPROB_ABS_DIFF_NO_REPLAY_VERSION_TOKENS = "train/logprob_abs_diff_no_replay_{which}_version_tokens"
REWARD_STDERR = "rollout/reward_stderr"
# multi-turn episodes (env=calculator, r3rl.env): means over the step's episodes of policy turns, tool calls and
# observation tokens; counts of tool errors (an error observation: a bad expression, a step that raised or hung),
# episodes cut by env.max_context_tokens, and episodes masked with their groups (a turn that failed twice)
TURNS_MEAN = "rollout/turns_mean"
TOOL_CALLS_MEAN = "rollout/tool_calls_mean"
TOOL_ERRORS = "rollout/tool_errors"
OBSERVATION_TOKENS_MEAN = "rollout/observation_tokens_mean"
CONTEXT_TRUNCATED = "rollout/context_truncated"
EPISODES_MASKED = "rollout/episodes_masked"
# route bytes received per episode, asking each turn only for the rows it lacks (routed_experts_prompt_start), and
# what asking for the whole context every turn would have sent
ROUTE_BYTES_PER_EPISODE = "rollout/route_bytes_per_episode"
ROUTE_BYTES_PER_EPISODE_FULL = "rollout/route_bytes_per_episode_full"
# route provenance (r3rl.env.stitch, "the earliest forward wins"), summed over the step's episodes: held route rows a
# later turn's prefill computed again (past the prefix cache's hits), how many of those the turn sent back to compare
# (env.route_overlap_rows), and how many of the compared ones came back with another expert set in some layer; the
# held row is replayed either way (absent when the engine does not report its prefix-cache hits)
RECOMPUTED_ROWS = "r3/recomputed_rows"
RECOMPUTED_ROWS_CHECKED = "r3/recomputed_rows_checked"
RECOMPUTED_ROWS_CHANGED = "r3/recomputed_rows_experts_changed"
# train/logprob_abs_diff (and its unreplayed twin) over the policy tokens of turn t only (observations never count)
LOGPROB_ABS_DIFF_TURN = "train/logprob_abs_diff/turn_{turn}"
LOGPROB_ABS_DIFF_NO_REPLAY_TURN = "train/logprob_abs_diff_no_replay/turn_{turn}"
RESPONSE_LENGTH_MEAN = "rollout/response_length_mean"
RESPONSE_LENGTH_MIN = "rollout/response_length_min"
RESPONSE_LENGTH_MAX = "rollout/response_length_max"
# SFT (recipes/sft.py): mean NLL of the response tokens of the step's batch, its gradient norm, and the batch's tokens
# (prompt + response, as fed) per second of the trainer's step
SFT_LOSS = "sft/loss"
SFT_GRAD_NORM = "sft/grad_norm"
SFT_TOKENS_PER_S = "sft/tokens_per_s"
SFT_LOSS_TOKENS = "sft/loss_tokens"
SFT_LR = "sft/lr"
PERF_TIME = "perf/{stage}_time_s"
PERF_STEP_TIME = "perf/step_time_s"
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_ROLLOUT_TOKENS_PER_S = "perf/rollout_tokens_per_s"
# colocated: GiB the trainer rank reserving most still held on its GPU when the engines woke (after it gave back the
# allocator's cache and its optimizer state); the plan's trainer weights + gradients + master weights + runtime
PERF_TRAINER_RESERVED_AT_WAKE = "perf/trainer_reserved_gib_at_wake"

# The stages the recipe times; others are accepted and logged the same way.
PERF_STAGES: tuple[str, ...] = ("rollout", "logprobs", "train", "weight_sync")


def flip_rate_key(layer: int) -> str:
    return ROUTING_FLIP_RATE_LAYER.format(layer=layer)


def perf_time_key(stage: str) -> str:
    return PERF_TIME.format(stage=stage)


def _rows(name: str, values: ArrayRows) -> list[np.ndarray]:
    rows = [np.asarray(v, dtype=np.float64) for v in values]
    for i, row in enumerate(rows):
        if row.ndim != 1:
            raise ValueError(f"{name}[{i}]: expected a 1-D array of per-token values, got shape {row.shape}")
    return rows


def _aligned(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows):
    t, r, m = _rows("trainer_lps", trainer_lps), _rows("rollout_lps", rollout_lps), _rows("masks", masks)
    if not len(t) == len(r) == len(m):
        raise ValueError(f"sample counts differ: trainer_lps {len(t)}, rollout_lps {len(r)}, masks {len(m)}")
    for i, (a, b, c) in enumerate(zip(t, r, m)):
        if not a.shape == b.shape == c.shape:
            raise ValueError(
                f"sample {i}: token counts differ: trainer_lps {a.shape}, rollout_lps {b.shape}, masks {c.shape}"
            )
    return t, r, m


def token_masked_mean(per_token: list[np.ndarray], masks: list[np.ndarray]) -> float:
    """Mean over every valid token of the batch (NeMo-RL / verl normalisation: long samples weigh more)."""
    total = sum(float(m.sum()) for m in masks)
    if total == 0:
        return float("nan")
    return sum(float((v * m).sum()) for v, m in zip(per_token, masks)) / total


def logprob_abs_diff_per_sample(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows) -> np.ndarray:
    """Per sample with a valid token, the masked mean of |trainer - rollout| (aborted samples are left out)."""
    t, r, m = _aligned(trainer_lps, rollout_lps, masks)
    return np.asarray([float((np.abs(a - b) * c).sum() / c.sum()) for a, b, c in zip(t, r, m) if c.sum() > 0],
                      dtype=np.float64)


def logprob_abs_diff(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows) -> float:
    """slime's definition: masked mean of |trainer - rollout| within each sample, then the mean over samples.

    Samples without a valid token (an aborted request) are left out rather than counted as 0, which would pull
    the mean down. NaN when no sample has a valid token.
    """
    per_sample = logprob_abs_diff_per_sample(trainer_lps, rollout_lps, masks)
    return float(per_sample.mean()) if per_sample.size else float("nan")


def episode_metrics(episodes: Sequence, route_row_bytes: int = 0) -> dict[str, float]:
    """The ``rollout/`` counters of a step's episodes (``r3rl.env.stitch.EpisodeStats``); route bytes when
    ``route_row_bytes`` (bytes of one route row: layers x top-k x id size) is given."""
    if not episodes:
        return {}
    out = {TURNS_MEAN: float(np.mean([e.turns for e in episodes])),
           TOOL_CALLS_MEAN: float(np.mean([e.tool_calls for e in episodes])),
           TOOL_ERRORS: float(sum(e.tool_errors for e in episodes)),
           OBSERVATION_TOKENS_MEAN: float(np.mean([e.observation_tokens for e in episodes])),
           CONTEXT_TRUNCATED: float(sum(e.context_truncated for e in episodes))}
    if route_row_bytes:
        out[ROUTE_BYTES_PER_EPISODE] = float(np.mean([e.route_rows_received for e in episodes])) * route_row_bytes
        out[ROUTE_BYTES_PER_EPISODE_FULL] = float(np.mean([e.route_rows_full for e in episodes])) * route_row_bytes
    known = [e.recomputed for e in episodes if e.recomputed is not None]
    if known:
        total = sum(known[1:], known[0])
        out[RECOMPUTED_ROWS] = float(total.rows)
        out[RECOMPUTED_ROWS_CHECKED] = float(total.checked)
        out[RECOMPUTED_ROWS_CHANGED] = float(total.changed)
    return out


def per_turn_mismatch(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows,
                      turn_of_token: ArrayRows, key: str = LOGPROB_ABS_DIFF_TURN) -> dict[str, float]:
    """``logprob_abs_diff`` restricted to each turn's policy tokens (``turn_of_token``: 1-based per response token,
    0 on observations), one key per turn that has a valid token; samples without a token of that turn are left out,
    as ``logprob_abs_diff`` leaves out samples without a valid token."""
    turns = [np.asarray(t) for t in turn_of_token]
    top = max((int(t.max()) for t in turns if t.size), default=0)
    out = {}
    for n in range(1, top + 1):
        value = logprob_abs_diff(trainer_lps, rollout_lps,
                                 [np.asarray(m, np.float64) * (t == n) for m, t in zip(masks, turns)])
        if np.isfinite(value):
            out[key.format(turn=n)] = value
    return out


def stderr(values: Sequence[float] | np.ndarray) -> float:
    """Standard error of the mean of ``values`` (sample std with ddof=1 over sqrt(n)); NaN below two values."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")


def clustered_stderr(values: Sequence[float] | np.ndarray, clusters: Sequence | np.ndarray) -> float:
    """Standard error of the mean of ``values`` when the values of one cluster (the samples of one prompt) are
    correlated: the cluster-robust (Liang-Zeger) estimate with the G / (G - 1) small-sample factor,
    ``sqrt(G / (G - 1) * sum_g (sum_{i in g} (v_i - mean))^2) / n``. With one value per cluster it is ``stderr``;
    NaN below two clusters."""
    v = np.asarray(values, dtype=np.float64)
    c = np.asarray(clusters)
    if v.shape != c.shape or v.ndim != 1:
        raise ValueError(f"values {v.shape} and clusters {c.shape} must be 1-D and of equal length")
    labels = np.unique(c)
    if labels.size < 2:
        return float("nan")
    centred = v - v.mean()
    sums = np.asarray([centred[c == g].sum() for g in labels])
    return float(np.sqrt(labels.size / (labels.size - 1) * np.sum(sums ** 2)) / v.size)


def mean_and_stderr(values: Sequence[float] | np.ndarray, clusters: Sequence | np.ndarray) -> tuple[float, float]:
    """The one rule for every figure r3rl reports with an error: the mean of ``values`` and its standard error
    clustered by what is independent (``clusters``: the prompt of each sample; the normalised problem,
    ``r3rl.data.overlap.problem_key``, of each eval prompt, since ``a + b`` and ``b + a`` are one problem)."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), clustered_stderr(v, clusters)


def paired_delta(replayed: np.ndarray, unreplayed: np.ndarray, clusters: Sequence | np.ndarray
                 ) -> tuple[float, float]:
    """Mean over samples of ``replayed - unreplayed`` (per-sample figures of one batch) and its standard error
    clustered by ``clusters`` (the prompt of each sample)."""
    return mean_and_stderr(np.asarray(replayed, np.float64) - np.asarray(unreplayed, np.float64), clusters)


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` (a whole number >= 1) degrees of freedom: the one-sided false-alarm rate
    of a "more than t standard errors" rule over df + 1 independent clusters (the normal's 1 in 740 at t = 3 is far
    too small for few clusters: 1 in 100 at 8). The closed series of Abramowitz and Stegun 26.7.3-4, no SciPy."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd: A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        inside = 2 / math.pi * (theta + s * math.cos(theta) * total) if df > 1 else 2 * theta / math.pi
    else:  # even: A = sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term, total = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            total += term
            term *= c2 * (2 * k - 1) / (2 * k)
        inside = s * total
    return (1 - inside) / 2


def t_isf(tail: float, df: int) -> float:
    """The t with P(T > t) = ``tail`` for Student's t with ``df`` degrees of freedom (``t_sf`` inverted by
    bisection): how many standard errors an interval over df + 1 clusters needs to be as wide as the normal's."""
    if not 0 < tail < 0.5:
        raise ValueError(f"tail must be in (0, 0.5), got {tail}")
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > tail:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf(mid, df) > tail else (lo, mid)
    return (lo + hi) / 2


def token_mult_prob_error(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows) -> float:
    """NeMo-RL's ``token_mult_prob_error``: token masked mean of exp(|trainer - rollout|); 1.0 is a perfect match."""
    t, r, m = _aligned(trainer_lps, rollout_lps, masks)
    return token_masked_mean([np.exp(np.abs(a - b)) for a, b in zip(t, r)], m)


# verl's bound on a log-ratio before exp() (its SAFETY_BOUND)
SAFETY_BOUND = 20.0


def is_metrics(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows, threshold: float
               ) -> dict[str, float]:
    """verl's token-level IS figures (``rollout_is=token``, cap C = ``threshold``), on the valid tokens before any
    rejection: w = exp(clamp(trainer - rollout, +-20)) before truncation; ``rollout_is_mean``, ``_max``, ``_min`` of
    w; ``rollout_is_ratio_fraction_high|low``: share of w above C and below 1/C; ``rollout_is_std`` and
    ``rollout_is_eff_sample_size`` (1 / mean((w_c / (mean(w_c) + 1e-8))^2)) on w_c = clamp(w, 1/C, C)."""
    t, r, m = _aligned(trainer_lps, rollout_lps, masks)
    if threshold <= 0:
        raise ValueError(f"IS threshold must be positive, got {threshold}")
    w = [np.exp(np.clip(a - b, -SAFETY_BOUND, SAFETY_BOUND)) for a, b in zip(t, r)]
    valid = np.concatenate([x[c > 0] for x, c in zip(w, m)]) if w else np.zeros(0)
    nan = float("nan")
    if valid.size == 0:
        return {k: nan for k in (ROLLOUT_IS_MEAN, ROLLOUT_IS_MAX, ROLLOUT_IS_MIN, ROLLOUT_IS_STD, ROLLOUT_IS_ESS,
                                 ROLLOUT_IS_FRACTION_HIGH, ROLLOUT_IS_FRACTION_LOW)}
    low = 1.0 / threshold
    wc = [np.clip(x, low, threshold) for x in w]
    mean_c = token_masked_mean(wc, m)
    var_c = token_masked_mean([x * x for x in wc], m) - mean_c * mean_c
    return {
        ROLLOUT_IS_MEAN: token_masked_mean(w, m),
        ROLLOUT_IS_MAX: float(valid.max()),
        ROLLOUT_IS_MIN: float(valid.min()),
        ROLLOUT_IS_STD: float(np.sqrt(max(var_c, 0.0))) if valid.size > 1 else 0.0,
        ROLLOUT_IS_ESS: 1.0 / token_masked_mean([(x / (mean_c + 1e-8)) ** 2 for x in wc], m),
        ROLLOUT_IS_FRACTION_HIGH: token_masked_mean([(x > threshold).astype(np.float64) for x in w], m),
        ROLLOUT_IS_FRACTION_LOW: token_masked_mean([(x < low).astype(np.float64) for x in w], m),
    }


def rs_metrics(masks: ArrayRows, kept: ArrayRows) -> dict[str, float]:
    """verl's rejection figures: ``rollout_rs_masked_fraction``, the share of valid tokens rejected (``kept`` 0,
    whether the rejection zeroes the token's weight or drops it from the count), and
    ``rollout_rs_seq_masked_fraction``, the share of all samples with at least one valid token rejected."""
    m, k = _rows("masks", masks), _rows("kept", kept)
    hit = [bool(((x > 0) & (y <= 0)).any()) for x, y in zip(m, k)]
    return {ROLLOUT_RS_MASKED_FRACTION: token_masked_mean([(y <= 0).astype(np.float64) for y in k], m),
            ROLLOUT_RS_SEQ_MASKED_FRACTION: float(np.mean(hit)) if hit else float("nan")}


def offpolicy_metrics(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows) -> dict[str, float]:
    """verl's off-policy figures (``compute_offpolicy_metrics``), trainer = its old_log_prob: ``kl`` (token mean of
    rollout - trainer), ``k3_kl`` (token mean of e^d - d - 1, d = trainer - rollout), per-sample perplexities
    exp(-mean log-prob) averaged over samples (``training_ppl``, ``rollout_ppl``) and their logs
    (``*_log_ppl``), ``log_ppl_diff`` = mean log-prob rollout - trainer per sample (mean, |.| mean, max, min),
    ``ppl_ratio`` = mean of exp(log_ppl_diff), ``chi2_token`` = token mean of exp(clamp(d))^2 - 1 and ``chi2_seq`` =
    mean of exp(2 clamp(sum d)) - 1 (clamps +-20). Per-sample figures over the samples with a valid token (verl
    counts an empty row as 0)."""
    t, r, m = _aligned(trainer_lps, rollout_lps, masks)
    rows = [(a, b, c) for a, b, c in zip(t, r, m) if c.sum() > 0]
    nan = float("nan")
    if not rows:
        return {k: nan for k in (ROLLOUT_CORR_KL, ROLLOUT_CORR_K3_KL, TRAINING_PPL, TRAINING_LOG_PPL, ROLLOUT_PPL,
                                 ROLLOUT_LOG_PPL, LOG_PPL_DIFF, LOG_PPL_ABS_DIFF, LOG_PPL_DIFF_MAX, LOG_PPL_DIFF_MIN,
                                 PPL_RATIO, CHI2_TOKEN, CHI2_SEQ)}
    mean_t = np.asarray([float((a * c).sum() / c.sum()) for a, _, c in rows])
    mean_r = np.asarray([float((b * c).sum() / c.sum()) for _, b, c in rows])
    diff = mean_r - mean_t
    d = [a - b for a, b in zip(t, r)]
    seq_sum = np.asarray([float(((a - b) * c).sum()) for a, b, c in rows])
    return {
        ROLLOUT_CORR_KL: token_masked_mean([-x for x in d], m),
        ROLLOUT_CORR_K3_KL: token_masked_mean([np.expm1(x) - x for x in d], m),
        TRAINING_PPL: float(np.exp(-mean_t).mean()),
        TRAINING_LOG_PPL: float((-mean_t).mean()),
        ROLLOUT_PPL: float(np.exp(-mean_r).mean()),
        ROLLOUT_LOG_PPL: float((-mean_r).mean()),
        LOG_PPL_DIFF: float(diff.mean()),
        LOG_PPL_ABS_DIFF: float(np.abs(diff).mean()),
        LOG_PPL_DIFF_MAX: float(diff.max()),
        LOG_PPL_DIFF_MIN: float(diff.min()),
        PPL_RATIO: float(np.exp(diff).mean()),
        CHI2_TOKEN: token_masked_mean([np.exp(2.0 * np.clip(x, -SAFETY_BOUND, SAFETY_BOUND)) for x in d], m) - 1.0,
        CHI2_SEQ: float(np.exp(2.0 * np.clip(seq_sum, -SAFETY_BOUND, SAFETY_BOUND)).mean()) - 1.0,
    }


def seq_mult_prob_error(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows) -> np.ndarray:
    """NeMo-RL's per-sequence multiplicative probability error (what ``seq_logprob_error_threshold`` gates on): the
    masked mean of exp(|trainer - rollout|) within each sample (``token_mult_prob_error`` per sequence); NaN for a
    sample without a valid token."""
    t, r, m = _aligned(trainer_lps, rollout_lps, masks)
    # no bound on |d| before exp(), as in NeMo-RL: one wild token must be able to push its sequence past the gate
    return np.asarray([float((np.exp(np.abs(a - b)) * c).sum() / c.sum())
                       if c.sum() > 0 else float("nan") for a, b, c in zip(t, r, m)], dtype=np.float64)


# |trainer - rollout| above ln 2: the two assign the token probabilities a factor of 2 or more apart
EXTREME_LOG_DIFF = float(np.log(2.0))


def extreme_token_fraction(trainer_lps: ArrayRows, rollout_lps: ArrayRows, masks: ArrayRows) -> float:
    """Share of valid tokens with |trainer - rollout| log-prob > ln 2."""
    t, r, m = _aligned(trainer_lps, rollout_lps, masks)
    return token_masked_mean([(np.abs(a - b) > EXTREME_LOG_DIFF).astype(np.float64) for a, b in zip(t, r)], m)


def routing_flip_metrics(per_layer: Sequence[float] | np.ndarray,
                         prompt_per_layer: Sequence[float] | np.ndarray | None = None) -> dict[str, float]:
    """``r3/routing_flip_rate`` (mean over layers: every layer sees the same rows) and one key per layer, over the
    response rows; ``r3/routing_flip_rate_prompt``, the mean over layers of the prompt rows' rates, when given."""
    rates = np.asarray(per_layer, dtype=np.float64)
    if rates.ndim != 1 or rates.size == 0:
        raise ValueError(f"routing flip rates: expected one value per layer, got shape {rates.shape}")
    out = {ROUTING_FLIP_RATE: float(rates.mean())}
    out.update({flip_rate_key(i): float(v) for i, v in enumerate(rates)})
    if prompt_per_layer is not None:
        prompt = np.asarray(prompt_per_layer, dtype=np.float64)
        out[ROUTING_FLIP_RATE_PROMPT] = float(prompt.mean()) if prompt.size else float("nan")
    return out


def router_margins(logits: np.ndarray, k: int) -> np.ndarray:
    """Per row of router logits ``[rows, E]`` (E > k; any top-(k+1) of them gives the same), the k-th largest
    logit minus the (k+1)-th: how far the last chosen expert stands from the first one left out. A flip needs a
    numerical difference larger than this margin."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] <= k:
        raise ValueError(f"router margins: need logits [rows, E] with E > k={k}, got shape {x.shape}")
    top = -np.sort(-x, axis=1)[:, :k + 1]
    return top[:, k - 1] - top[:, k]


def max_vio(load: Sequence[float] | np.ndarray) -> float:
    """MaxVio of one layer's expert load (tokens routed to each expert): max load / mean load - 1 (Wang et al.
    2024, "Auxiliary-loss-free load balancing"); 0 for a perfectly balanced layer, E - 1 when one expert takes every
    token (top-1); NaN without tokens."""
    x = np.asarray(load, dtype=np.float64)
    mean = x.mean() if x.size else 0.0
    return float(x.max() / mean - 1.0) if mean > 0 else float("nan")


def router_metrics(margin_per_layer: Sequence[float] | np.ndarray, small_per_layer: Sequence[float] | np.ndarray,
                   max_vio_per_layer: Sequence[float] | np.ndarray) -> dict[str, float]:
    """``r3/router_margin_mean`` and ``r3/router_margin_small_share`` (means over layers: every layer sees the same
    rows), ``r3/expert_load_max_vio`` (mean over layers) and one MaxVio key per layer."""
    vio = np.asarray(max_vio_per_layer, dtype=np.float64)

    def mean(values) -> float:
        v = np.asarray(values, dtype=np.float64)
        return float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")

    out = {ROUTER_MARGIN_MEAN: mean(margin_per_layer), ROUTER_MARGIN_SMALL_SHARE: mean(small_per_layer),
           EXPERT_LOAD_MAX_VIO: mean(vio)}
    out.update({EXPERT_LOAD_MAX_VIO_LAYER.format(layer=i): float(v) for i, v in enumerate(vio)})
    return out


def reward_stats(rewards: Sequence[float], groups: Sequence | None = None) -> dict[str, float]:
    """Mean, spread and range of a step's rewards; with ``groups`` (each sample's prompt) the clustered standard
    error of the mean too."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return {}
    out = {REWARD_MEAN: float(r.mean()), REWARD_STD: float(r.std()), REWARD_MIN: float(r.min()),
           REWARD_MAX: float(r.max())}
    if groups is not None:
        out[REWARD_STDERR] = clustered_stderr(r, np.asarray(groups))
    return out


def response_length_stats(lengths: Sequence[int]) -> dict[str, float]:
    n = np.asarray(lengths, dtype=np.float64)
    if n.size == 0:
        return {}
    return {RESPONSE_LENGTH_MEAN: float(n.mean()), RESPONSE_LENGTH_MIN: float(n.min()),
            RESPONSE_LENGTH_MAX: float(n.max())}


def perf_metrics(
    timings_s: Mapping[str, float],
    *,
    step_time_s: float | None = None,
    num_tokens: int | None = None,
    num_response_tokens: int | None = None,
) -> dict[str, float]:
    """``perf/<stage>_time_s`` per stage, ``perf/step_time_s`` (given, else the sum of the stages) and throughputs.

    ``perf/tokens_per_s`` = prompt + response tokens of the step over the step time; ``perf/rollout_tokens_per_s``
    = generated tokens over the generation's own time (stage ``generate``, timed where it ran: with
    ``algorithm.max_staleness >= 1`` it overlaps training, and ``rollout`` is only the wait for it), else over the
    rollout time.
    """
    out: dict[str, float] = {}
    for stage, seconds in timings_s.items():
        if not stage or "/" in stage:
            raise ValueError(f"timing stage {stage!r}: use a plain name such as {', '.join(PERF_STAGES)}")
        out[perf_time_key(stage)] = float(seconds)
    step = float(step_time_s) if step_time_s is not None else float(sum(timings_s.values()))
    if step_time_s is not None or timings_s:
        out[PERF_STEP_TIME] = step
    if num_tokens is not None and step > 0:
        out[PERF_TOKENS_PER_S] = num_tokens / step
    rollout_s = timings_s.get("generate", timings_s.get("rollout"))
    if num_response_tokens is not None and rollout_s:
        out[PERF_ROLLOUT_TOKENS_PER_S] = num_response_tokens / float(rollout_s)
    return out


def step_metrics(
    *,
    rollout_logprobs: ArrayRows,
    trainer_logprobs: ArrayRows,
    loss_masks: ArrayRows,
    trainer_logprobs_no_replay: ArrayRows | None = None,
    rewards: Sequence[float] = (),
    response_lengths: Sequence[int] = (),
    prompt_lengths: Sequence[int] = (),
    routing_flip_per_layer: Sequence[float] | np.ndarray | None = None,
    routing_flip_per_layer_prompt: Sequence[float] | np.ndarray | None = None,
    router_per_layer: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    sample_groups: Sequence | np.ndarray | None = None,
    replay_mismatch_rows: float | None = None,
    loss: float | None = None,
    grad_norm: float | None = None,
    timings_s: Mapping[str, float] | None = None,
    step_time_s: float | None = None,
) -> dict[str, float]:
    """The dict logged for one step (one ``wandb.log``), every key under ``train/``, ``rollout/``, ``r3/``, ``perf/``.

    ``trainer_logprobs`` are the log-probs the loss uses: with the rollout's routes replayed when R3 is on.
    ``trainer_logprobs_no_replay`` are the same batch's log-probs without replay; leave it None when R3 is off
    (the trainer's log-probs are then already without replay, and the no-replay figure equals the main one, so
    both runs of a comparison carry both keys). With ``trainer_logprobs_no_replay`` and ``sample_groups`` (the
    prompt of each sample) the paired delta (replayed - unreplayed, per sample) and its prompt-clustered standard
    error are logged. ``routing_flip_per_layer``: the trainer's flip rate per layer over the response rows
    (``routing_flip_per_layer_prompt``: over the prompt rows);
    ``router_per_layer``: (margin mean, small-margin share, expert-load MaxVio) per layer, from the same pass as
    the flip rate (``router_metrics``);
    ``replay_mismatch_rows``: its count of replayed rows that missed the rollout's route (R3 on only). Inputs left
    None are not logged.
    """
    replayed = logprob_abs_diff_per_sample(trainer_logprobs, rollout_logprobs, loss_masks)
    unreplayed = replayed if trainer_logprobs_no_replay is None else logprob_abs_diff_per_sample(
        trainer_logprobs_no_replay, rollout_logprobs, loss_masks)
    # the prompt of each sample with a valid token (the per-sample figures leave the others out)
    groups = None if sample_groups is None else np.asarray(sample_groups)[
        np.asarray([float(np.sum(m)) > 0 for m in loss_masks], dtype=bool)]

    def se(values: np.ndarray) -> float:
        return stderr(values) if groups is None else clustered_stderr(values, groups)

    out: dict[str, float] = {
        LOGPROB_ABS_DIFF: float(replayed.mean()) if replayed.size else float("nan"),
        LOGPROB_ABS_DIFF_STDERR: se(replayed),
        LOGPROB_ABS_DIFF_NO_REPLAY: float(unreplayed.mean()) if unreplayed.size else float("nan"),
        LOGPROB_ABS_DIFF_NO_REPLAY_STDERR: se(unreplayed),
    }
    if trainer_logprobs_no_replay is not None and groups is not None:
        delta, delta_se = paired_delta(replayed, unreplayed, groups)
        out[LOGPROB_ABS_DIFF_PAIRED_DELTA] = delta
        out[LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR] = delta_se
    if loss is not None:
        out[LOSS] = float(loss)
    if grad_norm is not None:
        out[GRAD_NORM] = float(grad_norm)
    out.update(reward_stats(rewards, sample_groups))
    out.update(response_length_stats(response_lengths))
    if routing_flip_per_layer is not None:
        out.update(routing_flip_metrics(routing_flip_per_layer, routing_flip_per_layer_prompt))
    if router_per_layer is not None:
        out.update(router_metrics(*router_per_layer))
    if replay_mismatch_rows is not None:
        out[REPLAY_MISMATCH_ROWS] = float(replay_mismatch_rows)
    if timings_s is not None or step_time_s is not None:
        num_response = int(np.sum(response_lengths)) if len(response_lengths) else None
        num_tokens = None
        if num_response is not None and len(prompt_lengths):
            num_tokens = num_response + int(np.sum(prompt_lengths))
        out.update(perf_metrics(timings_s or {}, step_time_s=step_time_s, num_tokens=num_tokens,
                                num_response_tokens=num_response))
    return out
