"""LoRA on the real Megatron-core trainer (``trainer.lora``): adapters on attention and the routed experts, the
router never; the base frozen; the engine's view (the merged export) equal to what the trainer computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_helpers import HFReference
from r3rl.train import lora
from test_megatron_grpo import fixed_batch, moved_toward_the_advantage, params

LORA = ("trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.micro_batch_size=2", "trainer.lr=3e-3")


def adapter_names(trainer) -> list[str]:
    return [n for n, _ in lora.adapter_parameters(trainer.bare)]


def test_lora_starts_as_the_base_model_and_trains_only_its_adapters(new_trainer, policy):
    """B starts at zero, so before a step the adapted trainer's log-probs are the base's bit for bit; after two
    steps every adapter's B moved, no base parameter (routers, norms, embeddings, experts, attention) moved by one
    bit, the optimizer holds the adapters alone, and the policy moved toward the advantage. Fails if the hook added
    anything at B = 0, a base weight kept its gradient (LoRA would be full-parameter training), a router got an
    adapter, or the adapters never reached the optimizer."""
    trainer = new_trainer(*LORA)
    samples, adv = fixed_batch()
    base = policy.logprobs(samples, replay=True).logprobs
    start = trainer.logprobs(samples, replay=True).logprobs
    assert all(np.array_equal(a, b) for a, b in zip(base, start))
    names = adapter_names(trainer)
    # 4 layers x (qkv, proj) + 4 layers x 8 experts x (fc1, fc2), an A and a B each
    assert len(names) == 2 * (4 * 2 + 4 * 8 * 2) and not any("router" in n for n in names)
    before = params(trainer)
    for _ in range(2):
        trainer.train_step(samples, adv, replay=True, old_logprobs=start)
    after = params(trainer)
    frozen = [n for n in before if not lora.is_adapter(n)]
    assert [n for n in frozen if not torch.equal(before[n], after[n])] == []
    assert all(not torch.equal(before[n], after[n]) for n in names if n.endswith(".b"))
    held = {id(p) for p in trainer.optimizer.inner.params}
    assert held == {id(p) for _, p in lora.adapter_parameters(trainer.bare)}
    moved = trainer.logprobs(samples, replay=True).logprobs
    assert moved_toward_the_advantage(samples, adv, start, moved) > 0


def test_the_merged_export_is_the_adapted_model(new_trainer, tmp_path):
    """What the weight sync sends (the HF stream, adapters merged: W + (alpha / r) B A) is the model the trainer
    computes: transformers' forward of the exported checkpoint gives the adapted trainer's log-probs within 1e-5,
    and the adapters changed them by more than that. Fails if the stream sent the frozen base (the engine would
    serve the policy of step 0 forever), dropped the scale, merged B A transposed, or put adapter tensors in the
    checkpoint."""
    trainer = new_trainer(*LORA)
    samples, adv = fixed_batch(seed=7)
    base = trainer.logprobs(samples, replay=False).logprobs
    for _ in range(2):
        trainer.train_step(samples, adv, replay=True)
    adapted = trainer.logprobs(samples, replay=False).logprobs
    assert max(np.abs(a - b).max() for a, b in zip(base, adapted)) > 1e-3
    names = [t.name for t in trainer.weight_stream().metadata()]
    assert not any("lora" in n for n in names)
    hf = HFReference(trainer.export_hf(tmp_path / "hf"), topk=2)
    for sample, mine in zip(samples, adapted):
        theirs, _ = hf.run(sample)
        assert np.abs(theirs - mine).max() < 1e-5


@pytest.mark.parametrize("targets,per_layer", [("[attention]", 4), ("[experts]", 32)])
def test_targets_choose_the_linears_and_shared_expert_adapters_are_one_pair(new_trainer, targets, per_layer):
    """``targets`` picks the linears adapted (per layer: attention's qkv and output projections; 8 experts' fc1 and
    fc2, an A and a B each); ``expert_adapters=shared`` gives all experts of a layer one pair per linear, which
    every expert's forward uses. Fails if a target adapted other linears, or if shared adapters were copied per
    expert (each expert would train its own)."""
    trainer = new_trainer(*LORA, f"trainer.lora.targets={targets}")
    assert len(adapter_names(trainer)) == 4 * per_layer
    shared = new_trainer(*LORA, "trainer.lora.targets=[experts]", "trainer.lora.expert_adapters=shared")
    names = adapter_names(shared)
    assert len(names) == 4 * 2 * 2 and all("lora_experts_linear_fc" in n for n in names)
    experts = shared.bare.decoder.layers[0].mlp.experts.local_experts
    assert len({id(e.linear_fc1._r3rl_lora) for e in experts}) == 1


def test_the_adapter_count_the_memory_plan_uses_is_the_trainers(new_trainer):
    """``adapter_counts`` (the memory plan's) equals the adapter parameters the trainer built, per-expert and
    shared. Fails if the plan counted fc1 as one projection (SwiGLU's gate and up are two) or shared adapters
    once per expert."""
    from r3rl.config.lora import adapter_counts

    for extra in ((), ("trainer.lora.expert_adapters=shared",)):
        trainer = new_trainer(*LORA, *extra)
        built = sum(p.numel() for _, p in lora.adapter_parameters(trainer.bare))
        assert built == sum(adapter_counts(trainer.cfg.model, trainer.cfg.trainer.lora)), extra


def test_a_lora_checkpoint_holds_the_adapters_alone_resumes_exactly_and_refuses_other_adapters(new_trainer, tmp_path,
                                                                                                tiny_model_dir):
    """Save after a step, load into a new trainer, step again: the same metrics and the same adapters bit for bit
    (their optimizer state came back). The checkpoint holds the adapters and their state alone, a fraction of the
    base model's bytes. The same checkpoint under another rank, without LoRA, or on another base model (the frozen
    weights are not in it) is refused naming what differs before any tensor is read. Fails if the adapters or their
    Adam moments were not saved, the base was saved too, or a mismatched resume got as far as a shape error deep in
    dist_checkpointing or silently merged the adapters into another base."""
    first = new_trainer(*LORA, "algorithm.global_batch_size=4")
    samples, adv = fixed_batch(seed=6)
    first.train_step(samples, adv, replay=True)
    saved = first.save_checkpoint(tmp_path / "ckpt")
    expected = first.train_step(samples, adv, replay=True)
    expected_params = params(first)
    second = new_trainer(*LORA, "algorithm.global_batch_size=4")
    second.load_checkpoint(saved)
    assert second.train_step(samples, adv, replay=True) == expected
    assert all(torch.equal(v, expected_params[n]) for n, v in params(second).items())
    stored = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    base = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert stored < base / 2, (stored, base)
    for other in (("trainer.lora.rank=2",), ()):
        # without LoRA no trainer.lora key stays (one beside rank 0 is refused)
        trainer = new_trainer(*[o for o in LORA if not o.startswith("trainer.lora." if not other else
                                                                    "trainer.lora.rank")], *other,
                              "algorithm.global_batch_size=4")
        with pytest.raises(ValueError, match=r"saved with trainer.lora rank=4.*this run has"):
            trainer.load_checkpoint(saved)
    other_base = new_trainer(*LORA, "algorithm.global_batch_size=4", "model.init_seed=1",
                             f"model.checkpoint={tmp_path / 'other_base'}", "model.generate_if_missing=true")
    with pytest.raises(ValueError, match=r"trained on another base model"):
        other_base.load_checkpoint(saved)


def test_r2_and_r3_replay_exactly_through_adapted_layers(new_trainer):
    """With adapters trained (B non-zero), R3's routes (here random ones, replayed) and R2's (the trainer's own,
    recorded in a pass of the adapted model) are what Megatron routed on every (token, layer) row: 0 mismatched
    rows, and R2's recorded routes are the adapted router inputs' own top-k (flip rate 0). Fails if an adapter's
    hook ran outside the replayed forward (the routes of the base model would be recorded) or replay skipped the
    adapted layers."""
    from megatron_helpers import build_samples, with_routes

    trainer = new_trainer(*LORA)
    samples, adv = fixed_batch(seed=9)
    trainer.train_step(samples, adv, replay=True)
    assert trainer.logprobs(samples, replay=True).replay_mismatch_rows == 0
    fresh = build_samples(8, 11)
    own = trainer.logprobs(fresh, replay=False, record=True)
    with_routes(fresh, own.recorded_routes)
    assert np.array_equal(trainer.logprobs(fresh, replay=False).flip_per_layer, np.zeros(4))
    replayed = trainer.logprobs(fresh, replay=True)
    assert replayed.replayed_routes_match is True and replayed.replay_mismatch_rows == 0


@pytest.mark.parametrize("adapters", ["per_expert", "shared"])
def test_expert_parallel_2_trains_the_adapters_as_one_process_does(adapters, tmp_path, torchrun_rendezvous):
    """LoRA under expert parallel 2 (two real processes, gloo) against one process: the same gradient norm, loss and
    log-probs after a step. Per-expert adapters are expert parameters (reduced over expert-data parallel, size 1
    here: each rank holds its experts' whole gradient); a shared pair is a dense parameter, its gradient summed
    over both ranks (each saw the tokens its experts got). Fails if either were reduced over the wrong group (a
    gradient counted twice or half of it lost changes the norm), or if an expert's A depended on the split. The
    PEFT adapter folder both export after the step holds the same tensors: fails if the export lost the other rank's
    experts (the packing refuses a layer with experts missing) or offset their ids wrongly."""
    from test_megatron_expert_parallel import ep2_against_one_process

    common = [*LORA, "trainer.lora.targets=[attention,experts]", f"trainer.lora.expert_adapters={adapters}"]
    ep, single = ep2_against_one_process(tmp_path, torchrun_rendezvous(2), common)
    assert ep["local_experts"] == 4 and single["local_experts"] == 8
    assert abs(ep["metrics"]["grad_norm"] - single["metrics"]["grad_norm"]) <= 1e-5 * single["metrics"]["grad_norm"]
    assert abs(ep["metrics"]["loss"] - single["metrics"]["loss"]) <= 1e-6 * max(1.0, abs(single["metrics"]["loss"]))
    assert max(np.abs(a - b).max() for a, b in zip(ep["after"], single["after"])) < 1e-5
    assert max(np.abs(a - b).max() for a, b in zip(single["after"], single["replayed"])) > 1e-4  # the step moved it
    assert ep["adapter"].keys() == single["adapter"].keys()
    for key, t in single["adapter"].items():
        torch.testing.assert_close(ep["adapter"][key], t, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sequence_parallel"])
def test_tensor_parallel_2_adapters_count_the_update_once_and_checkpoint_whole(tmp_path, torchrun_rendezvous, sp):
    """Megatron's ColumnParallelLinear then RowParallelLinear over 2 tensor-parallel ranks (real processes, gloo),
    each with an adapter, against the same two linears in float64 by hand: the output, the input's gradient and
    every adapter factor's gradient agree, and the replicated factors' gradients are equal on both ranks; under
    sequence parallelism (what Megatron's MoE layers need with TP) too, its partial gradients summed over the ranks
    as finalize_model_grads does. The adapters saved with dist_checkpointing by both ranks read back as the whole
    factors. (A whole LoRA model under TP cannot run on CPU: the CPU LayerNorm refuses sequence parallel.) Fails if
    the row-parallel adapter's update were added on every rank before the reduce (miles #3232: counted twice), a
    replicated factor's gradient were left partial, the sequence-parallel input were not gathered or the output not
    scattered (shapes or values off), the row B lost its sequence-parallel mark (half its gradient), or the sharded
    state listed a split factor as replicated (one rank's half lost: ``lora.shard_adapters``)."""
    import pickle

    import megatron_lora_tp_worker as worker
    from test_megatron_expert_parallel import finish, launch

    out, ckpt = tmp_path / "out.pkl", tmp_path / "ckpt"
    finish(launch(2, [str(out), str(ckpt), *(["sp"] if sp else [])], tmp_path, torchrun_rendezvous(2),
                  worker=worker.WORKER_PATH), tmp_path, timeout=120)
    got = pickle.loads(out.read_bytes())
    t = worker.full_tensors()
    scale = worker.ALPHA / worker.RANK_R
    a1, a2 = (got[k].clone().requires_grad_(True) for k in ("a1", "a2"))
    b1, b2 = (t[k].clone().requires_grad_(True) for k in ("b1", "b2"))
    x = t["x"].clone().requires_grad_(True)
    mid = x @ t["w1"].T + scale * (x @ a1.T) @ b1.T
    y = mid @ t["w2"].T + scale * (mid @ a2.T) @ b2.T
    y.backward(t["dy"])
    assert torch.allclose(got["y"], y.detach(), atol=1e-10)
    for key, ref in (("dx", x.grad), ("da1", a1.grad), ("db1", b1.grad), ("da2", a2.grad), ("db2", b2.grad)):
        assert torch.allclose(got[key], ref, atol=1e-10), key
    assert torch.equal(got["b2_replicas"][0], got["b2_replicas"][1])
    saved = got["saved"]
    for key, whole in (("column.lora.a", got["a1"]), ("column.lora.b", t["b1"]), ("row.lora.a", got["a2"]),
                       ("row.lora.b", t["b2"])):
        assert torch.equal(saved[key], whole), key
