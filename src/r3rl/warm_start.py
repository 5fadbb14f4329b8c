"""What the SFT warm start of a GRPO run (``warm_start.enabled``) is, without running it: the SFT config it derives
from the GRPO one, its cache key and folder, and the checkpoint GRPO then starts from. ``recipes/warm_start.py``
runs it; the dry run reads from here whether it will run or is cached, and which folder the engines will serve.

The warm start is the SFT recipe on a config derived from the GRPO one: the same model, parallelism and trainer;
``data`` becomes the ``sft`` split of the same arithmetic problem space (``r3rl.data.arithmetic.SPLITS``: GRPO's
prompts and the held-out set never share a problem with it); no eval points. It is cached under
``run.data_dir/warm_start/`` by a fingerprint of everything that shapes its weights, so it runs once per machine and
model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from r3rl.config.schema import EnvConfig, LoRAConfig, R3RLConfig, freeze
from r3rl.data.arithmetic import SOLUTION_VERSION

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


def applies(cfg: R3RLConfig) -> bool:
    """The warm start runs before this run's GRPO: it is on, and the data is the generated arithmetic task."""
    return cfg.warm_start.enabled and cfg.recipe.name == "grpo" and cfg.data.name == "arithmetic"


def made_from(cfg: R3RLConfig) -> str:
    """The fingerprint as the text its marker file holds."""
    return json.dumps(fingerprint(cfg), sort_keys=True, default=str)


def folder(cfg: R3RLConfig) -> Path:
    """Where ``cfg``'s warm start is cached (its run, and its HF export under ``hf/``)."""
    digest = hashlib.sha256(made_from(cfg).encode()).hexdigest()[:12]
    return Path(cfg.run.data_dir).resolve() / "warm_start" / f"{cfg.model.name}-{digest}"


def is_cached(cfg: R3RLConfig) -> bool:
    """A finished warm start of these settings is on disk (its marker and its HF export)."""
    return (folder(cfg) / MARKER).is_file() and (folder(cfg) / "hf" / "config.json").is_file()


def started(cfg: R3RLConfig) -> R3RLConfig:
    """``cfg`` starting from its warm start's HF export: the checkpoint the trainer loads and the engines serve."""
    hf = folder(cfg) / "hf"
    return freeze(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=str(hf),
                                                                     generate_if_missing=False)))


def describe(cfg: R3RLConfig) -> str:
    """One line for the dry run: off, cached (where), or to run first (how long, where)."""
    if not cfg.warm_start.enabled or cfg.recipe.name != "grpo":
        return f"off: GRPO starts from model.checkpoint={cfg.model.checkpoint}"
    if cfg.data.name != "arithmetic":
        return (f"off: made for data=arithmetic, and data={cfg.data.name} starts from "
                f"model.checkpoint={cfg.model.checkpoint}")
    ws = cfg.warm_start
    if is_cached(cfg):
        return f"cached: GRPO starts from {folder(cfg) / 'hf'} (SFT of model.checkpoint={cfg.model.checkpoint})"
    return (f"runs first: {ws.num_steps} SFT steps x {ws.batch_size} worked solutions of model.checkpoint="
            f"{cfg.model.checkpoint}, exported to {folder(cfg) / 'hf'}, which GRPO then starts from")
