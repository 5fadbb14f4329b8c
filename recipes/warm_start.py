"""The SFT warm start of a GRPO run (``warm_start.enabled``): a cold-start SFT on worked solutions of the run's own
generated task, whose HF export is the checkpoint GRPO starts from.

Real pipelines start RL from an SFT model; a random tiny model never answers right, so GRPO would have no signal.
The warm start is the SFT recipe (``recipes/sft.py``) run in this process on a config derived from the GRPO one:
the same model, parallelism and trainer; ``data`` becomes the ``sft`` split of the same arithmetic problem space
(``r3rl.data.arithmetic.SPLITS``: GRPO's prompts and the held-out set never share a problem with it); no eval
points. It is cached under ``run.data_dir/warm_start/`` by a fingerprint of everything that shapes its weights,
so it runs once per machine and model; an interrupted warm start resumes from its checkpoints.
"""

from __future__ import annotations

import dataclasses

from r3rl.config.schema import R3RLConfig, freeze
from r3rl.models.tiny_moe import ensure_checkpoint
# the derived config and its cache key live in the library, where the dry run reads them
from r3rl.warm_start import (MARKER, applies, describe, fingerprint, folder, is_cached, made_from, sft_config,
                             started)
from recipes.common import console

__all__ = ["ensure", "fingerprint", "sft_config"]


def ensure(cfg: R3RLConfig) -> R3RLConfig:
    """``cfg`` starting from its warm start's HF folder, made first when no cached one matches (a no-op without
    ``warm_start.enabled``, or with data other than the generated arithmetic task)."""
    if not applies(cfg):
        if cfg.warm_start.enabled:
            console.print(f"no SFT warm start: {describe(cfg).partition(': ')[2]}")
        return cfg
    ensure_checkpoint(cfg.model)  # the generated model the warm start trains (fingerprinted by its config)
    where = folder(cfg)
    hf = where / "hf"
    if not is_cached(cfg):
        sft = sft_config(cfg)
        sft = dataclasses.replace(sft, run=dataclasses.replace(sft.run, output_dir=str(where)),
                                  sft=dataclasses.replace(sft.sft, export_dir=str(hf)))
        freeze(sft)
        ws = cfg.warm_start
        console.rule(f"[bold]SFT warm start: {ws.num_steps} steps x {ws.batch_size} worked solutions, cached in "
                     f"{where}")
        from recipes import sft as sft_recipe

        sft_recipe.run_recipe(sft)
        if not (hf / "config.json").is_file():
            raise RuntimeError(f"the SFT warm start wrote no HF checkpoint in {hf}; its run is in {where}")
        (where / MARKER).write_text(made_from(cfg))
        console.rule("[bold]GRPO from the warm start")
    else:
        console.print(f"SFT warm start (cached): {hf}")
    return started(cfg)
