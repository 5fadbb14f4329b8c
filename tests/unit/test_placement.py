"""Placement is a pure function of the parallelism config: GPU maps for the shipped layouts and the error cases."""

from __future__ import annotations

import pytest

from r3rl.config.schema import ParallelismConfig, RolloutParallelConfig, TrainerParallelConfig
from r3rl.placement import GPU, PlacementError, place


def par(nnodes=1, gpn=8, colocated=False, train=4, roll=4, engines=1, rtp=4, rdp=1, device="cuda"):
    return ParallelismConfig(
        name="t", device=device, nnodes=nnodes, gpus_per_node=gpn, colocated=colocated,
        trainer=TrainerParallelConfig(num_gpus=train, expert_parallel=1),
        rollout=RolloutParallelConfig(num_gpus=roll, num_engines=engines, tensor_parallel=rtp, data_parallel=rdp),
    )


@pytest.mark.parametrize(
    "cfg, trainer, engines, colocated",
    [
        pytest.param(par(colocated=True, train=8, roll=8, engines=2), [(0, g) for g in range(8)],
                     [(0, (0, 1, 2, 3)), (0, (4, 5, 6, 7))], True, id="colocated_8"),
        pytest.param(par(), [(0, g) for g in range(4)], [(0, (4, 5, 6, 7))], False, id="disagg_4p4"),
        pytest.param(par(nnodes=2, train=8, roll=8, engines=2), [(0, g) for g in range(8)],
                     [(1, (0, 1, 2, 3)), (1, (4, 5, 6, 7))], False, id="disagg_2n_8p8"),
        pytest.param(par(nnodes=2, train=4, roll=12, engines=3), [(0, g) for g in range(4)],
                     [(0, (4, 5, 6, 7)), (1, (0, 1, 2, 3)), (1, (4, 5, 6, 7))], False, id="disagg_2n_4p12"),
        pytest.param(par(gpn=2, train=1, roll=1, engines=1, rtp=1, device="cpu"), [(0, 0)], [(0, (1,))], False,
                     id="cpu_1p1"),
    ],
)
def test_layouts(cfg, trainer, engines, colocated):
    p = place(cfg)
    assert p.colocated is colocated
    assert p.trainer == tuple(GPU(n, g) for n, g in trainer)
    assert [(e.node, e.gpus) for e in p.engines] == engines
    assert len(p.bundles("trainer")) == len(trainer)
    assert [b["GPU"] for b in p.bundles("rollout")] == [len(g) for _, g in engines]
    if not colocated:
        assert not set(p.gpus_of("trainer")) & set(p.gpus_of("rollout")), "disaggregated roles must not share GPUs"
    else:
        assert set(p.gpus_of("rollout")) <= set(p.gpus_of("trainer"))


def test_cpu_bundles_reserve_a_fraction_of_a_core():
    cpu = place(par(gpn=2, train=1, roll=1, rtp=1, device="cpu"))
    gpu = place(par())
    assert cpu.logical_gpus and not gpu.logical_gpus
    assert cpu.bundles("trainer")[0]["CPU"] < 1 <= gpu.bundles("trainer")[0]["CPU"]


@pytest.mark.parametrize(
    "cfg, key",
    [
        pytest.param(par(train=4, roll=8, engines=2), "parallelism.rollout.num_gpus", id="too_many_gpus"),
        pytest.param(par(colocated=True, train=8, roll=4), "parallelism.rollout.num_gpus", id="colocated_unequal"),
        pytest.param(par(engines=2), "parallelism.rollout.num_engines", id="engines_do_not_tile"),
        pytest.param(par(nnodes=2, train=6, roll=8, engines=2), "parallelism.rollout.tensor_parallel",
                     id="engine_spans_nodes"),
    ],
)
def test_errors_name_the_key(cfg, key):
    with pytest.raises(PlacementError, match=key.replace(".", r"\.")):
        place(cfg)


def test_trainer_ranks_reserve_the_nodes_cpu_share_and_set_torch_threads_from_it():
    """Issue 23 item 5: fails if trainer bundles go back to one CPU each (the offloaded AdamW of ~7.6 B parameters
    per rank on one thread), if the rank's torch thread count is not taken from ``parallelism.cpus_per_gpu``, or if a
    rank on logical GPUs goes back to the one thread Ray's fraction of a core gives it (a CPU GRPO step 2.8 -> 3.8 s)
    instead of its share of the node's cores."""
    import dataclasses

    import torch

    from r3rl.placement import set_trainer_threads

    gpu = dataclasses.replace(par(), cpus_per_gpu=12.0)
    p = place(gpu)
    assert [b["CPU"] for b in p.bundles("trainer")] == [12.0] * 4 and p.trainer_cpus == 12.0
    assert p.torch_threads == 12
    assert [b["CPU"] for b in p.bundles("rollout")] == [1.0]  # engines: vLLM's processes, outside Ray's count
    # the CPU profile keeps its fraction of a core and torch's threads
    cpu = place(par(gpn=2, train=1, roll=1, rtp=1, device="cpu"))
    assert cpu.trainer_cpus == 0.1 and cpu.torch_threads is None
    before = torch.get_num_threads()
    try:
        assert set_trainer_threads(dataclasses.replace(par(), cpus_per_gpu=3.0)) == 3
        assert torch.get_num_threads() == 3
        # logical GPUs: the node's cores over the trainer ranks on it
        assert set_trainer_threads(par(gpn=2, train=1, roll=1, rtp=1, device="cpu"), 0, cores=2) == 2
        assert set_trainer_threads(par(gpn=3, train=2, roll=1, rtp=1, device="cpu"), 1, cores=5) == 2
        assert set_trainer_threads(par(gpn=3, train=2, roll=1, rtp=1, device="cpu"), 1, cores=1) == 1
        # real GPUs without cpus_per_gpu: torch's own count is left as it is
        assert set_trainer_threads(par(), 0, cores=64) == torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_shipped_gpu_layouts_give_each_trainer_rank_its_cpu_share():
    from r3rl.config import compose
    from r3rl.plan import build_plan, describe

    cfg = compose(["experiment=qwen3_30b_r3_4p4"])
    shown = describe(cfg, build_plan(cfg))["placement"]["trainer"]
    assert shown["cpus_per_rank"] == cfg.parallelism.cpus_per_gpu > 1
    assert shown["torch_threads_per_rank"] == int(cfg.parallelism.cpus_per_gpu)
