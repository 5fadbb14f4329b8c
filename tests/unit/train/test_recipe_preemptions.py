"""The recipe's per-step preemption figures (``GRPORecipe.preemptions``, by batch window:
``engine_metrics.PreemptionWindows``). The engine's counter is a stand-in here:
a preemption under an in-flight update is what the launch refuses (r3rl.memory.in_flight_kv_fit), so a real
run cannot be made to show one; the counter itself is read from a real engine in
tests/integration/rollout/test_engine_metrics.py."""

from __future__ import annotations

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


class Counter:
    """The engines' ``vllm:num_preemptions_total`` as a script sets it: ``at`` moves it between readings."""

    def __init__(self, value: float):
        self.value = value

    def __call__(self) -> float:
        return self.value


def recipe_with(counter: Counter, in_flight: bool) -> GRPORecipe:
    recipe = GRPORecipe.__new__(GRPORecipe)  # the attributes preemptions() reads: no engine, no trainer
    recipe.in_flight = in_flight
    recipe.preemption_windows = engine_metrics.PreemptionWindows(counter)
    return recipe


def test_preemptions_are_counted_per_step_and_spanning_samples_only_in_a_step_with_some():
    """The counter reads 5 at the engines' start and 8 after step 1's generation; step 2's generation preempts
    nothing. Step 1 logs 3 preemptions and its one sample spanning an update as possibly recomputed by newer weights;
    step 2 logs 0 of each although a sample spans an update. Fails if the figure were the counter's total (an
    attached engine's history would count as the run's), if spanning samples counted in a step without preemptions
    (the figure would never read 0), or if a sample of one version counted."""
    counter = Counter(5.0)
    recipe = recipe_with(counter, in_flight=True)
    batch = [sample(0, [("3", 0, 2), ("4", 2, 4)]), sample(1, [("4", 0, 4)])]
    with recipe.preemption_windows.window(1):
        counter.value = 8.0
    with recipe.preemption_windows.window(2):
        pass
    assert recipe.preemptions(1, batch) == {M.PREEMPTIONS: 3.0, M.PREEMPTIONS_WINDOW_SHARED: 0.0,
                                            M.PREEMPTED_SPANNING_SAMPLES: 1.0}
    assert recipe.preemptions(2, batch) == {M.PREEMPTIONS: 0.0, M.PREEMPTIONS_WINDOW_SHARED: 0.0,
                                            M.PREEMPTED_SPANNING_SAMPLES: 0.0}


def test_a_preemption_is_logged_at_the_step_whose_batch_it_hit():
    """One step ahead: step 1's batch generates preempting nothing; while step 1 trains, batch 2 generates and is
    preempted twice; then an eval point's generation preempts once (outside any batch). Step 1 must log 0 and step 2
    the 2, and the eval's one is no step's. Fails if the counter went back to being read once a step when its
    figures are logged (issue 70, item 2: batch 2's preemptions were logged at step 1, the eval's at step 2)."""
    counter = Counter(0.0)
    recipe = recipe_with(counter, in_flight=False)
    windows = recipe.preemption_windows
    with windows.window(1):
        pass
    with windows.window(2):  # generating ahead while step 1 trains
        counter.value += 2
    assert recipe.preemptions(1, [])[M.PREEMPTIONS] == 0.0
    counter.value += 1  # the eval's requests
    assert recipe.preemptions(2, []) == {M.PREEMPTIONS: 2.0, M.PREEMPTIONS_WINDOW_SHARED: 0.0}


def test_overlapping_generations_say_their_windows_were_shared():
    """In flight the next batch starts beside the last one's slowest samples: both windows see a preemption in the
    overlap, so both counts hold it and both steps read shared = 1; a stream's step (completion order) is always
    shared. Fails if an overlap went unflagged (a count that may be another batch's would read as this one's)."""
    counter = Counter(0.0)
    recipe = recipe_with(counter, in_flight=False)
    windows = recipe.preemption_windows
    first = windows.window(1)
    first.__enter__()
    with windows.window(2):
        counter.value += 1
        first.__exit__(None, None, None)
    assert recipe.preemptions(1, []) == {M.PREEMPTIONS: 1.0, M.PREEMPTIONS_WINDOW_SHARED: 1.0}
    assert recipe.preemptions(2, []) == {M.PREEMPTIONS: 1.0, M.PREEMPTIONS_WINDOW_SHARED: 1.0}
    counter.value += 4
    windows.since_last(3)
    assert recipe.preemptions(3, []) == {M.PREEMPTIONS: 4.0, M.PREEMPTIONS_WINDOW_SHARED: 1.0}
