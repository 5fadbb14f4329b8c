"""Packed micro batches (trainer.packing) on the real Megatron-core trainer: the same log-probs, loss and gradients as
right-padded ones, under expert parallel 2 with routing replay, and the checks that catch a misplaced route or
segment boundary."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from megatron_helpers import build_samples, random_routes, with_routes
from r3rl.train import batch as batch_lib
from r3rl.train.grpo import group_advantages
from test_megatron_expert_parallel import EP2, WORKER, finish, launch


def long_tailed(n: int, seed: int):
    """Prompts of 3-10 tokens, responses mostly short with a long tail (a log-normal, as long-CoT lengths are)."""
    rng = np.random.default_rng(seed)
    responses = np.clip(rng.lognormal(2.0, 0.8, n).astype(int), 2, 60)
    samples = [build_samples(1, seed + i, lengths=(int(rng.integers(3, 11)), int(r)))[0]
               for i, r in enumerate(responses)]
    for i, s in enumerate(samples):
        s.index, s.group, s.request_id = i, i // 4, f"req-{seed}-{i}"
    return with_routes(samples, random_routes(samples, 4, 2, 8, seed=seed))


def test_packed_equals_padded_under_expert_parallel_2_with_replay(tmp_path, tiny_model_dir, torchrun_rendezvous):
    """EP 2, two gloo processes, one model: the packed batch gives the padded batch's log-probs (replayed and live),
    flip rates, loss and every gradient of both ranks to 1e-5, the replayed routing maps equal the rollout routes on
    every row (0 mismatches, in the log-prob passes and in a training step), and the two ranks' rows differ in
    length, so the trailing alignment segment that equalises them is exercised. Fails if a segment's routes, labels
    or advantages sit one position off, if attention crossed a segment boundary, or if the alignment segment's
    filler routes dropped tokens."""
    samples = long_tailed(16, 7)
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    src = tmp_path / "in.pkl"
    src.write_bytes(pickle.dumps((samples, adv)))
    args = ["packing", str(src), str(tmp_path), "algorithm.global_batch_size=16",
            "trainer.max_tokens_per_micro_batch=96", *EP2]
    finish(launch(2, args, tmp_path, torchrun_rendezvous(2)), tmp_path, timeout=400)
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for out in ranks:
        packed, padded = out["packed"], out["padded"]
        for key in ("replayed", "live"):
            diff = max(np.abs(a - b).max() for a, b in zip(packed[key], padded[key]))
            assert diff < 1e-5, (out["rank"], key, diff)
        assert np.array_equal(packed["flips"], padded["flips"])
        assert packed["match"] is True and packed["mismatch_rows"] == 0 == padded["mismatch_rows"]
        assert packed["loss_tokens"] == padded["loss_tokens"]
        assert abs(packed["loss"] - padded["loss"]) < 1e-5 * max(1.0, abs(padded["loss"]))
        scale = max(np.abs(g).max() for g in padded["grads"].values())
        worst = max(np.abs(packed["grads"][k] - padded["grads"][k]).max() for k in padded["grads"])
        assert worst < 1e-5 * max(scale, 1.0), (out["rank"], worst, scale)
        assert out["train"]["replay_mismatch_rows"] == 0 and out["train"]["replayed_rows"] > 0
    # row k has one length on both ranks (the allgather dispatcher gathers equal counts) ...
    assert ranks[0]["rows"] == ranks[1]["rows"]
    # ... which a rank's own samples do not always fill: the alignment segment was there
    own = [sum(s.num_tokens - 1 for s in samples[r * 8:(r + 1) * 8]) for r in range(2)]
    assert sum(ranks[0]["rows"]) > min(own)


@pytest.fixture
def packed_policy(policy):
    policy.packing = True
    yield policy
    policy.packing = True


def test_a_route_packed_one_row_off_is_caught(packed_policy, monkeypatch):
    """Routes packed one row later than their tokens (the bug of a fed last token or a misplaced segment start)
    show as replay mismatches on the packed row: the probe maps each router row back to its sample and position
    from the tokens' layout, not from the packed routes. Fails if the probe read the expected routes from the packed
    routes themselves (it would repeat the shift)."""
    samples = long_tailed(8, 11)
    assert packed_policy.logprobs(samples, replay=True).replay_mismatch_rows == 0
    pack = batch_lib.pack_routes

    def one_row_off(routes, *args, **kwargs):
        packed = pack(routes, *args, **kwargs)
        packed.rows = np.roll(packed.rows, 1, axis=0)
        return packed

    monkeypatch.setattr(batch_lib, "pack_routes", one_row_off)
    shifted = packed_policy.logprobs(samples, replay=True)
    assert shifted.replay_mismatch_rows > 0 and shifted.replayed_routes_match is False


def test_a_segment_boundary_off_by_one_changes_the_log_probs(packed_policy, monkeypatch):
    """Attention and RoPE told that every segment after the first starts one token later than its sample: the
    packed log-probs then leave the padded ones by far more than the 1e-5 the exactness test allows, so that test
    would fail on such a boundary. Fails if the packed attention ignored the cu_seqlens (one causal row)."""
    samples = long_tailed(8, 13)
    packed_policy.packing = False
    padded = packed_policy.logprobs(samples, replay=True).logprobs
    packed_policy.packing = True
    exact = packed_policy.logprobs(samples, replay=True).logprobs
    assert max(np.abs(a - b).max() for a, b in zip(exact, padded)) < 1e-5
    params = type(packed_policy)._packed_seq_params

    def boundary_off_by_one(self, mb):
        p = params(self, mb)
        cu = p.cu_seqlens_q.clone()
        cu[1:-1] += 1
        p.cu_seqlens_q = p.cu_seqlens_kv = p.cu_seqlens_q_padded = p.cu_seqlens_kv_padded = cu
        p.max_seqlen_q = p.max_seqlen_kv = int((cu[1:] - cu[:-1]).max())
        return p

    monkeypatch.setattr(type(packed_policy), "_packed_seq_params", boundary_off_by_one)
    shifted = packed_policy.logprobs(samples, replay=True).logprobs
    assert max(np.abs(a - b).max() for a, b in zip(shifted, padded)) > 1e-3


def test_the_fused_attention_of_gpus_gives_megatrons_log_probs_packed_and_padded(packed_policy, monkeypatch):
    """The local attention's CUDA branch (torch's SDPA, which GPUs without TransformerEngine take so that no S x S
    scores are kept), taken on the CPU by forcing ``te_fallback.fused_attention``: replayed log-probs of packed rows
    (SDPA causal per segment group, no mask) and of padded micro batches (SDPA with the explicit mask) equal
    Megatron's unfused arithmetic to 1e-5 in float32. Fails if SDPA's key/value heads repeat per head instead of per
    query group, its scale differs from Megatron's softmax_scale, the mask's polarity flips, or a packed group's
    right padding leaks into a real row."""
    from r3rl.train import te_fallback

    samples = long_tailed(12, 17)
    calls = []
    sdpa = te_fallback.sdpa_attention

    def counted(*args, **kwargs):
        calls.append(args[3] is None)
        return sdpa(*args, **kwargs)

    for packing in (True, False):
        packed_policy.packing = packing
        megatron = packed_policy.logprobs(samples, replay=True)
        with monkeypatch.context() as m:
            m.setattr(te_fallback, "fused_attention", lambda query: True)
            m.setattr(te_fallback, "sdpa_attention", counted)
            fused = packed_policy.logprobs(samples, replay=True)
        assert fused.replay_mismatch_rows == 0
        diff = max(np.abs(a - b).max() for a, b in zip(fused.logprobs, megatron.logprobs))
        assert diff < 1e-5, (packing, diff)
    # both branches ran: causal without a mask (packed groups) and with Megatron's explicit mask (padded, CPU)
    assert set(calls) == {True, False}
