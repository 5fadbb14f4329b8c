"""The SFT warm start's derived config, its cache key and its checks (recipes/warm_start.py); the run itself is
tests/integration/recipe/test_learning_run.py."""

from __future__ import annotations

import pytest

from r3rl.config import ConfigError
from r3rl.preflight import compose
from recipes import warm_start


def test_the_warm_start_trains_the_sft_share_of_the_same_task():
    """SFT recipe, the ``sft`` split of GRPO's problem space, its own steps, rate and batch, no eval points. Fails if
    the warm start drew from GRPO's draw (the CPU default, ``train``, takes in the rl share, whose problems only GRPO
    sees, and would take in the whole pool of 2,048 prompts) or kept GRPO's lr."""
    cfg = compose(["parallelism=cpu", "warm_start.num_steps=7", "warm_start.lr=0.003", "warm_start.batch_size=8"])
    sft = warm_start.sft_config(cfg)
    assert sft.recipe.name == "sft" and sft.data.split == "sft" and cfg.data.split == "train"
    assert (sft.data.ops, sft.data.max_operand) == (cfg.data.ops, cfg.data.max_operand)
    assert sft.run.num_steps == 7 and sft.run.eval_every == 0 and sft.trainer.lr == 0.003 and sft.sft.batch_size == 8
    assert sft.data.verbose_share == cfg.warm_start.verbose_share


def test_the_cache_key_follows_what_shapes_the_weights_only():
    """A new warm-start setting or model makes a new warm start; a GRPO-only setting (its lr, its steps) reuses the
    cached one. Fails if the key missed the warm start's settings (a stale model would be reused), among them the
    trainer's transformer_overrides (a load-balancing loss shapes the router), or held GRPO's (every GRPO tweak would
    redo the SFT)."""
    base = warm_start.fingerprint(compose(["parallelism=cpu"]))
    assert warm_start.fingerprint(compose(["parallelism=cpu", "trainer.lr=1e-3", "run.num_steps=3"])) == base
    # a LoRA run starts from the full-parameter warm start (its adapters are GRPO's)
    lora = compose(["parallelism=cpu", "trainer.lora.rank=8"])
    assert warm_start.fingerprint(lora) == base and warm_start.sft_config(lora).trainer.lora.rank == 0
    for override in ("warm_start.num_steps=10", "warm_start.verbose_share=0.2", "data.max_operand=60",
                     "model.init_seed=3", "+trainer.transformer_overrides.moe_aux_loss_coeff=0.01"):
        assert warm_start.fingerprint(compose(["parallelism=cpu", override])) != base, override


def test_other_data_starts_from_the_checkpoint_and_bad_settings_name_their_key(tmp_path):
    """With data other than the generated task the warm start is skipped (the config is returned as it is); a batch
    the trainer cannot split is refused naming warm_start.batch_size. Fails if either check were dropped."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "label": "2"}\n' * 64)  # one step's prompts (dapo_math: 64)
    cfg = compose(["parallelism=cpu", "data=dapo_math", f"data.path={data}"])
    assert warm_start.ensure(cfg) is cfg
    with pytest.raises(ConfigError, match="warm_start.batch_size"):
        compose(["parallelism=cpu", "warm_start.batch_size=0"])
