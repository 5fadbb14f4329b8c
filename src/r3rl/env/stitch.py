"""One ``Sample`` from the turns of an episode, and the rule that says where each route row comes from.

An episode's tokens are ``prompt + r1 + o1 + r2 + o2 + ... + rN``: the policy's turns ``r`` and the observations
``o`` between them. Turn ``t`` sends every token before it as its context and generates ``r_t``. Route row ``i`` is
the experts token ``i`` was sent to in the forward that computed its KV, which every later token attended to; the
last token of a sequence is sampled, never forwarded, so an episode of ``T`` tokens has ``T - 1`` rows.

The rule, **the earliest forward wins**: turn ``t`` holds the rows ``0 .. H-1``, ``H = len(context_{t-1}) +
len(r_{t-1}) - 1``, each from the forward that first computed that position's KV, and keeps them whatever a later
forward says. Row ``H`` is ``r_{t-1}``'s last token: sampled at turn ``t-1``'s last decode step and forwarded for the
first time in turn ``t``'s prefill, so turn ``t`` is the only source of its row. For the rows after it, vLLM's route
store decides: a KV block that was full and prefix-cached comes back with the routes of the forward that computed it,
rows computed in this prefill (the observation) with this forward's.

Turn ``t``'s prefill also recomputes held rows: every position after the last prefix-cache hit (the partially filled
last block of the context, and any block evicted since turn ``t-1``). Their new KV is what turn ``t``'s tokens
attended to, but one training forward holds one route per position, and the held row is the one every earlier token
of the episode was sampled beside: it stays. How often the two differ is measured, not assumed (``recomputed_rows``):
a turn asks for ``route_overlap_rows`` rows before ``H`` (``route_start``) and compares the recomputed ones among them
with the held rows; the engine's usage (``cached_tokens``) says where the recomputation began. Every weight update
resets the prefix cache, and an episode's turns run under one weight version.

The deliberate fault ``shift_turn_rows`` (the row boundary one off for every turn after the first) exists so that a
test and ``bench/multiturn_r3.py`` can show the per-turn measurement catches a wrong rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from r3rl.sample import Sample, SampleStatus


class StitchError(ValueError):
    """Turns whose token or route bookkeeping does not add up; names the sample and the turn."""


def route_start(held_rows: int, overlap_rows: int = 0) -> int:
    """The first route row a turn asks for, given the rows the episode holds already (0 for the first turn):
    ``overlap_rows`` of the held ones again, to measure how a recomputing prefill would have routed them."""
    return max(0, held_rows - overlap_rows)


@dataclass(frozen=True)
class Recomputed:
    """Held rows a later prefill computed again: ``rows`` in all, ``checked`` of them compared with the held rows
    (the ones the turn asked for again), ``changed`` of those with another expert set in some layer."""

    rows: int = 0
    checked: int = 0
    changed: int = 0

    def __add__(self, other: Recomputed) -> Recomputed:
        return Recomputed(self.rows + other.rows, self.checked + other.checked, self.changed + other.changed)


def recomputed_rows(held_tail: np.ndarray, returned: np.ndarray, *, start: int, cached_tokens: int) -> Recomputed:
    """The held rows a turn's prefill recomputed (positions ``cached_tokens .. H-1``, the prefix cache having served
    the ones before), compared with that turn's ``returned`` rows (``[R, L, K]``, row ``start`` first) where it sent
    them again. ``held_tail`` is the held rows from ``start`` on (``[H - start, L, K]``: only those can be compared);
    an expert set compares as a set (the order of top-k is not routing)."""
    h = start + len(held_tail)
    first = max(cached_tokens, start)
    if first >= h:
        return Recomputed(rows=max(0, h - cached_tokens))
    new = np.sort(returned[first - start:h - start], axis=-1)
    old = np.sort(held_tail[first - start:], axis=-1)
    changed = int(np.any(new != old, axis=(-2, -1)).sum())
    return Recomputed(rows=h - cached_tokens, checked=h - first, changed=changed)


def held_rows_from(turns: list[TurnRecord], start: int) -> np.ndarray:
    """The rows the episode's ``turns`` hold from row ``start`` on, joining only the last turns that cover them (a
    long episode's every turn would otherwise copy its whole context)."""
    first = len(turns) - 1
    while turns[first].routes_from > start:
        first -= 1
    rows = np.concatenate([r.sample.routed_experts for r in turns[first:]])
    return rows[start - turns[first].routes_from:]


@dataclass
class TurnRecord:
    """What one turn produced: ``context_len`` tokens went in (the prompt and everything before), the engine's
    ``sample`` came out (its routes start at row ``routes_from``), then ``observation_ids`` were appended (empty
    after the last turn)."""

    context_len: int
    routes_from: int
    sample: Sample
    observation_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


@dataclass(frozen=True)
class EpisodeStats:
    turns: int
    tool_calls: int
    tool_errors: int
    observation_tokens: int
    context_truncated: bool
    route_rows_received: int  # rows the engine sent with prefix omission (routes_from)
    route_rows_full: int  # rows it would have sent had every turn asked for the whole context
    # held rows later prefills recomputed, checked against the held ones, and changed (None: the engine did not
    # report its prefix-cache hits)
    recomputed: Recomputed | None = None
    # why a turn failed twice (aborted, or tokens without all their routes): the episode stops at its last complete
    # turn and trains on nothing ("": complete)
    masked: str = ""


def stitch_routes(turns: Sequence[TurnRecord], *, index: int) -> np.ndarray | None:
    """The episode's ``[T - 1, L, K]`` routes: each turn's returned rows appended where its ``routes_from`` says;
    ``StitchError`` (naming the sample and the turn) when a turn's rows do not start where the held ones end or the
    total is not ``T - 1``. ``None`` when the engine returned no routes (routing replay off)."""
    if all(t.sample.routed_experts is None for t in turns):
        return None
    held = 0
    parts = []
    for n, t in enumerate(turns, 1):
        rows = t.sample.routed_experts
        if rows is None:
            raise StitchError(f"sample {index}, turn {n} (request {t.sample.request_id}): no routes for "
                              f"{t.sample.response_length} tokens; the episode cannot be replayed")
        if t.routes_from != held:
            raise StitchError(f"sample {index}, turn {n} (request {t.sample.request_id}): routes start at row "
                              f"{t.routes_from}, but the episode holds {held} rows")
        parts.append(rows)
        held += len(rows)
        expected = t.context_len + t.sample.response_length - 1
        if held != expected:
            raise StitchError(f"sample {index}, turn {n} (request {t.sample.request_id}): {held} route rows after "
                              f"the turn, expected {expected} (context {t.context_len} + response "
                              f"{t.sample.response_length} - 1)")
    return np.concatenate(parts, axis=0)


def shift_turn_rows(routes: np.ndarray, turn_of_token: np.ndarray, prompt_len: int) -> np.ndarray:
    """A deliberately wrong stitching, for measurement only: the rows the second and later turns returned sit one
    row late (each takes the route of the row before it), as a client that put turn 2's slice after the first turn's
    last token instead of on it would have them. Turn 1's rows are untouched."""
    out = routes.copy()
    if (turn_of_token >= 2).any():
        first = prompt_len + int((turn_of_token == 1).sum()) - 1  # the first row turn 2 returned
        out[first + 1:] = routes[first:-1]
    return out


def episode_sample(turns: Sequence[TurnRecord], *, index: int, group: int, label: str | None,
                   reward: float | None, stats: EpisodeStats) -> Sample:
    """The episode as one ``Sample``: the first turn's context is the prompt; the response is every policy turn and
    observation after it, observations with loss mask 0 and rollout log-prob 0 (never read: every metric and the
    correction go through the mask). ``extra`` keeps per token the turn (1-based; 0 on observation tokens) and the
    weight version (-1 on observations), the text ids of the last policy turn (what the reward grades), and the
    episode's counters."""
    if not turns:
        raise StitchError(f"sample {index}: an episode with no turn")
    first = turns[0]
    prompt = first.sample.prompt_ids
    ids, lps, mask, turn_of, versions = [], [], [], [], []
    for n, t in enumerate(turns, 1):
        s = t.sample
        if len(prompt) + sum(len(x) for x in ids) != t.context_len:
            raise StitchError(f"sample {index}, turn {n} (request {s.request_id}): context of {t.context_len} "
                              f"tokens, but the episode had {len(prompt) + sum(len(x) for x in ids)}")
        trainable = 0.0 if stats.masked else 1.0
        ids += [s.response_ids, t.observation_ids]
        lps += [s.rollout_logprobs, np.zeros(len(t.observation_ids), np.float32)]
        mask += [np.full(s.response_length, trainable, np.float32), np.zeros(len(t.observation_ids), np.float32)]
        turn_of += [np.full(s.response_length, n, np.int16), np.zeros(len(t.observation_ids), np.int16)]
        versions += [np.full(s.response_length, -1 if s.weight_version is None else s.weight_version, np.int32),
                     np.full(len(t.observation_ids), -1, np.int32)]
    last = turns[-1].sample
    known = [t.sample.weight_version for t in turns if t.sample.weight_version is not None]
    if len(set(known)) > 1:  # the recipe never syncs weights while episodes run: a turn under other weights is a bug
        raise StitchError(f"sample {index}: its turns were generated by weight versions {known}; an episode's turns "
                          "must share one (was a weight sync started while episodes were running?)")
    status = last.status
    if stats.context_truncated and status is SampleStatus.COMPLETED:
        status = SampleStatus.TRUNCATED
    if stats.masked:
        status = SampleStatus.ABORTED
    return Sample(
        index=index, group=group, request_id=last.request_id, prompt_ids=prompt,
        response_ids=np.concatenate(ids).astype(np.int32), rollout_logprobs=np.concatenate(lps).astype(np.float32),
        loss_mask=np.concatenate(mask), finish_reason=last.finish_reason, status=status,
        routed_experts=stitch_routes(turns, index=index), label=label, reward=reward,
        weight_version=min(known) if known else None,
        extra={"turn_of_token": np.concatenate(turn_of), "token_versions": np.concatenate(versions),
               "answer_ids": last.response_ids, "episode": stats, "engine": last.extra.get("engine")},
    )
