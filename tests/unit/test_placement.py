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
