"""The names of the recipe, replay and correction options, which routing replay a config runs (``replay.name``
with ``auto`` resolved against the rollout), and what ``auto``/``null`` stand for in dtypes and engine concurrency."""

from __future__ import annotations

REPLAY_NAMES = ("auto", "none", "r2", "r3", "soft")
# the recipes run.py launches (recipes/<name>.py)
RECIPE_NAMES = ("grpo", "sft")
LOSS_NAMES = ("grpo", "gspo")
# the options of r3rl.train.correction
CORRECTION_NAMES = ("none", "tis", "icepop", "seq_mask_tis")
# when the engines take new weights under max_staleness >= 1 (recipes/grpo.py)
WEIGHT_UPDATE_NAMES = ("between_batches", "in_flight")
# how a step takes its groups: the batch of prompts drawn for it, or the first groups to complete (r3rl.rollout.group_stream)
GROUP_INTAKE_NAMES = ("batch", "completion")
# correction.rejected_tokens: what a token IcePop / seq_mask_tis rejects does to the loss's token count
REJECTED_TOKENS = ("zero_weight", "drop_from_count")
# the disjoint shares of a generated problem space (r3rl.data.arithmetic.SPLITS gives their sizes)
SPLIT_NAMES = ("sft", "rl", "heldout")
# data.split that draws from every share but the held-out one (sft and rl): GRPO's prompts on the default CPU run
TRAIN_SPLIT = "train"


def replay_mode(cfg) -> str:
    """``none``, ``r2`` or ``r3``. ``auto`` is ``r3`` when the engines return routed experts
    (``rollout.routing_replay``, rollout=vllm_r3) and ``none`` otherwise; ``soft`` is ``r3`` whose replayed experts
    the trainer's router may override (``soft_replay_ratio``)."""
    name = cfg.replay.name
    if name == "auto":
        return "r3" if cfg.rollout.routing_replay else "none"
    return "r3" if name == "soft" else name


def soft_replay_ratio(cfg) -> float | None:
    """``replay=soft``: the share of the trainer's weakest top-k score a replayed expert needs to stay
    (``replay.soft_ratio``; ``r3rl.train.replay.soft_targets``); None for every other replay."""
    return float(cfg.replay.soft_ratio) if cfg.replay.name == "soft" else None


def unreplayed_pass_due(cfg, step: int) -> bool:
    """R3 only: whether step ``step`` (from 1) runs the paired unreplayed log-prob pass (``replay.no_replay_every``;
    step 1 always does)."""
    return replay_mode(cfg) == "r3" and (step - 1) % cfg.replay.no_replay_every == 0


def pi_old_from_training_forward(cfg) -> bool:
    """Whether a GRPO step takes pi_old from its own training forward (``MegatronTrainer.train_on_policy``) rather
    than from a no-grad pass first. It can when the step is one optimizer step (its samples one global batch: the
    forward then runs on the weights pi_old stands for), its loss takes no correction weights or masks (computed from
    pi_old before the loss: ``correction.name=none`` without the gate), the pass measures nothing else (R2 records
    the trainer's own routes in it; without replay but with the engine's routes it measures the routing flips) and
    there are no pipeline stages (1F1B interleaves forwards of several micro batches);
    ``algorithm.separate_old_logprob_pass`` keeps the pass anyway, and so does ``debug.route_trace`` (the trace
    reads the routing of that replayed no-grad pass)."""
    alg, corr, mode = cfg.algorithm, cfg.correction, replay_mode(cfg)
    return (not alg.separate_old_logprob_pass and not cfg.debug.route_trace and (mode == "r3" or (mode == "none" and not cfg.rollout.routing_replay))
            and corr.name == "none" and corr.seq_error_threshold is None
            and alg.rollout_batch_size * alg.n_samples_per_prompt == alg.global_batch_size
            and cfg.parallelism.trainer.pipeline_parallel == 1)


def resolve_dtype(value: str, device: str) -> str:
    """``auto``: bfloat16 on GPUs, float32 on the CPU profile."""
    if value != "auto":
        return value
    return "float32" if device == "cpu" else "bfloat16"


def group_buffer(cfg) -> int:
    """``algorithm.group_intake=completion``: the most groups drawn and not yet trained (generating, or done and
    waiting for a step); ``algorithm.group_buffer``, or when 0 the (max_staleness + 1) batches the staleness bound
    lets the stream draw ahead of the trainer anyway (``r3rl.rollout.group_stream``)."""
    alg = cfg.algorithm
    return alg.group_buffer or (alg.max_staleness + 1) * alg.rollout_batch_size


def group_draw_limit(cfg, engine_version: int) -> int:
    """The draw serials a stream of groups may reach while the engines serve ``engine_version``: serial k is taken
    around step k // rollout_batch_size + 1, whose trainer is one version older than that step, so a group drawn
    now comes out no more than ``max_staleness`` versions old if it completes in its turn; and none past what the
    run's last step takes (``run.num_steps`` batches: more would be generated for nothing)."""
    alg = cfg.algorithm
    return min(engine_version + alg.max_staleness + 1, cfg.run.num_steps) * alg.rollout_batch_size


def engine_concurrency(cfg) -> int:
    """Samples in flight per engine: ``rollout.engine.max_concurrency``, or when null a GRPO step's samples over the
    engines (rollout_batch_size x n_samples_per_prompt / engines, rounded up), so that a step goes out in one wave
    and vLLM's scheduler, not the client, decides what runs (it queues what its KV cache cannot hold)."""
    set_value = cfg.rollout.engine.max_concurrency
    if set_value is not None:
        return set_value
    engines = 1 if cfg.rollout.engine.url else max(cfg.parallelism.rollout.num_engines, 1)
    alg = cfg.algorithm
    return -(-alg.rollout_batch_size * alg.n_samples_per_prompt // engines)
