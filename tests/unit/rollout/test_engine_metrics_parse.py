"""Reading one counter out of vLLM's Prometheus text (``r3rl.rollout.engine_metrics.counter``)."""

from __future__ import annotations

from r3rl.rollout.engine_metrics import PREEMPTIONS, counter

TEXT = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:num_preemptions_created 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 5.0
"""


def test_a_counter_is_summed_over_its_label_sets_and_no_other_metric_counts():
    """Fails if a data-parallel engine's second label set were dropped, if a metric whose name merely starts with
    the counter's (the ``_created`` timestamp) were added, or if a counter not exported yet raised."""
    assert counter(TEXT, PREEMPTIONS) == 5.0
    assert counter(TEXT, "vllm:num_requests_running") == 5.0
    assert counter("# nothing yet\n", PREEMPTIONS) == 0.0
