"""bench/readme_figures.py: the README quotes exactly the block the script prints for the default run."""

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
    assert block.startswith(figures.BEGIN) and block.endswith(figures.END)

    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    assert text.count(figures.BEGIN) == 1 and text.count(figures.END) == 1
    readme.write_text(text)
    figures.write_readme(readme, block)
    head, rest = text.split(figures.BEGIN)
    tail = rest.split(figures.END)[1]
    assert readme.read_text() == head + block + tail
    figures.write_readme(readme, block)  # idempotent: the block is found again and replaced
    assert readme.read_text() == head + block + tail
