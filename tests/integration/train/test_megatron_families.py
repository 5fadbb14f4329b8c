"""GLM-4.5 (``model=tiny_glm4_moe``) and DeepSeek-V3 (``model=tiny_deepseek_v3``) on the real Megatron trainer
against transformers' own forward of the same checkpoint. GLM-4.5: a dense first layer, a shared expert, a sigmoid
router whose non-zero correction bias decides picks, routed_scaling_factor 2.5, q/k norms, partial RoPE, qkv bias,
and an MTP layer in the checkpoint that is never built; GLM-4.5-Air's attention without q/k norms is Megatron's plain
path (``qk_layernorm=False``). DeepSeek-V3: multi-latent attention and group-limited top-k on top."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_helpers import HFReference, build_samples, with_routes
from test_megatron_convert import assert_same_tensors, read_all

GLM = ["model=tiny_glm4_moe", "parallelism=cpu", "algorithm.global_batch_size=8", "trainer.micro_batch_size=4"]


@pytest.fixture(scope="module")
def glm_dir():
    from r3rl.config import compose
    from r3rl.models.tiny_moe import ensure_checkpoint

    return ensure_checkpoint(compose(GLM).model)


@pytest.fixture(scope="module")
def glm(glm_dir):
    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    trainer = MegatronTrainer(compose(GLM))
    yield trainer
    trainer.shutdown()


@pytest.fixture(scope="module")
def glm_reference(glm_dir):
    ref = HFReference(glm_dir, topk=2)
    samples = build_samples(8, 33)
    logprobs, routes = zip(*(ref.run(s) for s in samples))
    return samples, list(logprobs), list(routes)


def test_glm_layers_are_the_family_s(glm):
    """Megatron builds what GLM-4.5 is: routers on layers 2-4 only (1-based), replay column 0 on the first of them;
    fails if the dense prefix is built as MoE (moe_layer_freq dropped) or the family's router settings are lost."""
    from r3rl.train.model import route_column

    config = glm.bare.config
    assert [r.layer_number for r in glm.routers] == [2, 3, 4]
    assert [route_column(r) for r in glm.routers] == [0, 1, 2]
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_bias_update_rate == 0.0  # held fixed during RL
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_shared_expert_intermediate_size == 64
    assert config.add_qkv_bias and config.qk_layernorm
    assert glm.bare.rotary_pos_emb.inv_freq.numel() == 32 * 0.5 / 2  # half of each head rotates
    assert all(float(r.expert_bias.abs().sum()) > 0 for r in glm.routers)  # the checkpoint's bias, loaded


def test_glm_round_trip_is_exact_with_bias_and_mtp(glm, glm_dir, tmp_path):
    """Export equals the checkpoint bit for bit, the correction bias (a router buffer, not a parameter) and the MTP
    layer (carried over, never built) included; fails if ``named_weights`` leaves the buffers out or
    ``carry_over`` drops the MTP tensors."""
    out = glm.export_hf(tmp_path / "export")
    source = read_all(glm_dir)
    assert any(".e_score_correction_bias" in n for n in source) and any("layers.4.eh_proj" in n for n in source)
    assert_same_tensors(source, read_all(out))


def test_glm_routes_and_logprobs_match_transformers(glm, glm_reference):
    """Per MoE layer, Megatron's own top-k equals transformers' on every token (bias-decided picks included), the
    route probe counts no flip, and log-probs agree in float32 with and without replaying those routes (0 replay
    mismatches); fails if the bias, scaling factor, shared expert, partial RoPE or qkv bias were lost in the
    Megatron config or the conversion, or the probe ranked a biased router by its logits."""
    samples, hf_logprobs, hf_routes = glm_reference
    own = glm.record_routes(samples)
    for i, (mine, theirs) in enumerate(zip(own, hf_routes)):
        assert mine.shape == theirs.shape == (samples[i].num_tokens - 1, 3, 2)
        assert np.array_equal(np.sort(mine, axis=-1), np.sort(theirs, axis=-1)), f"sample {i}"
    live = glm.logprobs(with_routes(samples, hf_routes), replay=False)
    assert max(np.abs(a - b).max() for a, b in zip(live.logprobs, hf_logprobs)) < 1e-5
    assert np.array_equal(live.flip_per_layer, np.zeros(3))
    replayed = glm.logprobs(with_routes(samples, hf_routes), replay=True)
    assert replayed.replayed_routes_match and replayed.replay_mismatch_rows == 0
    assert max(np.abs(a - b).max() for a, b in zip(replayed.logprobs, hf_logprobs)) < 1e-5


def test_glm_replay_off_by_one_layer_is_caught(glm, glm_reference, monkeypatch):
    """The control of the layer map: with every router handed the next MoE layer's routes (the dense prefix read as
    MoE, verl #5037), replayed log-probs leave transformers' by far more than float32 noise."""
    from r3rl.train import replay as replay_lib

    samples, hf_logprobs, hf_routes = glm_reference
    right = replay_lib.route_column
    monkeypatch.setattr(replay_lib, "route_column", lambda r: (right(r) + 1) % 3)
    shifted = glm.logprobs(with_routes(samples, hf_routes), replay=True)
    assert max(np.abs(a - b).max() for a, b in zip(shifted.logprobs, hf_logprobs)) > 1e-3


def test_glm_bias_dropped_in_conversion_is_caught(glm_dir, glm_reference, monkeypatch):
    """The control of the bias: a converter that loads parameters only (the correction bias stays 0) routes other
    experts than transformers on the same checkpoint."""
    from r3rl.config import compose
    from r3rl.train import convert
    from r3rl.train.trainer import MegatronTrainer

    monkeypatch.setattr(convert, "named_weights", lambda model: list(model.named_parameters()))
    samples, _, hf_routes = glm_reference
    trainer = MegatronTrainer(compose(GLM))
    try:
        own = trainer.record_routes(samples)
    finally:
        trainer.shutdown()
    assert any(not np.array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1)) for a, b in zip(own, hf_routes))


def test_glm_router_gradients_under_replay_equal_the_unreplayed(glm, monkeypatch):
    """GLM-4.5's sigmoid router with its bias: replaying the routers' own routes gives every gradient, the routers'
    included, of the pass without replay. With a correction bias Megatron asks the replay for indices only and
    gathers the weights from the bias-free sigmoid scores itself (``topk_routing_with_score_function``), so the
    #79 fault as it strikes a softmax router (weights from scores cut from the graph inside ``get_replay_topk``,
    planted in test_megatron_replay, where it zeroes the routers' gradients) cannot reach this path: planted here, it
    leaves every gradient as it was. Fails if Megatron starts taking a biased router's weights from the replay."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    samples = build_samples(8, 5, lengths=(7, 6))
    samples = with_routes(samples, glm.record_routes(samples))
    adv = np.linspace(-1.0, 1.0, len(samples))
    live = glm.gradients(samples, adv, replay=False)["grads"]
    replayed = glm.gradients(samples, adv, replay=True)["grads"]
    routers = [n for n in live if n.endswith("mlp.router.weight")]
    assert len(routers) == 3 and all(float(live[n].abs().sum()) > 0 for n in routers)
    worst = {n: float((live[n] - replayed[n]).abs().max() / live[n].abs().max().clamp_min(1e-30)) for n in live}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]

    original = RouterReplay.get_replay_topk
    monkeypatch.setattr(RouterReplay, "get_replay_topk",
                        lambda self, scores, *a, **k: original(self, scores.detach(), *a, **k))
    planted = glm.gradients(samples, adv, replay=True)["grads"]
    assert all(torch.equal(planted[n], replayed[n]) for n in live)


def test_physical_expert_ids_are_caught_as_flips(glm, glm_reference):
    """Routes must be logical expert ids (vLLM captures them before expert-parallel load balancing maps them to
    physical slots, vLLM #33013). Ids relabelled by a placement (a fixed permutation, as an EPLB map within range
    is) pass every range check, so the probe is what catches them: most rows flip against the trainer's own router,
    where the logical ids flip none (test_glm_routes_and_logprobs_match_transformers)."""
    samples, _, hf_routes = glm_reference
    placement = np.roll(np.arange(8, dtype=np.uint8), 3)  # physical slot of each logical expert
    physical = [placement[r] for r in hf_routes]
    probed = glm.logprobs(with_routes(samples, physical), replay=False)
    assert (probed.flip_per_layer > 0.5).all(), probed.flip_per_layer


def test_glm_air_attention_without_qk_norms_matches_transformers(tmp_path):
    """GLM-4.5-Air's settings (no q/k norms, scale 1.0) on a stand-in of their own: Megatron's log-probs and routes
    equal transformers'; fails if ``use_qk_norm`` false still built q/k norms or the converter asked for them."""
    from r3rl.config import compose

    cfg = compose([*GLM, "model.qk_norm=false", "model.routed_scaling_factor=1.0", "model.init_seed=1",
                   f"model.checkpoint={tmp_path / 'air'}", "model.generate_if_missing=true"])
    assert_matches_transformers(cfg, lambda trainer: not trainer.bare.config.qk_layernorm)


def assert_matches_transformers(cfg, built_as_asked) -> None:
    """A stand-in of ``cfg``'s own shape: the trainer is ``built_as_asked``, and its routes and replayed log-probs
    equal transformers' forward of the same checkpoint."""
    from r3rl.models.tiny_moe import ensure_checkpoint
    from r3rl.train.trainer import MegatronTrainer

    ref = HFReference(ensure_checkpoint(cfg.model), topk=cfg.model.moe_topk)
    samples = build_samples(4, 9)
    hf_logprobs, hf_routes = zip(*(ref.run(s) for s in samples))
    trainer = MegatronTrainer(cfg)
    try:
        assert built_as_asked(trainer)
        own = trainer.record_routes(samples)
        replayed = trainer.logprobs(with_routes(samples, list(hf_routes)), replay=True)
    finally:
        trainer.shutdown()
    assert all(np.array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1)) for a, b in zip(own, hf_routes))
    assert max(np.abs(a - b).max() for a, b in zip(replayed.logprobs, hf_logprobs)) < 1e-5


DEEPSEEK = ["model=tiny_deepseek_v3", "parallelism=cpu", "algorithm.global_batch_size=8", "trainer.micro_batch_size=4"]


@pytest.fixture(scope="module")
def deepseek():
    from r3rl.config import compose
    from r3rl.models.tiny_moe import ensure_checkpoint
    from r3rl.train.trainer import MegatronTrainer

    cfg = compose(DEEPSEEK)
    folder = ensure_checkpoint(cfg.model)
    trainer = MegatronTrainer(cfg)
    yield trainer, folder
    trainer.shutdown()


def test_deepseek_mla_with_groups_matches_transformers(deepseek, tmp_path):
    """DeepSeek-V3 (``model=tiny_deepseek_v3``): multi-latent attention with a query latent, a dense first layer,
    two shared experts, sigmoid + bias and group-limited top-k (4 groups, 2 picked). Megatron's own top-k equals
    transformers' on every token, log-probs agree in float32 with and without replay, the route probe counts no
    flip, and the HF round trip is bit-exact with the bias and the MTP layer. Fails if the latent norms, the
    interleaved RoPE layout, the group limit or the bias were lost between the two."""
    trainer, folder = deepseek
    config = trainer.bare.config
    assert config.multi_latent_attention and config.q_lora_rank == 32 and config.moe_router_num_groups == 4
    assert [r.layer_number for r in trainer.routers] == [2, 3, 4]
    ref = HFReference(folder, topk=4)
    samples = build_samples(8, 17)
    hf_logprobs, hf_routes = zip(*(ref.run(s) for s in samples))
    own = trainer.record_routes(samples)
    for i, (mine, theirs) in enumerate(zip(own, hf_routes)):
        assert mine.shape == theirs.shape == (samples[i].num_tokens - 1, 3, 4)
        assert np.array_equal(np.sort(mine, axis=-1), np.sort(theirs, axis=-1)), f"sample {i}"
    live = trainer.logprobs(with_routes(samples, list(hf_routes)), replay=False)
    assert max(np.abs(a - b).max() for a, b in zip(live.logprobs, hf_logprobs)) < 1e-5
    assert np.array_equal(live.flip_per_layer, np.zeros(3))
    replayed = trainer.logprobs(with_routes(samples, list(hf_routes)), replay=True)
    assert replayed.replay_mismatch_rows == 0
    assert max(np.abs(a - b).max() for a, b in zip(replayed.logprobs, hf_logprobs)) < 1e-5
    source = read_all(folder)
    assert any("layers.4.eh_proj" in n for n in source)
    assert_same_tensors(source, read_all(trainer.export_hf(tmp_path / "export")))


def test_moonlight_mla_without_a_query_latent_matches_transformers(tmp_path):
    """Moonlight's attention (``q_lora_rank: null``: one q_proj, no query latent or its norm), one expert group:
    Megatron's log-probs and routes equal transformers'; fails if the converter asked for q_a_proj/q_b_proj."""
    import importlib.util

    from r3rl.config import compose
    from r3rl.train.trainer import MegatronTrainer

    cfg = compose([*DEEPSEEK, "model.q_lora_rank=null", "model.router_num_groups=1", "model.router_group_topk=1",
                   "model.init_seed=2", f"model.checkpoint={tmp_path / 'moonlight'}", "model.generate_if_missing=true"])
    if importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None:
        from r3rl.train.model import MLA_WITHOUT_Q_LATENT

        with pytest.raises(ValueError, match="mla_qk_norm_config"):  # refused by name, not a Mock's AttributeError
            MegatronTrainer(cfg).shutdown()
        pytest.skip(MLA_WITHOUT_Q_LATENT)
    assert_matches_transformers(cfg, lambda trainer: trainer.bare.config.q_lora_rank is None)
