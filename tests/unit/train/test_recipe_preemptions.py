"""The recipe's per-step preemption figures (``GRPORecipe.preemptions``). The engine's counter is a stand-in here:
a preemption under an in-flight update is what the launch refuses (r3rl.memory.in_flight_kv_shortfall), so a real
run cannot be made to show one; the counter itself is read from a real engine in
tests/integration/rollout/test_engine_metrics.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from r3rl import metrics as M
from r3rl.rollout import engine_metrics
from r3rl.sample import Sample, SampleStatus
from recipes.grpo import GRPORecipe


def sample(index: int, spans: list[tuple[str, int, int]]) -> Sample:
    s = Sample(index=index, group=0, request_id=f"r{index}", prompt_ids=np.arange(3, dtype=np.int32),
               response_ids=np.arange(4, dtype=np.int32), rollout_logprobs=np.zeros(4, dtype=np.float32),
               loss_mask=np.ones(4, dtype=np.float32), finish_reason="stop", status=SampleStatus.COMPLETED,
               weight_version=int(spans[0][0]))
    s.extra.update(weight_versions=[{"version": v, "start": a, "end": b} for v, a, b in spans], sent_version=3)
    return s


def test_preemptions_are_counted_per_step_and_spanning_samples_only_in_a_step_with_some(monkeypatch):
    """The counter reads 5 at the engines' start, 8 after step 1 and 8 after step 2: step 1 logs 3 preemptions and
    its one sample spanning an update as possibly recomputed by newer weights; step 2 logs 0 of each although a
    sample spans an update. Fails if the figure were the counter's total (an attached engine's history would count
    as the run's), if spanning samples counted in a step without preemptions (the figure would never read 0), or if
    a sample of one version counted."""
    reads = iter([8.0, 8.0])
    monkeypatch.setattr(engine_metrics, "read_counter", lambda urls, name: next(reads))
    recipe = GRPORecipe.__new__(GRPORecipe)  # the attributes preemptions() reads: no engine, no trainer
    recipe.engines, recipe.in_flight, recipe.preemptions_seen = SimpleNamespace(urls=["http://127.0.0.1:9"]), True, 5.0
    batch = [sample(0, [("3", 0, 2), ("4", 2, 4)]), sample(1, [("4", 0, 4)])]
    assert recipe.preemptions(batch) == {M.PREEMPTIONS: 3.0, M.PREEMPTED_SPANNING_SAMPLES: 1.0}
    assert recipe.preemptions(batch) == {M.PREEMPTIONS: 0.0, M.PREEMPTED_SPANNING_SAMPLES: 0.0}
