"""Routing replay through Megatron's RouterReplay on the real tiny Qwen3-MoE (CPU, gloo)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl import metrics as M
from r3rl.train.routes import RouteError


def routed(policy, n=8, seed=0, routes="random", lengths=None):
    samples = build_samples(n, seed, lengths=lengths)
    m = policy.cfg.model
    if routes == "random":
        return with_routes(samples, random_routes(samples, m.num_moe_layers, m.moe_topk, m.num_experts, seed))
    return with_routes(samples, policy.record_routes(samples))


def assert_replay_state_empty(policy):
    for router in policy.routers:
        rr = router.router_replay
        assert rr.replay_backward_list == [] and rr.target_topk_idx is None and rr.router_replay_action is None


def test_forced_routes_are_the_routes_used(policy):
    samples = routed(policy, routes="random")
    replayed = policy.logprobs(samples, replay=True)
    live = policy.logprobs(samples, replay=False)
    # the routing map Megatron built equals the replay target on every row of every layer
    assert replayed.replayed_routes_match is True and replayed.replay_mismatch_rows == 0
    # and the forced routes really were not the router's own choice
    assert (live.flip_per_layer > 0.5).all()
    assert max(np.abs(a - b).max() for a, b in zip(replayed.logprobs, live.logprobs)) > 1e-3
    assert_replay_state_empty(policy)


def test_router_weights_get_gradients_under_replay(policy):
    samples = routed(policy, routes="random")
    adv = np.linspace(-1.0, 1.0, len(samples))
    out = policy.gradients(samples, adv, replay=True)
    router_grads = {n: g for n, g in out["grads"].items() if n.endswith("mlp.router.weight")}
    assert len(router_grads) == policy.cfg.model.num_layers
    assert all(float(g.abs().sum()) > 0 for g in router_grads.values())
    assert out["replay_queue_after"] == 0
    assert_replay_state_empty(policy)


def test_router_gradients_under_replay_equal_the_unreplayed_where_routes_coincide(policy, monkeypatch):
    """Replaying the routers' own routes (equal lengths: no padding row), every gradient, the routers' included,
    equals the pass without replay. Fails if the replayed weights were gathered from scores that carry no gradient
    back to the router (ISEEKYAN/Megatron-LM #79: probabilities taken after the top-k mask): the fault is planted
    below and the routers' gradients then vanish while the rest still trains."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    samples = routed(policy, routes="record", lengths=(7, 6))
    adv = np.linspace(-1.0, 1.0, len(samples))
    live = policy.gradients(samples, adv, replay=False)["grads"]
    replayed = policy.gradients(samples, adv, replay=True)["grads"]
    routers = [n for n in live if n.endswith("mlp.router.weight")]
    assert len(routers) == policy.cfg.model.num_layers and all(float(live[n].abs().sum()) > 0 for n in routers)
    worst = {n: float((live[n] - replayed[n]).abs().max() / live[n].abs().max().clamp_min(1e-30)) for n in live}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]

    original = RouterReplay.get_replay_topk

    def after_the_mask(self, scores, *args, **kwargs):  # the #79 fault: the replayed weights lose the graph
        return original(self, scores.detach(), *args, **kwargs)

    monkeypatch.setattr(RouterReplay, "get_replay_topk", after_the_mask)
    faulty = policy.gradients(samples, adv, replay=True)["grads"]
    assert all(float(faulty[n].abs().sum()) == 0 for n in routers)
    assert any(not torch.equal(faulty[n], torch.zeros_like(faulty[n])) for n in live if n not in routers)
    assert_replay_state_empty(policy)


def test_replaying_recorded_routes_reproduces_unreplayed_logprobs_exactly(policy):
    # equal lengths: no padding rows, so both passes hand every expert exactly the same tokens
    samples = routed(policy, routes="record", lengths=(7, 6))
    live = policy.logprobs(samples, replay=False)
    replayed = policy.logprobs(samples, replay=True)
    assert all(np.array_equal(a, b) for a, b in zip(live.logprobs, replayed.logprobs))
    assert np.array_equal(live.flip_per_layer, np.zeros(policy.cfg.model.num_layers))
    assert replayed.replayed_routes_match is True

    # other routes for a few tokens of one layer change the log-probs of what follows them
    changed = [s.routed_experts.copy() for s in samples]
    e = policy.cfg.model.num_experts
    for r in changed:
        r[len(r) // 2:, 1] = (r[len(r) // 2:, 1] + 1) % e  # still distinct and in range
    other = policy.logprobs(with_routes(samples, changed), replay=True)
    assert other.replayed_routes_match is True
    assert all(not np.array_equal(a, b) for a, b in zip(other.logprobs, live.logprobs))


def test_padding_rows_only_perturb_rounding(policy):
    # with padding, filler rows send pad tokens to other experts than live routing would, which changes the row
    # count of those experts' GEMMs and so the float rounding of real tokens, and nothing more
    samples = routed(policy, routes="record")
    assert len({s.num_tokens for s in samples}) > 1
    live = policy.logprobs(samples, replay=False)
    replayed = policy.logprobs(samples, replay=True)
    assert max(np.abs(a - b).max() for a, b in zip(live.logprobs, replayed.logprobs)) < 1e-5
    assert replayed.replayed_routes_match is True


def test_flip_rate_counts_response_rows_once_and_prompt_rows_apart(policy):
    """6 samples in micro batches of 4 (the second carries two padding slots repeating a real sample). A changed
    route on each sample's first prompt row (layer 2) and on its first scored row, P-1 (layer 1): the response
    flip rate of layer 1 is 6 over the response rows in the loss (the tokens with loss mask 1), that of layer 2 is
    0; the prompt flip rate of layer 2 is 6 over the prompt rows (sum of P-1). A changed route (layer 3) on the row
    scoring a token out of the loss (the last token of every third sample) counts nowhere.

    Fails if the flip rate counts prompt rows or the padding slots' repeats (the old definition: over every row of
    every slot), if the first scored row P-1 is counted as a prompt row, or if it counts rows whose token the loss
    masks (an episode's observation tokens, a masked sample: not the tokens train/logprob_abs_diff averages)."""
    samples = routed(policy, n=6, routes="record")
    assert len(samples) % policy.cfg.trainer.micro_batch_size != 0, "the last micro batch must carry padding"
    e = policy.cfg.model.num_experts
    for s in samples:
        s.routed_experts = s.routed_experts.copy()
        s.routed_experts[0, 2] = (s.routed_experts[0, 2] + 3) % e  # a prompt row: its set can only change
        first_scored = len(s.prompt_ids) - 1
        s.routed_experts[first_scored, 1] = (s.routed_experts[first_scored, 1] + 3) % e
        if s.loss_mask[-1] == 0:  # the row scoring the last token, out of the loss
            s.routed_experts[-1, 3] = (s.routed_experts[-1, 3] + 3) % e
    assert any(s.loss_mask[-1] == 0 for s in samples)
    live = policy.logprobs(samples, replay=False)
    response_rows = sum(int((s.loss_mask > 0).sum()) for s in samples)
    prompt_rows = sum(len(s.prompt_ids) - 1 for s in samples)
    expected = np.zeros(policy.cfg.model.num_layers)
    expected[1] = len(samples) / response_rows
    assert np.allclose(live.flip_per_layer, expected)
    expected_prompt = np.zeros(policy.cfg.model.num_layers)
    expected_prompt[2] = len(samples) / prompt_rows
    assert np.allclose(live.flip_per_layer_prompt, expected_prompt)


def test_router_margins_and_expert_load_come_from_the_routers_own_choice_on_response_rows(policy):
    """6 samples in micro batches of 4 (padding repeats in the second), with rollout routes that are not the
    router's choice. Per layer, the MaxVio of the pass equals the one of the router's own recorded top-k over the
    response rows in the loss (P-1 .. T-2 of each real sample, loss mask 1); margins are positive, the small-margin
    share a share. Fails if the load counts prompt rows, masked tokens' rows, the padding slots' repeats, or the
    rollout's routes instead of the router's own."""
    m = policy.cfg.model
    samples = build_samples(6, 3)
    own = policy.record_routes(samples)
    with_routes(samples, random_routes(samples, m.num_layers, m.moe_topk, m.num_experts, 3))
    live = policy.logprobs(samples, replay=False)
    for layer in range(m.num_layers):
        load = sum(np.bincount(r[len(s.prompt_ids) - 1:][s.loss_mask > 0, layer].ravel().astype(np.int64),
                               minlength=m.num_experts) for s, r in zip(samples, own))
        assert live.load_max_vio_per_layer[layer] == pytest.approx(M.max_vio(load)), layer
    assert (live.margin_per_layer > 0).all()
    assert ((live.small_margin_per_layer >= 0) & (live.small_margin_per_layer <= 1)).all()


# aten ops that read a device value back to the host: a data-dependent output shape (nonzero and what calls it),
# a Python scalar, and bincount (CUDA's reads min()/max() to size its output)
_SYNCING_OPS = ("nonzero", "_local_scalar_dense", "bincount", "masked_select", "unique", "_unique2",
                "repeat_interleave", "item")


def test_the_probe_reads_nothing_back_per_router_call(policy, monkeypatch):
    """Every aten op the probe's router hook runs, recorded with torch's dispatch mode over a replayed and an
    unreplayed pass (micro batches with padding slots): none of them syncs with the host on a GPU (no boolean-mask
    index, which runs nonzero; no bincount; no ``.item()``). The counting shim stands in for CUDA's
    ``set_sync_debug_mode``, which the GPU check runs. Fails if the margins or the expert load go back to
    ``[response]`` indexing or ``torch.bincount``, or a count is read with ``int()`` inside the hook."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from r3rl.train.replay import RouteProbe

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                       for i in (args[1] if len(args) > 1 else ())):
                name = "index(bool mask)"
            seen.append(name)
            return func(*args, **(kwargs or {}))

    hook = RouteProbe._hook

    def recorded(self, router, args, output):
        with Record():
            hook(self, router, args, output)

    monkeypatch.setattr(RouteProbe, "_hook", recorded)
    samples = routed(policy, n=6, routes="random")
    assert len(samples) % policy.cfg.trainer.micro_batch_size != 0, "padding slots make the response mask partial"
    replayed = policy.logprobs(samples, replay=True)
    live = policy.logprobs(samples, replay=False)
    assert replayed.replay_mismatch_rows == 0 and (live.flip_per_layer > 0).all()  # the hooks ran and counted
    syncing = sorted({n for n in seen if n in _SYNCING_OPS or n == "index(bool mask)"})
    assert syncing == [], f"host syncs in the probe's router hook: {syncing}"
    assert "topk" in seen  # the shim saw the hook's ops


def test_probe_margins_equal_metrics_definition_on_the_same_router_logits(policy, hf_reference):
    """The probe accumulates margins on the device (no host copy per router call); per layer its mean over the
    response rows equals ``metrics.router_margins`` on transformers' router logits of the same float32 checkpoint,
    and its small-margin share the share under ``SMALL_ROUTER_MARGIN``; its share of rows within the engine's
    rounding reach (the doctor's flip bound) the share whose margin is under u (|x_k| + |x_k+1| + ||w * h||_2 of
    each), u of the bf16 engine, h the router's input as transformers' router receives it. Fails if the device-side
    margin took another pair of logits than the k-th and (k+1)-th, summed prompt or padding rows, lost rows between
    micro batches, or took the reach from another dtype, logits or router inputs."""
    import torch

    m = policy.cfg.model
    samples = build_samples(6, 5)
    with_routes(samples, random_routes(samples, m.num_layers, m.moe_topk, m.num_experts, 5))
    live = policy.logprobs(samples, replay=False)
    margins = [[] for _ in range(m.num_layers)]
    reach = [[] for _ in range(m.num_layers)]
    u = M.UNIT_ROUNDOFF[policy.cfg.rollout.engine.dtype]
    gates = [layer.mlp.gate for layer in hf_reference.model.model.layers]
    inputs = {}
    hooks = [g.register_forward_hook(lambda mod, args, out, i=i: inputs.__setitem__(i, args[0].reshape(-1,
             args[0].shape[-1]))) for i, g in enumerate(gates)]
    k = m.moe_topk
    for s in samples:
        with torch.no_grad():
            out = hf_reference.model(torch.from_numpy(s.tokens.astype(np.int64))[None], output_router_logits=True)
        p, keep = len(s.prompt_ids), torch.from_numpy(s.loss_mask > 0)
        for layer, logits in enumerate(out.router_logits):
            rows = logits[p - 1:-1][keep].double().numpy()
            margins[layer].append(M.router_margins(rows, k))
            order = np.argsort(-rows, axis=1)[:, k - 1:k + 1]
            h, w = inputs[layer][p - 1:-1][keep].double().numpy(), gates[layer].weight.double().detach().numpy()
            spread = np.take_along_axis(np.sqrt((h * h) @ (w * w).T), order, axis=1)
            reach[layer].append(u * (np.abs(np.take_along_axis(rows, order, axis=1)) + spread).sum(axis=1))
    for hook in hooks:
        hook.remove()
    for layer in range(m.num_layers):
        ref = np.concatenate(margins[layer])
        assert live.margin_per_layer[layer] == pytest.approx(ref.mean(), rel=1e-3, abs=1e-5), layer
        assert live.small_margin_per_layer[layer] == pytest.approx((ref < M.SMALL_ROUTER_MARGIN).mean(), abs=0.02)
        reachable = (ref < np.concatenate(reach[layer])).mean()
        assert live.reachable_per_layer[layer] == pytest.approx(reachable, abs=0.005), layer
        assert live.rows_per_layer[layer] == len(ref)
    assert policy.cfg.rollout.engine.dtype == "bfloat16" and live.reachable_per_layer.max() > 0


def test_the_drift_pass_pairs_its_passes_row_by_row_and_moves_margins_only_where_it_rounds(policy):
    """The doctor's drift pass (check 3 at depth): the replayed pass again with the engine's rounding emulated at
    every layer, compared router call by router call. With nothing emulated (u = 0) every margin move is 0 and the
    reach is the replayed pass's own, row for row; with the bf16 engine's u every layer's margins move and the reach
    only grows; afterwards the model is as before. Fails if the passes were paired out of order (a move with nothing
    emulated), if a chunk's rows were lost or counted twice, if the drift's reach lost the one-rounding rows, if the
    emulation moved nothing on a float32 trainer, if the trainer's own rounding were counted there (scale above 1),
    or if the perturbing hooks stayed on."""
    from r3rl.train import logprob_pass

    # more samples than a chunk of the drift pass: the chunks' counts must add up to the whole batch's
    samples = routed(policy, n=logprob_pass.DRIFT_CHUNK_SAMPLES + 5, routes="own")
    replayed = policy.logprobs(samples, replay=True)
    still = policy.rounding_drift(samples, emulated_roundoff=0.0)
    assert (still.move_over_reach_per_layer == 0).all() and (still.flip_per_layer == 0).all()
    assert still.reachable_per_layer == pytest.approx(replayed.reachable_per_layer, abs=0)
    moved = policy.rounding_drift(samples)
    assert (moved.move_over_reach_per_layer > 0).all() and moved.scale == pytest.approx(1.0)
    assert (moved.reachable_per_layer >= replayed.reachable_per_layer).all()
    assert (moved.rows_per_layer == replayed.rows_per_layer).all()
    after = policy.logprobs(samples, replay=True)
    assert all(np.array_equal(a, b) for a, b in zip(after.logprobs, replayed.logprobs))


def test_bad_routes_fail_naming_sample_and_layer(policy):
    samples = routed(policy, routes="random")
    good = [s.routed_experts for s in samples]
    samples[2].routed_experts = good[2][:-2]
    with pytest.raises(RouteError, match=r"sample 2: .*rows for .* tokens.*every layer"):
        policy.logprobs(samples, replay=True)
    samples[2].routed_experts = good[2][:, :3]
    with pytest.raises(RouteError, match=r"sample 2: .* 3 layers, the model has 4 \(layer axis"):
        policy.logprobs(samples, replay=True)
    samples[2].routed_experts = good[2]
    bad = good[1].copy()
    bad[1, 3, 0] = policy.cfg.model.num_experts
    samples[1].routed_experts = bad
    with pytest.raises(RouteError, match=r"sample 1, layer 3: expert id .* out of range"):
        policy.logprobs(samples, replay=True)
    with pytest.raises(RouteError, match=r"sample 1, layer 3"):
        policy.train_step(samples, np.zeros(len(samples)), replay=True)
    assert_replay_state_empty(policy)


def test_kl_reference_model_never_replays(new_trainer):
    trainer = new_trainer("algorithm.use_kl_loss=true", "algorithm.kl_coef=0.1")
    samples = with_routes(build_samples(8, 3), random_routes(build_samples(8, 3), 4, 2, 8, seed=3))
    assert all(r.router_replay is None for r in trainer.ref_model.modules() if hasattr(r, "router_replay"))
    live = trainer.logprobs(samples, replay=False).logprobs
    ref = trainer.reference_logprobs(samples)
    assert all(np.array_equal(a, b) for a, b in zip(live, ref))  # same weights, both routing live
    old = trainer.logprobs(samples, replay=True).logprobs
    first = trainer.train_step(samples, np.linspace(-1, 1, 8), replay=True, old_logprobs=old)
    # pi_old replays the rollout routes while the reference routes live, so they differ from step 0 (P12)
    assert first["kl"] > 0
    second = trainer.train_step(samples, np.linspace(-1, 1, 8), replay=True, old_logprobs=old)
    assert second["kl"] > 0
    assert all(np.array_equal(a, b) for a, b in zip(ref, trainer.reference_logprobs(samples)))  # ref stays frozen


def pack_with_fault(monkeypatch, fault):
    """A packing bug, injected (no real packing has one to trigger): ``fault`` rewrites the per-sample routes
    right before they are packed for the routers; the Samples keep the rollout's routes."""
    import r3rl.train.batch as batch

    real = batch.pack_routes

    def faulty(routes, *args, **kwargs):
        return real(fault([np.array(r) for r in routes]), *args, **kwargs)

    monkeypatch.setattr(batch, "pack_routes", faulty)


def test_replay_check_catches_one_sample_shifted_by_one_row(policy, monkeypatch):
    samples = routed(policy, routes="random")
    assert policy.logprobs(samples, replay=True).replay_mismatch_rows == 0

    def shift_first(routes):  # the first sample of each micro batch replays its routes one token late
        routes[0] = np.concatenate([routes[0][:1], routes[0][:-1]])
        return routes

    pack_with_fault(monkeypatch, shift_first)
    replayed = policy.logprobs(samples, replay=True)
    assert replayed.replayed_routes_match is False
    # every shifted row of those samples differs (random routes), in every layer
    micro_batches = -(-len(samples) // policy.cfg.trainer.micro_batch_size)
    assert replayed.replay_mismatch_rows >= micro_batches * policy.cfg.model.num_layers


def test_replay_check_catches_two_layers_swapped(policy, monkeypatch):
    samples = routed(policy, routes="random")
    order = list(range(policy.cfg.model.num_layers))
    order[0], order[1] = 1, 0
    pack_with_fault(monkeypatch, lambda routes: [r[:, order] for r in routes])
    replayed = policy.logprobs(samples, replay=True)
    assert replayed.replayed_routes_match is False
    assert replayed.replay_mismatch_rows > 0
