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
import hashlib
import json
from pathlib import Path

from r3rl.config.schema import EnvConfig, LoRAConfig, R3RLConfig, freeze
from r3rl.data.arithmetic import SOLUTION_VERSION
from r3rl.models.tiny_moe import ensure_checkpoint
from recipes.common import console

# bumped when the warm start's recipe changes for the same settings, so cached warm starts are redone (2: a trainer
# rank on logical GPUs computes on its share of the node's cores, which changes float rounding)
WARM_START_VERSION = 2
MARKER = "r3rl_warm_start.json"


def sft_config(cfg: R3RLConfig) -> R3RLConfig:
    """The SFT run of ``cfg``'s warm start (frozen; its folder is set by ``ensure``)."""
    ws = cfg.warm_start
    data = dataclasses.replace(
        cfg.data, name="arithmetic_sft", split="sft", num_generated_prompts=ws.num_examples,
        verbose_share=ws.verbose_share, tool_share=ws.tool_share,
        path=str(Path(cfg.run.data_dir) / "sft" / f"arithmetic-warm-s{cfg.data.seed}-n{ws.num_examples}.jsonl"))
    return dataclasses.replace(
        cfg, recipe=dataclasses.replace(cfg.recipe, name="sft", run_name_suffix="-sft"), data=data, env=EnvConfig(),
        run=dataclasses.replace(cfg.run, num_steps=ws.num_steps, eval_every=0, save_every=ws.num_steps),
        # a constant rate: the cosine's tail teaches the tiny model too little arithmetic in a short warm start
        # full-parameter: a LoRA run's adapters start on the warm start's weights (trainer.lora is GRPO's alone)
        trainer=dataclasses.replace(cfg.trainer, lr=ws.lr, min_lr=ws.lr, freeze_router=False, lora=LoRAConfig()),
        sft=dataclasses.replace(cfg.sft, batch_size=ws.batch_size))


def fingerprint(cfg: R3RLConfig) -> dict:
    """Everything that shapes the warm start's weights."""
    sft = sft_config(cfg)

    def keep(node) -> dict:
        return {k: v for k, v in vars(node).items() if not k.startswith("_")}

    return {"version": WARM_START_VERSION, "solution_version": SOLUTION_VERSION, "model": keep(cfg.model),
            "data": {k: v for k, v in keep(sft.data).items() if k != "path"}, "warm_start": keep(cfg.warm_start),
            # transformer_overrides too: a load-balancing loss or another router setting shapes the weights
            "trainer": {k: dict(v) if isinstance(v, dict) else v for k, v in keep(sft.trainer).items()
                        # GRPO's alone: a frozen or LoRA run starts from the same warm start
                        if k not in ("freeze_router", "lora")},
            "parallelism": cfg.parallelism.name, "seed": cfg.run.seed}


def ensure(cfg: R3RLConfig) -> R3RLConfig:
    """``cfg`` starting from its warm start's HF folder, made first when no cached one matches (a no-op without
    ``warm_start.enabled``, or with data other than the generated arithmetic task)."""
    if not cfg.warm_start.enabled:
        return cfg
    if cfg.data.name != "arithmetic":
        console.print(f"no SFT warm start: it is made for data=arithmetic, and data={cfg.data.name} starts from "
                      f"model.checkpoint={cfg.model.checkpoint}")
        return cfg
    ensure_checkpoint(cfg.model)  # the generated model the warm start trains (fingerprinted by its config)
    made_from = json.dumps(fingerprint(cfg), sort_keys=True, default=str)
    folder = Path(cfg.run.data_dir).resolve() / "warm_start" / (
        f"{cfg.model.name}-" + hashlib.sha256(made_from.encode()).hexdigest()[:12])
    hf = folder / "hf"
    marker = folder / MARKER
    if not (marker.is_file() and (hf / "config.json").is_file()):
        sft = sft_config(cfg)
        sft = dataclasses.replace(sft, run=dataclasses.replace(sft.run, output_dir=str(folder)),
                                  sft=dataclasses.replace(sft.sft, export_dir=str(hf)))
        freeze(sft)
        ws = cfg.warm_start
        console.rule(f"[bold]SFT warm start: {ws.num_steps} steps x {ws.batch_size} worked solutions, cached in "
                     f"{folder}")
        from recipes import sft as sft_recipe

        sft_recipe.run_recipe(sft)
        if not (hf / "config.json").is_file():
            raise RuntimeError(f"the SFT warm start wrote no HF checkpoint in {hf}; its run is in {folder}")
        marker.write_text(made_from)
        console.rule("[bold]GRPO from the warm start")
    else:
        console.print(f"SFT warm start (cached): {hf}")
    started = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=str(hf),
                                                                 generate_if_missing=False))
    return freeze(started)
