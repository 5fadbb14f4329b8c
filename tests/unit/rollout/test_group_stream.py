"""``r3rl.rollout.group_stream``: the order groups are taken in, the bound on groups drawn and untrained, and the
state a checkpoint saves. The groups here are coroutines the tests release one by one (the stream's scheduling is the
unit under test; the recipe test in ``tests/integration/recipe/test_async_recipe.py`` runs it on real engines)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from r3rl.rollout.group_stream import Drawn, GroupFailed, GroupStream, requeued


@dataclass(frozen=True)
class Prompt:
    index: int


class Gates:
    """A group completes when the test opens its gate (by draw serial); records the groups started."""

    def __init__(self, fail: set[int] = frozenset()):
        self.started: list[int] = []
        self.fail = fail
        self._gates: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def gate(self, serial: int) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(serial, threading.Event())

    def open(self, *serials: int) -> None:
        for s in serials:
            self.gate(s).set()

    async def generate(self, drawn: Drawn) -> tuple[int, int]:
        self.started.append(drawn.serial)
        gate = self.gate(drawn.serial)
        while not gate.is_set():
            await asyncio.sleep(0.005)
        if drawn.serial in self.fail:
            raise ConnectionError("engine http://127.0.0.1:9 went away")
        return drawn.serial, drawn.prompt.index


def sampler(start: int = 0):
    state = {"position": start}

    def draw() -> Prompt:
        state["position"] += 1
        return Prompt(100 + state["position"] - 1)

    return draw, lambda: dict(state)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def wait_started(gates: Gates, count: int) -> None:
    for _ in range(2000):
        if len(gates.started) >= count:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"{count} groups should have started, {gates.started} did")


def test_a_step_takes_the_first_groups_to_complete_and_never_waits_for_a_slow_one(pool):
    """Group 0 is slow (its gate stays shut); groups 1-3 complete: a take of 3 returns them, in completion order,
    while group 0 still generates, and group 0 is taken by a later take. Fails if the stream took groups in draw
    order (the take would block on group 0) or lost the slow group."""
    gates = Gates()
    draw, _ = sampler()
    stream = GroupStream(draw, gates.generate, capacity=4)
    stream.start(pool.submit)
    try:
        wait_started(gates, 4)
        gates.open(3, 1, 2)
        taken = stream.take(3)
        assert sorted(d.serial for d, _ in taken) == [1, 2, 3]
        assert stream.pending()[0] == 0  # still generating, not taken
        wait_started(gates, 7)  # the three slots went to new draws
        gates.open(0, 4, 5, 6)
        later = stream.take(4)
        assert {d.serial for d, _ in later} == {0, 4, 5, 6}
        assert [result for _, result in taken + later] == [(d.serial, d.prompt.index) for d, _ in taken + later]
    finally:
        gates.open(*range(20))
        stream.close()


def test_no_more_groups_are_drawn_than_the_buffer_holds(pool):
    """With capacity 3 and nothing taken, exactly 3 groups are drawn however long the stream runs; each take frees
    as many slots as it took. Fails if a slot were freed at completion instead of at the take (completed groups
    waiting for a step would not count) or the bound were not kept."""
    gates = Gates()
    draw, state = sampler()
    stream = GroupStream(draw, gates.generate, capacity=3)
    stream.start(pool.submit)
    try:
        wait_started(gates, 3)
        gates.open(0, 1, 2)
        threading.Event().wait(0.2)
        assert gates.started == [0, 1, 2] and state()["position"] == 3 and stream.pending() == [0, 1, 2]
        stream.take(2)
        wait_started(gates, 5)
        threading.Event().wait(0.2)
        assert len(gates.started) == 5 and stream.max_pending == 3
    finally:
        gates.open(*range(20))
        stream.close()


def test_no_serial_past_the_allowed_limit_is_drawn_until_it_is_raised(pool):
    """The staleness gate: with ``allow(3)`` only serials 0-2 are drawn however many slots are free; raising it to 5
    draws two more. Fails if the limit were ignored (groups drawn under weights the bound would evict on arrival) or
    a raise did not wake the stream."""
    gates = Gates()
    draw, state = sampler()
    stream = GroupStream(draw, gates.generate, capacity=8)
    stream.allow(3)
    stream.start(pool.submit)
    try:
        wait_started(gates, 3)
        threading.Event().wait(0.2)
        assert gates.started == [0, 1, 2] and state()["position"] == 3
        stream.allow(5)
        wait_started(gates, 5)
        threading.Event().wait(0.2)
        assert sorted(gates.started) == [0, 1, 2, 3, 4]
    finally:
        gates.open(*range(20))
        stream.close()


def test_a_checkpoint_state_resumes_with_no_group_lost_or_drawn_twice(pool):
    """A state taken mid-stream, loaded by a fresh stream: the groups pending at the save are generated again, under
    their serials, and the sampler continues after its last draw; over the two streams every draw is taken exactly
    once. Fails if the state missed groups done but not taken, counted taken ones as pending, or the resumed stream
    redrew pending prompts from the sampler (a prompt twice) or forgot them (a prompt lost)."""
    gates = Gates()
    draw, state = sampler()
    stream = GroupStream(draw, gates.generate, capacity=4)
    stream.start(pool.submit)
    wait_started(gates, 4)
    gates.open(1, 3)
    first = stream.take(2)
    wait_started(gates, 6)
    gates.open(4)  # done, not taken: still pending at the save
    threading.Event().wait(0.1)
    saved = stream.state(state)
    gates.open(*range(20))
    stream.close()
    assert saved["pending"] == [[0, 100], [2, 102], [4, 104], [5, 105]] and saved["position"] == 6
    assert saved["next_serial"] == 6

    gates2 = Gates()
    again, next_serial = requeued(saved, Prompt)
    draw2, _ = sampler(saved["position"])
    resumed = GroupStream(draw2, gates2.generate, capacity=4, requeue=again, next_serial=next_serial)
    resumed.start(pool.submit)
    try:
        wait_started(gates2, 4)
        assert sorted(gates2.started) == [0, 2, 4, 5]  # the pending ones first, nothing new yet
        gates2.open(*range(20))
        second = resumed.take(6)
    finally:
        resumed.close()
    taken = [(d.serial, d.prompt.index) for d, _ in first + second]
    assert sorted(taken) == [(s, 100 + s) for s in range(8)]


def test_a_failed_group_is_raised_at_the_take_naming_it(pool):
    """Fails if a group whose generation raised were skipped (a step short of a group, silently) or its error lost
    the serial and prompt it belongs to."""
    gates = Gates(fail={1})
    draw, _ = sampler()
    stream = GroupStream(draw, gates.generate, capacity=2)
    stream.start(pool.submit)
    try:
        gates.open(1)
        with pytest.raises(GroupFailed, match=r"group 1 \(prompt 101\) failed: ConnectionError: engine http"):
            stream.take(1)
    finally:
        gates.open(*range(20))
        stream.close()


def test_completion_order_evicts_the_groups_that_took_longest_and_the_figure_says_so(pool):
    """Completion time grows with length: group 0's responses are 64 tokens and it completes two syncs after it was
    drawn; the others are 8 tokens and complete within a step. Two groups a step, ``max_staleness`` 1, the real
    stream and ``drop_stale``: step 3 takes group 0 (drawn under version 0, trained from version 2) and evicts it, so
    the step's evicted samples are 64 tokens long against a step mean of 36. Fails if the evicted groups' length
    were not logged (the bias toward short responses would go unseen) or were the kept ones'."""
    import numpy as np

    from r3rl import metrics as M
    from r3rl.sample import Sample, SampleStatus
    from r3rl.train.staleness import drop_stale

    gates, served, drawn_under = Gates(), {"version": 0}, {}

    async def generate(drawn: Drawn):
        drawn_under[drawn.serial] = served["version"]
        return await gates.generate(drawn)

    def samples_of(serial: int, group: int) -> list[Sample]:
        length = 64 if serial == 0 else 8
        return [Sample(index=group * 2 + j, group=group, request_id=f"g{serial}-{j}", prompt_ids=np.arange(3),
                       response_ids=np.arange(length), rollout_logprobs=np.zeros(length, np.float32),
                       loss_mask=np.ones(length, np.float32), finish_reason="stop", status=SampleStatus.COMPLETED,
                       weight_version=drawn_under[serial]) for j in range(2)]

    draw, _ = sampler()
    stream = GroupStream(draw, generate, capacity=4)
    stream.start(pool.submit)
    stats = []
    try:
        for step, ready in enumerate(((1, 2), (3, 4), (0, 5)), start=1):
            wait_started(gates, 4 + 2 * (step - 1))
            gates.open(*ready)
            taken = stream.take(2)
            batch = [s for g, (d, _) in enumerate(taken) for s in samples_of(d.serial, g)]
            _, figures = drop_stale(batch, step - 1, 1)
            stats.append((figures, float(np.mean([s.response_length for s in batch]))))
            served["version"] = step  # the weights of this step go to the engines
    finally:
        gates.open(*range(20))
        stream.close()
    assert all(M.EVICTED_RESPONSE_LENGTH_MEAN not in figures for figures, _ in stats[:2])
    figures, mean_length = stats[2]
    assert figures[M.DROPPED_STALE] == 2 and figures[M.EVICTED_RESPONSE_LENGTH_MEAN] == 64.0 and mean_length == 36.0
