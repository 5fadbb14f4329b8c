"""bench/readme_figures.py and bench/replay_grid.py: the docs pages quote exactly the blocks the scripts print."""

from __future__ import annotations

import importlib.util

import pytest

from r3rl.config import CONF_DIR, compose

REPO = CONF_DIR.parent


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("readme_figures", REPO / "bench" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_from_a_run_replaces_the_readme_block_whole(figures, make_step_metrics, tmp_path):
    cfg = compose(["parallelism=cpu", "run.num_steps=3"])
    history = [{"step": s, **make_step_metrics(s, r3=True, samples=64)} for s in (1, 2, 3)]
    block = figures.readme_block(cfg, history, wall_s=200.0)
    samples = cfg.algorithm.rollout_batch_size * cfg.algorithm.n_samples_per_prompt
    assert f"3 steps of {samples} samples" in block and "| mean |" in block and " ± " in block
    # the headline is the paired figure: minus the mean paired delta over the steps (fails if the sign flips or the
    # unpaired difference of the two means comes back)
    from r3rl.tracking.summary import replay_removes

    removed = -sum(row["train/logprob_abs_diff_paired_delta"] for row in history) / 3
    found, se, _ = replay_removes(history)
    assert found == pytest.approx(removed)
    assert f"Replay removes {figures._pm(removed, se)} of" in block and "clustered by prompt" in block
    # an error below 0.0001 keeps two significant digits instead of printing as 0.0000
    assert figures._pm(0.000177, 0.000047) == "0.000177 ± 0.000047" and figures._pm(0.25, 0.03) == "0.2500 ± 0.0300"
    assert block.startswith(figures.BEGIN) and block.endswith(figures.END)

    readme = tmp_path / "README.md"
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text.count(figures.BEGIN) == 1 and text.count(figures.END) == 1
    readme.write_text(text)
    figures.write_block(readme, block, figures.BEGIN, figures.END)
    head, rest = text.split(figures.BEGIN)
    tail = rest.split(figures.END)[1]
    assert readme.read_text() == head + block + tail
    figures.write_block(readme, block, figures.BEGIN, figures.END)  # idempotent: the block is found again and replaced
    assert readme.read_text() == head + block + tail


def test_grid_block_has_a_row_per_run_and_the_paired_figure_only_under_r3(make_step_metrics, tmp_path):
    """bench/replay_grid.py's docs block: one row per (replay, correction) run with each figure's mean over steps,
    the paired "replay removes" only where the run had R3's paired pass, and the block found once in docs/r3.md and
    replaced whole. Fails if a column reads a key the recipe no longer logs (the cells turn to "-"), or if the
    paired figure is filled in for a run without the paired pass."""
    spec = importlib.util.spec_from_file_location("replay_grid", REPO / "bench" / "replay_grid.py")
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    # with rollout=vllm_r3 every run has the engine's routes, so every run logs its flip rate
    histories = {(replay, corr): [{"step": s, "r3/routing_flip_rate": 0.02,
                                   **make_step_metrics(s, r3=replay == "r3", samples=16)} for s in (1, 2)]
                 for corr in grid.CORRECTIONS for replay in grid.REPLAYS}
    block = grid.table(histories, steps=2)
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| replay")]
    assert len(rows) == len(grid.REPLAYS) * len(grid.CORRECTIONS)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert "-" not in cells[2:-1], row  # every figure of the grid is logged by every run
        assert (cells[-1] != "-") == (cells[0] == "r3"), row
    text = (REPO / "docs" / "r3.md").read_text()
    assert text.count(grid.BEGIN) == 1 and text.count(grid.END) == 1
    readme = tmp_path / "README.md"
    readme.write_text(text)
    grid.write_block(readme, block, grid.BEGIN, grid.END)
    head, rest = text.split(grid.BEGIN)
    assert readme.read_text() == head + block + rest.split(grid.END)[1]
