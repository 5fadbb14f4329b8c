"""The launch checks above ``r3rl.config``: what reads files, builds objects or plans memory, run once before any
process starts.

``r3rl.config`` composes a config and checks its schema and cross-field rules; ``preflight`` then checks what only
the files and libraries can say: the training data (every record, named by file, line or row and key), the SFT
records, the eval sets and their overlap with the training prompts, the reward's grader, an existing checkpoint's
shape, the environment (``env.environment`` built once), the memory plan against the GPU and host budgets, and (at
launch) the free disk under ``run.output_dir`` against the checkpoints the run keeps. Every
problem comes back in one ``ConfigError`` list, each naming the key to change, the way config errors print.
"""

from __future__ import annotations

from collections.abc import Sequence

from r3rl.config import ConfigError, compose as compose_config
from r3rl.config.schema import R3RLConfig

__all__ = ["compose", "preflight", "problems"]


def compose(overrides: Sequence[str] = (), *, launching: bool = False) -> R3RLConfig:
    """``r3rl.config.compose`` followed by ``preflight``: what ``run.py`` checks before it starts anything."""
    return preflight(compose_config(overrides), launching=launching)


def preflight(cfg: R3RLConfig, *, launching: bool = False) -> R3RLConfig:
    """``cfg`` if every launch check passes, else ``ConfigError`` listing every problem with its key.
    ``launching``: the run starts on this machine now, so what it reads must be here (a prompt file it will not
    generate); a dry run or a config checked elsewhere leaves files that are mounted later alone."""
    found = problems(cfg, launching=launching)
    if found:
        raise ConfigError(found)
    return cfg


def problems(cfg: R3RLConfig, *, launching: bool = False) -> list[tuple[str, str]]:
    """(key, reason) of every launch check that fails; memory is planned once the rest passes (it reads the
    data's lengths only through the config, but its figures mean nothing for a config that cannot run)."""
    found: list[tuple[str, str]] = []
    found.extend(reward_problems(cfg))
    found.extend(data_problems(cfg, launching))
    found.extend(checkpoint_problems(cfg.model))
    found.extend(environment_problems(cfg))
    found.extend(resume_problems(cfg))
    # eval sets, their files included: a malformed record is named by file and line here, before launch
    from r3rl.eval.sets import eval_overlaps, eval_problems

    found.extend(eval_problems(cfg))
    if not found:  # reads the training data, which needs sane data and eval settings
        found.extend(eval_overlaps(cfg))
    if not found:
        found.extend(memory_problems(cfg))
    if not found and launching:
        found.extend(disk_problems(cfg))
    return found


def data_problems(cfg: R3RLConfig, launching: bool = False) -> list[tuple[str, str]]:
    """The training data as the recipe will read it: SFT records (recipe=sft, JSONL only) or prompts, every bad
    record, missing column or empty label named by file, line or row and key."""
    from r3rl.data.dataset import FORMATS, prompt_data_problems
    from r3rl.data.formats import detect_format

    if cfg.data.format not in FORMATS:
        return [("data.format", f"must be one of {FORMATS}, got {cfg.data.format!r}")]
    if cfg.recipe.name == "sft":
        from r3rl.data.sft import sft_data_problems

        fmt = detect_format(cfg.data.path, cfg.data.format)
        if fmt != "jsonl":
            return [("data.format", f"recipe=sft reads JSONL records only; {cfg.data.path} is read as {fmt} "
                                    f"(data.format={cfg.data.format})")]
        return list(sft_data_problems(cfg))
    return list(prompt_data_problems(cfg.data, allow_missing=not launching,
                                     rollout_batch_size=cfg.algorithm.rollout_batch_size))


def environment_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """An ``env.environment`` that cannot be built (an unknown class, a wrong argument, not an ``Environment``)."""
    from r3rl.env import build_environment, multi_turn

    if not multi_turn(cfg.env):
        return []
    try:
        build_environment(cfg.env)
    except ValueError as err:
        key, _, reason = str(err).partition(": ")
        return [(key, reason)]
    return []


def reward_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """(key, reason) for a training reward (``reward``) that cannot grade: an unknown grader, a timeout that is no
    limit, partial credit from a grader that has none, math-verify not installed."""
    import importlib.util

    from r3rl.data.reward import GRADERS

    rw, problems = cfg.reward, []
    if rw.name not in GRADERS:
        problems.append(("reward.name", f"must be one of {sorted(GRADERS)} (reward=<name>), got {rw.name!r}"))
    elif cfg.data.partial_credit > 0 and GRADERS[rw.name].answer is None:
        problems.append(("data.partial_credit", f"must be 0 with reward={rw.name}, which grades right or wrong only "
                                                f"(partial credit needs reward=boxed_exact or exact), got "
                                                f"{cfg.data.partial_credit}"))
    if not rw.timeout_s > 0:
        problems.append(("reward.timeout_s", f"must be > 0 (seconds per response), got {rw.timeout_s}"))
    named = {f"eval.sets.{n}.reward": s.reward for n, s in cfg.eval.sets.items()}
    for key, name in {"reward.name": rw.name, **named}.items():
        if name == "math_verify" and importlib.util.find_spec("math_verify") is None:
            problems.append((key, "math_verify needs the math-verify package: pip install 'math-verify[antlr4_9_3]'"))
    return problems


def checkpoint_problems(model) -> list[tuple[str, str]]:
    """An existing ``model.checkpoint`` folder not of r3rl's making (a downloaded model, an SFT run's export) whose
    config.json disagrees with the ``model`` config's shape. A folder r3rl generated is regenerated on a change of
    shape, and a missing one is reported when the run prepares it (GPU clusters mount it later)."""
    import json
    from pathlib import Path

    from r3rl.config.families import FAMILIES, moe_layers
    from r3rl.models.layers import hf_moe_layers
    from r3rl.models.tiny_moe import MARKER

    folder = Path(model.checkpoint)
    config = folder / "config.json"
    if not config.is_file() or (model.generate_if_missing and (folder / MARKER).is_file()):
        return []
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError) as err:
        return [("model.checkpoint", f"{config}: not readable as JSON ({str(err)[:200]})")]
    if not isinstance(hf, dict):
        return [("model.checkpoint", f"{config}: not a JSON object (a model's config.json holds one)")]
    if hf.get("model_type", model.architecture) != model.architecture:
        # another family's fields (n_routed_experts, first_k_dense_replace) would pass the shape check unread
        return [("model.checkpoint", f"{config} has model_type={hf['model_type']!r}, but model={model.name} is "
                                     f"model.architecture={model.architecture!r} (choose the model config of that "
                                     f"family; r3rl builds {sorted(FAMILIES)})")]
    rope = hf.get("rope_parameters")  # transformers 5 reads RoPE's base and share there first
    if isinstance(rope, dict):
        hf = {**hf, **{k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}}
    # every field the family spells: the shapes, and what vLLM reads from the checkpoint while Megatron takes it from
    # the model config (the routing weights' normalisation and scale, groups, RoPE's base and share, the norms'
    # epsilon, biases, tied embeddings): a disagreement there is a train-rollout mismatch no replay removes
    wrong = [f"{hf_key}={hf[hf_key]} but model.{key}={getattr(model, key)}"
             for key, hf_key in FAMILIES[model.architecture].hf_fields.items()
             if hf_key in hf and hf[hf_key] != getattr(model, key)]
    if wrong:
        return [("model.checkpoint", f"{config} is not a model={model.name}: {'; '.join(wrong)} (choose the model "
                                     "config of that checkpoint, or another checkpoint)")]
    try:
        moe = hf_moe_layers(hf) if "num_hidden_layers" in hf else moe_layers(model)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as err:
        return [("model.checkpoint", f"{config}: its MoE layer fields (mlp_only_layers, decoder_sparse_step, "
                                     f"first_k_dense_replace, moe_layer_freq) do not read as layers ({err})")]
    if moe != moe_layers(model):
        dense = sorted(set(range(model.num_layers)) - set(moe))
        return [("model.checkpoint", f"{config}: decoder layers {dense} have a dense MLP (mlp_only_layers="
                                     f"{hf.get('mlp_only_layers')}, decoder_sparse_step={hf.get('decoder_sparse_step')}"
                                     f", first_k_dense_replace={hf.get('first_k_dense_replace')}), but model="
                                     f"{model.name} makes layers {moe_layers(model)} MoE: each route would be "
                                     "replayed one layer off after a dense one (verl #5037)")]
    return []


def resumed_checkpoint_format(cfg: R3RLConfig) -> str | None:
    """The optimizer format of the checkpoint a launch would resume (``run.resume`` and one in ``run.output_dir``),
    or None. Its load follows that format, whatever ``trainer.checkpoint.sharding`` says for the run's own saves."""
    from pathlib import Path

    from r3rl import checkpoint

    if not cfg.run.resume:
        return None
    try:
        folder = checkpoint.latest(Path(cfg.run.output_dir))
        return checkpoint.read_complete(folder / checkpoint.TRAINER_DIR).get("optimizer_format") if folder else None
    except (OSError, ValueError):  # an unreadable one is the resume's own error to report, with its path
        return None


def resume_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """A checkpoint this launch would resume that the config cannot continue: groups a stream drew and did not train
    (``algorithm.group_intake=completion``) are generated again by a stream alone; a trainer state saved by a
    model of other shapes, with the routers frozen (or training) when ``trainer.freeze_router`` is toggled, or with
    other LoRA adapters (or none), fails inside Megatron's load after every process started. A fresh run
    (``run.resume=false``) into a folder with checkpoints is refused (``fresh_run_problems``)."""
    from pathlib import Path

    from r3rl import checkpoint

    if not cfg.run.resume:
        return fresh_run_problems(cfg)
    try:
        folder = checkpoint.latest(Path(cfg.run.output_dir))
        if folder is None:
            return []
        pending = checkpoint.read_meta(folder).data_state.get("pending")
        saved = checkpoint.read_complete(folder / checkpoint.TRAINER_DIR)
    except (OSError, ValueError) as err:  # CheckpointError, FileNotFoundError: each names the file
        return [("run.resume", f"the checkpoint this launch would resume cannot be read: {err}. Repair or remove "
                               "it (latest may name an older step_* folder), or start over in another "
                               "run.output_dir")]
    found = []
    if pending and cfg.algorithm.group_intake != "completion":
        found.append(("algorithm.group_intake", f"{folder} holds {len(pending)} groups drawn and not yet trained "
                                                "(saved with algorithm.group_intake=completion), which batch intake "
                                                "would lose: resume with algorithm.group_intake=completion "
                                                "algorithm.weight_update=in_flight, or start over in another "
                                                "run.output_dir"))
    wrong_model = checkpoint.model_mismatch(folder, saved, cfg.model)
    if wrong_model:
        found.append(("model", wrong_model))
    frozen = saved.get("freeze_router")  # None: saved before r3rl recorded it
    if saved.get("optimizer_state") and frozen is not None and frozen != cfg.trainer.freeze_router:
        found.append(("trainer.freeze_router", checkpoint.freeze_router_mismatch(folder, frozen)))
    # the adapters' shape only: the base they were trained on is checked at load, once the warm start is known
    adapters = saved.get("lora")
    wrong_adapters = checkpoint.lora_mismatch(folder, adapters and {k: v for k, v in adapters.items() if k != "base"},
                                              checkpoint.lora_shape(cfg.trainer.lora))
    if wrong_adapters:
        found.append(("trainer.lora", wrong_adapters))
    return found


def fresh_run_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """``run.resume=false`` into a folder that holds checkpoints: the new run's saves would sit beside the old run's,
    ``latest`` would flip between them, and pruning by step would delete whichever run's are older. Refused; the
    user keeps or moves the old run."""
    from pathlib import Path

    from r3rl import checkpoint

    steps = checkpoint.existing_steps(Path(cfg.run.output_dir))
    if not steps:
        return []
    return [("run.resume", f"run.resume=false starts a new run in run.output_dir={cfg.run.output_dir}, which holds "
                           f"{len(steps)} checkpoint(s) of an earlier run (the newest {steps[-1].name}); the new "
                           "run's saves would mix with them. Continue that run with run.resume=true, start the new "
                           "one in another run.output_dir (run.name=...), or move "
                           f"{checkpoint.checkpoint_root(Path(cfg.run.output_dir))} away yourself")]


def memory_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """GPUs whose estimated bytes (``r3rl.memory``) exceed ``parallelism.gpu_memory_gib``, with the keys to change.
    A resumed checkpoint's load is planned in the format it was saved in (a fully reshardable one resumed under a
    layout that saves dp_reshardable still gathers its optimizer state to load)."""
    from r3rl import memory
    from r3rl.config.modes import resolve_dtype

    saved = resumed_checkpoint_format(cfg)
    device = cfg.parallelism.device
    plan = memory.estimate(cfg, resolve_dtype(cfg.trainer.params_dtype, device),
                           resolve_dtype(cfg.rollout.engine.dtype, device), saved)
    # the other format's load is what does not fit (not the run's own saves)
    resume_is_larger = saved is not None and saved != cfg.trainer.checkpoint.sharding and \
        plan.checkpoint_load_host_bytes > plan.checkpoint_save_host_bytes
    problems = []
    engine_dtype = resolve_dtype(cfg.rollout.engine.dtype, device)
    fit = memory.in_flight_kv_fit(cfg, engine_dtype, plan)
    if fit is not None and not fit.fits:
        problems.append(in_flight_kv_problem(cfg, engine_dtype, fit))
    if not memory.engine_weights_fit(cfg, plan):
        problems.append((memory.engine_memory_share_key(cfg),
                         f"{memory.engine_memory_share(cfg)} of {cfg.parallelism.gpu_memory_gib} GiB does "
                         f"not hold the engine's weights; raise it or the engines' tensor_parallel"))
    for gpu in plan.over_budget():
        parts = ", ".join(f"{role} {p.name} {p.bytes / memory.GIB:.1f}" for role, p in gpu.parts if p.bytes)
        problems.append(("parallelism.gpu_memory_gib",
                         f"out of GPU memory: a {gpu.gpu} GPU needs ~{gpu.total / memory.GIB:.1f} GiB, over the "
                         f"{cfg.parallelism.gpu_memory_gib} GiB budget ({parts} GiB); change "
                         + "; ".join(memory.fixes(cfg))))
    for host in plan.hosts_over_budget():
        parts = ", ".join(f"{role} {p.name} {p.bytes / memory.GIB:.1f}" for role, p in host.parts if p.bytes)
        problems.append(("parallelism.host_memory_gib",
                         f"out of host memory: node {host.node} needs ~{host.total / memory.GIB:.1f} GiB "
                         f"({host.pinned / memory.GIB:.1f} pinned, {host.pageable / memory.GIB:.1f} pageable), over "
                         f"the {cfg.parallelism.host_memory_gib} GiB budget per node ({parts} GiB); "
                         + (f"the checkpoint this launch resumes (run.output_dir) was saved {saved}, and loading it "
                            f"takes ~{plan.checkpoint_load_host_bytes / memory.GIB:.1f} GiB per trainer rank here "
                            "(its own saves would take "
                            f"~{plan.checkpoint_save_host_bytes / memory.GIB:.1f}): resume it under a layout with room "
                            "for that (the one that saved it), or start over in another run.output_dir"
                            if resume_is_larger else
                            "change " + "; ".join(memory.host_fixes(cfg)))))
    return problems


def in_flight_kv_problem(cfg: R3RLConfig, engine_dtype: str, fit) -> tuple[str, str]:
    """The refusal of in-flight sequences that outgrow an engine's KV cache (``memory.KvFit``, in vLLM's blocks),
    leading with the fix that works: the ``max_num_seqs`` whose longest contexts the cache holds, then a larger cache
    where one can be had (no share of a GPU covers a cache it would take more than the whole GPU to hold)."""
    from r3rl import memory

    eng = cfg.rollout.engine
    fits = fit.blocks_held // fit.blocks_per_sequence
    fixes = [f"set rollout.engine.max_num_seqs={fits} (the sequences of {fit.length} tokens the cache holds)"] \
        if fits >= 1 else []
    # the cache the blocks need, the null block included
    need_bytes = (fit.blocks_needed + 1) * fit.block_size * memory.kv_bytes_per_token(cfg, engine_dtype)
    if eng.kv_cache_memory_bytes is not None or cfg.parallelism.device == "cpu":
        key = "rollout.engine.kv_cache_memory_bytes"
        fixes.append(f"raise {key} to {need_bytes}")
    else:
        key = memory.engine_memory_share_key(cfg)
        share = memory.engine_memory_share(cfg)
        # the KV cache is what the share leaves after the weights and the runtime: add what it lacks
        wanted = share + (need_bytes - fit.kv_bytes) / (cfg.parallelism.gpu_memory_gib * memory.GIB)
        fixes.append(f"raise {key} to {wanted:.2f}" if wanted <= 0.95 else
                     f"no {key} covers it ({wanted:.2f} of a GPU would be needed)")
    fixes.append("lower " + ("algorithm.group_buffer" if cfg.algorithm.group_intake == "completion" else
                             "rollout.engine.max_concurrency"))
    return key, (f"in_flight weight updates: {fit.sequences} sequences in flight on an engine can grow to "
                 f"{fit.length} tokens each, {fit.blocks_per_sequence} KV blocks of {fit.block_size} tokens, "
                 f"{fit.blocks_needed} blocks in all, where the cache holds {fit.blocks_held} (vLLM's null block "
                 "aside): vLLM would preempt and recompute requests, and one resumed after an update is recomputed "
                 "by newer weights than the routes the trainer replays; " + "; or ".join(fixes))


def disk_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """The file system of ``run.output_dir`` must hold ``run.keep_checkpoints`` checkpoints and the one being
    written (``r3rl.memory.checkpoint_bytes``); a run that fills it dies at a save, hours in."""
    import shutil
    from pathlib import Path

    from r3rl import memory
    from r3rl.config.modes import resolve_dtype

    need = memory.checkpoint_bytes(cfg, resolve_dtype(cfg.trainer.params_dtype, cfg.parallelism.device)) \
        * (cfg.run.keep_checkpoints + 1)
    folder = Path(cfg.run.output_dir).resolve()
    while not folder.exists():
        folder = folder.parent
    checkpoints = Path(cfg.run.output_dir) / "checkpoints"
    held = sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file()) if checkpoints.is_dir() else 0
    free = shutil.disk_usage(folder).free + held  # a resumed run replaces the checkpoints it finds
    if need <= free:
        return []
    return [("run.keep_checkpoints",
             f"{cfg.run.keep_checkpoints} checkpoints and the one being written need ~{need / memory.GIB:.1f} GiB "
             f"under run.output_dir={cfg.run.output_dir}, where {free / memory.GIB:.1f} GiB are free; keep fewer, or "
             "choose another run.output_dir")]
