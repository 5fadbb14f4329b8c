"""What every key r3rl logs means: one entry per key or family, with its definition and where the name and definition
come from. ``python -m r3rl.metric_docs`` writes the docs site's metric reference from it; a test fails when a real
run logs a key no entry matches.

Keys are written as logged; ``*`` stands for a part that varies (a layer, a turn, an eval set, a stage), matched with
``fnmatch``. The definitions use the notation of ``NOTATION``.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from r3rl import metrics as M

NOTATION = ("Notation: d = trainer - rollout log-prob of a response token (trainer = pi_old, replayed under R3); "
            "w = exp(clamp(d, +-20)); valid = the step's loss-mask tokens; per-sample figures are averaged over the "
            "samples with a valid token; C = `correction.ratio_high`. Sources: verl "
            "`verl/trainer/ppo/rollout_corr_helper.py` @b178a3cd, NeMo-RL `nemo_rl/algorithms/grpo.py` and "
            "`nemo_rl/algorithms/loss/loss_functions.py` @7ea279ab, slime.")
OUT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"


@dataclass(frozen=True)
class MetricDoc:
    keys: tuple[str, ...]  # as logged; * for a varying part
    definition: str
    source: str = "r3rl"
    section: str = ""


def _docs(section: str, *entries: tuple) -> list[MetricDoc]:
    return [MetricDoc(tuple(keys) if not isinstance(keys, str) else (keys,), definition, *(rest or ()),
                      section=section) for keys, definition, *rest in entries]


METRIC_DOCS: tuple[MetricDoc, ...] = tuple([
    *_docs(
        "Train-rollout mismatch",
        (M.LOGPROB_ABS_DIFF, "per sample, masked mean of |d|; then the mean over samples; with replay when R3 is on",
         "slime `train_rollout_logprob_abs_diff`"),
        (M.LOGPROB_ABS_DIFF_NO_REPLAY, "the same, same batch, without replay (R3: every replay.no_replay_every steps)"),
        ((M.LOGPROB_ABS_DIFF_STDERR, M.LOGPROB_ABS_DIFF_NO_REPLAY_STDERR),
         "the standard error of each over the step's samples, clustered by prompt (a prompt's samples are "
         "correlated)"),
        (M.LOGPROB_ABS_DIFF_PAIRED_DELTA, "mean over samples of the (replayed - unreplayed) per-sample figure, same "
                                          "batch; negative = replay removes mismatch"),
        (M.LOGPROB_ABS_DIFF_PAIRED_DELTA_STDERR, "its standard error clustered by prompt: sqrt(G/(G-1) sum_g (sum_{i "
                                                 "in g} (delta_i - mean))^2) / n over the G prompts",
         "Liang-Zeger CR1"),
        (M.TOKEN_MULT_PROB_ERROR, "token masked mean of exp|d| over the step, with NeMo-RL's mask token_mask * "
                                  "sample_mask after the sequence gate (correction.seq_error_threshold)", "NeMo-RL"),
        (M.LOGPROB_ABS_DIFF_FRESH, "train/logprob_abs_diff over the samples of staleness 0 only (absent when there "
                                   "are none): the engine mismatch without policy lag"),
        (("train/logprob_abs_diff_*_version_tokens", "train/logprob_abs_diff_no_replay_*_version_tokens"),
         "max_staleness >= 1: the mismatch (and its unreplayed twin) over the response tokens the weights of pi_old "
         "generated (current) or older weights generated (older)"),
        (("train/logprob_abs_diff/turn_*", "train/logprob_abs_diff_no_replay/turn_*"),
         "multi-turn: the mismatch over the policy tokens of turn t only (observations never count)"),
        (M.EXTREME_TOKEN_FRACTION, "share of valid tokens with |d| > ln 2"),
    ),
    *_docs(
        "Routing",
        ((M.ROUTING_FLIP_RATE, "r3/routing_flip_rate/layer_*"),
         "share of (row, layer) top-k sets the trainer's own router picks differently from the rollout's, over the "
         "response rows in the loss (observation tokens and masked samples left out), each real sample once; per "
         "layer and the mean"),
        (M.ROUTING_FLIP_RATE_PROMPT, "the same over the prompt rows (0 .. P-2), mean over layers"),
        ((M.ROUTER_MARGIN_MEAN, M.ROUTER_MARGIN_SMALL_SHARE),
         "over the flip rate's rows, from the trainer's own router logits: the k-th minus the (k+1)-th largest logit, "
         f"mean over rows and layers, and the share of rows under {M.SMALL_ROUTER_MARGIN}"),
        ((M.EXPERT_LOAD_MAX_VIO, "r3/expert_load_max_vio/layer_*"),
         "per layer, the experts' load under the router's own top-k over those rows: max load / mean load - 1; mean "
         "over layers", "MaxVio (Wang et al. 2024)"),
        (M.REPLAY_MISMATCH_ROWS, "rows where the routing map Megatron used under replay differs from the rollout's "
                                 "route on the Sample, mapped back through the packing; 0 proves each route reached "
                                 "its token and layer; NaN when the check saw no row"),
        ((M.RECOMPUTED_ROWS, M.RECOMPUTED_ROWS_CHECKED, M.RECOMPUTED_ROWS_CHANGED),
         "multi-turn, summed over the step's episodes: held route rows a later turn's prefill computed again, those "
         "the turn sent back (env.route_overlap_rows), and those with another expert set in some layer (the held row "
         "is replayed either way: the earliest forward wins)"),
        ((M.R2_REPLAY_MISMATCH_ROWS, M.R2_REPLAYED_ROWS),
         "R2: rows of the training forwards whose routing map differed from the route the trainer recorded in its "
         "old-log-prob pass (0 proves the replay), and the rows checked"),
    ),
    *_docs(
        "Rollout correction",
        (("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min",
          "rollout_corr/rollout_is_std", "rollout_corr/rollout_is_eff_sample_size",
          "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low"),
         "token-level importance weights w over the valid tokens (verl's compute_is_metrics, cap C): mean, max, min, "
         "std, effective sample size (sum w)^2 / (n sum w^2) of the truncated weights, share above C and below 1/C",
         "verl"),
        (("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction"),
         "share of valid tokens, and of sequences, the correction rejected (icepop, seq_mask_tis)", "verl"),
        (("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/training_log_ppl",
          "rollout_corr/rollout_ppl", "rollout_corr/rollout_log_ppl", "rollout_corr/log_ppl_diff",
          "rollout_corr/log_ppl_abs_diff", "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min",
          "rollout_corr/ppl_ratio", "rollout_corr/chi2_token", "rollout_corr/chi2_seq"),
         "verl's compute_offpolicy_metrics on the rollout's tokens: KL(rollout || trainer) (direct and k3), "
         "perplexities and their log differences per sequence, chi-squared of the token and sequence ratios",
         "verl"),
        (M.IS_OOB_RATIO, "share of valid tokens whose ratio leaves the correction's band (tis, icepop, "
                         "seq_mask_tis)", "NeMo-RL"),
        ((M.MEAN_SEQ_MULT_PROB_ERROR, M.MAX_SEQ_MULT_PROB_ERROR),
         "per sequence, the token mean of exp|d|; mean and max over the step", "NeMo-RL"),
        (M.SEQ_ERROR_GATED_FRACTION, "share of sequences the sequence gate (correction.seq_error_threshold) took out"),
        (M.CORRECTION_KEPT_TOKENS, "valid tokens the correction kept in the loss"),
    ),
    *_docs(
        "Training",
        ((M.LOSS, "train/pg_loss", "train/kl"), "the policy loss per loss token (GRPO's clipped surrogate), its "
                                               "policy-gradient part and KL penalty"),
        ((M.GRAD_NORM, "train/grad_norm_max"), "gradient norm, mean and max over the step's optimizer steps"),
        (("train/clip_frac", "train/ratio_mean"), "share of loss tokens whose ratio pi / pi_old was clipped; its "
                                                  "mean"),
        (("train/loss_tokens", "train/lr", "train/optimizer_steps", "train/skipped_steps", "train/rejected_steps"),
         "tokens in the loss, learning rate, optimizer steps of the step, steps skipped (the optimizer's own, and "
         "non-finite gradients rejected) and rejected"),
        (("train/replay_backward_unconsumed", "train/replay_queue_after", "train/replay_queue_after_step"),
         "R3 bookkeeping: replayed routes the backward pass did not consume, and routes left queued after the step "
         "(both 0)"),
        (("train/replay_mismatch_rows", "train/replayed_rows"),
         "the training forwards' own replay check: rows whose routing map differed from the replayed route (0), and "
         "the rows replayed (under replay=soft, the routes the filter chose, recomputed from the live logits)"),
        (("train/router_replay_replace_rate",),
         "replay=soft: the share of replayed (row, slot) experts the trainer's router overrode in the training "
         "forwards (prime-rl's figure: kept only at >= replay.soft_ratio x the trainer's weakest top-k score)"),
        (("train/later_minibatch_logprob_abs_diff",),
         "several optimizer steps per rollout batch: |log-prob - rollout log-prob| of the mini-batches after the "
         "first, in their training forwards (weights the earlier ones moved), averaged as train/logprob_abs_diff "
         "(slime's: over each sample's loss tokens, then over samples)"),
    ),
    *_docs(
        "Rollout",
        (("rollout/reward_mean", "rollout/reward_std", "rollout/reward_min", "rollout/reward_max"),
         "rewards of the step's samples"),
        (M.REWARD_STDERR, "standard error of rollout/reward_mean, clustered by prompt"),
        (("rollout/response_length_mean", "rollout/response_length_min", "rollout/response_length_max"),
         "response tokens per sample"),
        ((M.FILTERED_GROUPS, M.GENERATION_ROUNDS, M.PADDED_GROUPS),
         "algorithm.dynamic_sampling: groups dropped for all-equal raw accuracy, generation rounds of the step, "
         "dropped groups put back when max_generation_rounds ran out", "DAPO (verl's filter_groups)"),
        (M.OVERLONG_PENALTY_MEAN, "algorithm.overlong_buffer: mean soft overlong penalty over the step's samples",
         "DAPO"),
        ((M.STALENESS_MEAN, M.STALENESS_MAX, M.DROPPED_STALE),
         "algorithm.max_staleness: trainer versions between a sample's oldest generating weights and the weights it "
         "is trained from, mean and max; samples out of the loss because their group holds one past the bound"),
        ((M.PREEMPTIONS, M.PREEMPTIONS_WINDOW_SHARED, M.PREEMPTED_SPANNING_SAMPLES),
         "the engines' preemptions while the step's batch generated (vllm:num_preemptions_total read when its "
         "generation starts and ends: a request recomputed after its KV blocks were taken), and 1 where another "
         "batch generated in the same window (in flight, completion order), whose preemptions the count may hold; "
         "weight_update=in_flight: samples that spanned an update in a step with preemptions, an "
         "upper bound on those recomputed by newer weights than the routes they returned (0 proves none was)"),
        (M.EVICTED_RESPONSE_LENGTH_MEAN,
         "mean response length of the samples out of the loss as stale (absent when none are): beside "
         "rollout/response_length_mean it shows how much completion-order intake favours short responses"),
        ((M.STALENESS_TOKEN_MEAN, M.SPANNING_VERSIONS_SHARE),
         "per response token in the loss, trainer version minus the version that sampled it (vLLM's spans, not "
         "capped by the version its request was sent under), mean; share of samples whose tokens came from more "
         "than one version (weight_update=in_flight)"),
        ((M.GROUPS_PENDING, M.GROUPS_OVERTAKING),
         "group_intake=completion: groups drawn and not yet trained once the step took its own; the step's groups "
         "drawn after one still pending (they overtook it)"),
        ((M.TURNS_MEAN, M.TOOL_CALLS_MEAN, M.OBSERVATION_TOKENS_MEAN, M.TOOL_ERRORS, M.CONTEXT_TRUNCATED,
          M.EPISODES_MASKED),
         "multi-turn: means over the step's episodes of policy turns, tool calls and observation tokens; counts of "
         "tool errors, episodes cut by env.max_context_tokens, and samples masked with their group"),
        ((M.ROUTE_BYTES_PER_EPISODE, M.ROUTE_BYTES_PER_EPISODE_FULL),
         "multi-turn: route bytes received per episode asking each turn for the rows it lacks, and what the whole "
         "context every turn would have sent"),
    ),
    *_docs(
        "Performance",
        (("perf/*_time_s",), "seconds per stage of the step (rollout, generate, logprobs, train, weight_sync, eval), "
                             "and perf/step_time_s for the whole step"),
        ((M.PERF_TOKENS_PER_S, M.PERF_ROLLOUT_TOKENS_PER_S),
         "the step's tokens per second of the step; response tokens per second of generation"),
        (M.PERF_TRAINER_RESERVED_AT_WAKE, "colocated: GiB the trainer rank holding most still reserved on its GPU "
                                          "when the engines woke (0 without CUDA)"),
    ),
    *_docs(
        "Held-out eval",
        (("eval/*/avg@*", "eval/*/pass@*"), "n samples per prompt: mean reward; share of prompts with any of n "
                                            "correct; pass@k (k < n) unbiased, 1 - C(n-c, k)/C(n, k)",
         "Chen et al. 2021 (pass@k)"),
        (("eval/*/avg@*_stderr", "eval/*/pass@*_stderr"), "their standard errors over prompts, clustered by "
                                                          "normalised problem"),
        (("eval/*/response_length_mean", "eval/*/truncated_share", "eval/*/overlaps_removed"),
         "eval responses' mean length, share that hit max_tokens, problems left out as training problems"),
    ),
    *_docs(
        "SFT",
        ((M.SFT_LOSS, M.SFT_GRAD_NORM, M.SFT_TOKENS_PER_S, M.SFT_LOSS_TOKENS, M.SFT_LR),
         "recipe=sft: mean NLL of the response tokens, gradient norm, tokens per second, tokens in the loss, "
         "learning rate"),
    ),
    *_docs(
        "Step axes",
        (tuple(M.STEP_AXES.values()), "each prefix's own step axis (W&B define_metric)"),
    ),
])


def documented(key: str, docs: Iterable[MetricDoc] = METRIC_DOCS) -> MetricDoc | None:
    """The entry a logged key falls under, if any."""
    return next((d for d in docs for pattern in d.keys if fnmatch.fnmatchcase(key, pattern)), None)


def page() -> str:
    lines = ["# Metric reference", "",
             "Every key r3rl logs, one `wandb.log` per step with a step axis per prefix. Written by "
             "`python -m r3rl.metric_docs` from `r3rl.metric_docs.METRIC_DOCS`; `*` stands for a part that varies.",
             "", NOTATION]
    section = None
    for d in METRIC_DOCS:
        if d.section != section:
            section = d.section
            lines += ["", f"## {section}", "", "| key | definition | source |", "|---|---|---|"]
        keys = ", ".join(f"`{k}`" for k in d.keys)
        lines.append(f"| {keys} | {d.definition.replace('|', chr(92) + '|')} | {d.source} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the docs site's metric reference")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"stale: {OUT}; run python -m r3rl.metric_docs", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"written: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
