"""The memory plan: bytes per GPU and role from the config alone, checked against the usable memory of an 80 GB
card (79.6 GiB, the shipped GPU layouts' budget)."""

from __future__ import annotations

import dataclasses

import subprocess
import sys
from pathlib import Path

import pytest

from r3rl.config import CONF_DIR, ConfigError
from r3rl.preflight import compose
from r3rl.memory import GIB, estimate, param_counts, table
from r3rl.plan import build_plan

REPO = CONF_DIR.parent

EXPERIMENTS = ("qwen3_30b_r3_4p4", "qwen3_30b_r3_colocated", "glm45_air_r3_2n", "moonlight_16b_r3_4p4")  # full-parameter


def parts(gpu) -> dict[str, float]:
    return {f"{role}/{p.name}": p.bytes / GIB for role, p in gpu.parts}


def test_30b_parameters_split_as_megatron_shards_them():
    counts = param_counts(compose(["model=qwen3_30b", "parallelism=disaggregated_4p4"]).model)
    assert 30.0e9 < counts.total < 31.0e9  # Qwen3-30B-A3B: 30.5B
    assert counts.experts / (counts.dense + counts.experts) > 0.95


def test_glm45_air_parameters_count_its_dense_layer_shared_experts_and_biases():
    """GLM-4.5-Air is published as 106B parameters (MTP layer aside); fails if the dense first layer were counted
    as MoE (~2.2B more) or the shared experts left out (~0.8B fewer). The dense layer's MLP, the shared experts and
    the qkv biases go with the tensor-parallel part."""
    model = compose(["experiment=glm45_air_r3_2n"]).model
    counts = param_counts(model)
    assert 106.0e9 < counts.total < 107.5e9
    as_moe = param_counts(dataclasses.replace(model, first_k_dense=0, ffn_hidden_size=None))
    assert as_moe.total - counts.total > 2e9
    unshared = param_counts(dataclasses.replace(model, num_shared_experts=0))
    assert counts.dense - unshared.dense == 45 * 3 * 4096 * 1408


def test_moonlight_parameters_count_multi_latent_attention():
    """Moonlight-16B-A3B is published as 16B parameters, and one of its attention layers holds, by hand: q_proj
    2048 x 16 x 192, the kv latent with the shared rope key 2048 x 576 and its norm 512, the expansion 512 x 16 x 256,
    o_proj 16 x 128 x 2048. Fails if multi-latent attention were counted as grouped-query attention over head_dim."""
    from r3rl.config.families import _attention_params

    model = compose(["experiment=moonlight_16b_r3_4p4"]).model
    assert 15.5e9 < param_counts(model).total < 16.5e9
    assert _attention_params(model) == 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048


def test_mla_caches_one_latent_per_token_and_layer_on_every_engine_gpu():
    """vLLM's MLA cache holds kv_lora_rank + qk_rope_head_dim values per token and layer, whole on every GPU of a
    tensor-parallel engine: Moonlight's bf16 token is 27 x 576 x 2 bytes. Fails if MLA were counted as
    grouped-query K and V (16 heads of head_dim 64 over TP 4: 27 x 2 x 4 x 64 x 2 bytes, 12.5% more tokens promised
    than the cache holds)."""
    from r3rl.memory import kv_bytes_per_token

    cfg = compose(["experiment=moonlight_16b_r3_4p4"])
    assert kv_bytes_per_token(cfg, "bfloat16") == 27 * 576 * 2
    qwen = compose(["experiment=qwen3_30b_r3_4p4"])  # 4 KV heads of 128 over TP 4: one head a GPU
    assert kv_bytes_per_token(qwen, "bfloat16") == 48 * 2 * 1 * 128 * 2


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_shipped_experiments_fit_an_80_gb_card(experiment):
    cfg = compose([f"experiment={experiment}"])
    plan = build_plan(cfg).memory
    # the usable memory the driver reports, not the 80 on the box: vLLM's share is a fraction of the former
    assert plan.budget_bytes == int(79.6 * GIB) and plan.over_budget() == []
    trainer_gpu = plan.gpus[0]
    p = parts(trainer_gpu)
    # offloaded: no master weights or Adam moments on the GPU, all of them in host memory
    assert p["trainer/master weights"] == 0 and p["trainer/optimizer state"] == 0
    assert plan.host_offload_bytes > 40 * GIB
    # bf16 weights and fp32 gradients of this rank's share: EP 4 holds 32 of 128 experts per layer, EP 8 holds 16;
    # GLM-4.5-Air's 106B over EP 16 (8 experts) with its dense part over TP 8
    expected_weights = {"qwen3_30b_r3_4p4": 16.4, "qwen3_30b_r3_colocated": 9.6, "glm45_air_r3_2n": 13.3,
                        "moonlight_16b_r3_4p4": 9.6}[experiment]
    assert p["trainer/weights"] == pytest.approx(expected_weights, abs=0.1)
    assert p["trainer/gradients"] == pytest.approx(2 * p["trainer/weights"], rel=1e-6)
    if experiment.endswith("colocated"):
        assert trainer_gpu.gpu == "colocated" and trainer_gpu.role_total("rollout") == pytest.approx(0.35 * 79.6 * GIB,
                                                                                                       rel=1e-6)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_without_offload_the_30b_experiments_are_refused_with_the_keys(experiment):
    with pytest.raises(ConfigError) as info:
        compose([f"experiment={experiment}", "trainer.optimizer_cpu_offload=false"])
    (key, reason), = [(k, r) for k, r in info.value.problems if k == "parallelism.gpu_memory_gib"]
    assert "out of GPU memory" in reason and "trainer.optimizer_cpu_offload=true" in reason
    assert "parallelism.trainer.expert_parallel" in reason


def test_4p4_without_offload_is_the_134_gib_of_the_evidence():
    """gpu-path.md: bf16 weights 16.4 + fp32 grads 32.7 + expert master and Adam 81 + dense share 4.3 GiB."""
    cfg = compose(["experiment=qwen3_30b_r3_4p4", "parallelism.gpu_memory_gib=null",
                   "trainer.optimizer_cpu_offload=false"])
    p = parts(build_plan(cfg).memory.gpus[0])
    state = p["trainer/master weights"] + p["trainer/optimizer state"]
    assert p["trainer/weights"] + p["trainer/gradients"] + state == pytest.approx(134, abs=1.5)


def test_recompute_and_token_budget_shrink_activations():
    base = ["model=qwen3_30b", "parallelism=disaggregated_4p4", "parallelism.gpu_memory_gib=null"]
    full = parts(estimate(compose(base), "bfloat16", "bfloat16").gpus[0])["trainer/activations"]
    none = parts(estimate(compose([*base, "trainer.recompute_granularity=null"]), "bfloat16", "bfloat16").gpus[0])
    small = parts(estimate(compose([*base, "trainer.max_tokens_per_micro_batch=8192",
                                    "rollout.engine.max_model_len=2048"]), "bfloat16", "bfloat16").gpus[0])
    assert none["trainer/activations"] > 5 * full
    assert small["trainer/activations"] == pytest.approx(2 * parts(estimate(compose(
        [*base, "trainer.max_tokens_per_micro_batch=4096", "rollout.engine.max_model_len=2048"]), "bfloat16",
        "bfloat16").gpus[0])["trainer/activations"], rel=1e-6)


def test_engine_weights_must_fit_their_share():
    with pytest.raises(ConfigError) as info:
        compose(["experiment=qwen3_30b_r3_colocated", "rollout.engine.gpu_memory_utilization=0.1"])
    assert "rollout.engine.gpu_memory_utilization" in [k for k, _ in info.value.problems]


def test_cpu_profile_prints_its_table_and_never_refuses_itself():
    cfg = compose(["parallelism=cpu"])
    plan = build_plan(cfg).memory
    assert plan.budget_bytes is None and plan.over_budget() == []
    shown = table(plan)
    assert shown["budget per GPU"] == "not checked" and "trainer GPU (x1)" in shown


def test_dry_run_prints_the_table_in_gib():
    out = subprocess.run([sys.executable, "run.py", "experiment=qwen3_30b_r3_4p4", "run.dry_run=true"],
                         capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "memory_gib_per_gpu:" in out.stdout and "trainer GPU (x4):" in out.stdout
    assert "budget per GPU: 79.6" in out.stdout
    refused = subprocess.run([sys.executable, "run.py", "experiment=qwen3_30b_r3_4p4", "run.dry_run=true",
                              "trainer.optimizer_cpu_offload=false"], capture_output=True, text=True, cwd=str(REPO),
                             timeout=120)
    assert refused.returncode != 0 and "out of GPU memory" in refused.stderr
    assert "trainer.optimizer_cpu_offload=true" in refused.stderr
    # host memory per node and the CPU share of each trainer rank (issue 23 items 3 and 5)
    assert "host_memory_gib_per_node:" in out.stdout and "budget per node: 1024.0" in out.stdout
    assert "offloaded gradients (fp32) (pinned): 113.74" in out.stdout
    assert "cpus_per_rank: 12.0" in out.stdout and "torch_threads_per_rank: 12" in out.stdout
    small = subprocess.run([sys.executable, "run.py", "experiment=qwen3_30b_r3_4p4", "run.dry_run=true",
                            "parallelism.host_memory_gib=256"], capture_output=True, text=True, cwd=str(REPO),
                           timeout=120)
    assert small.returncode != 0 and "parallelism.host_memory_gib: out of host memory: node 0" in small.stderr
    assert "trainer.optimizer_offload_fraction" in small.stderr and "parallelism.nnodes" in small.stderr
    # issue 34: the checkpoint's host and disk terms, and the GPU batch settings with their reasons
    assert "checkpoint save/load (transient) (pageable)" in out.stdout
    assert "checkpoint_disk_gib:" in out.stdout and "checkpoints on disk at once: 3" in out.stdout
    assert "batch_settings:" in out.stdout and "max_concurrency: 256" in out.stdout and "in 1 wave(s)" in out.stdout
    assert "max_tokens_per_micro_batch: 9216" in out.stdout


def host(plan, node=0) -> dict[str, tuple[float, bool]]:
    return {f"{role}/{p.name}": (p.bytes / GIB, p.pinned) for role, p in plan.hosts[node].parts}


def test_host_memory_counts_the_hybrid_optimizers_16_bytes_per_param_pinned_and_pageable():
    """Issue 23 item 3: fails if the plan goes back to 12 B/param (no pinned fp32 gradient copy), or stops summing a
    node's trainer ranks. 4+4: EP 4, expert-data parallel 1: each rank's optimizer shard is 32 of 128 experts of
    48 layers plus a quarter of the dense parameters, ~7.6 B parameters, x 16 B = ~114 GiB; four ranks per node."""
    cfg = compose(["experiment=qwen3_30b_r3_4p4"])
    plan = build_plan(cfg).memory
    per_rank = plan.host_offload_bytes / GIB
    assert per_rank == pytest.approx(113.7, abs=0.1)
    h = host(plan)
    # precision-aware: the hybrid's fp32 parameters come from .float() of a bf16 shard (pageable); the gradient
    # copy it steps from is pin_memory'd
    assert h["trainer/offloaded gradients (fp32)"] == (pytest.approx(4 * per_rank / 4), True)
    assert h["trainer/offloaded fp32 parameters"] == (pytest.approx(4 * per_rank / 4), False)
    assert h["trainer/offloaded Adam moments"] == (pytest.approx(4 * per_rank / 2), False)
    node = plan.hosts[0]
    assert len(plan.hosts) == 1 and node.total == node.pinned + node.pageable
    transient = h["trainer/checkpoint save/load (transient)"][0]
    # + 4 GiB runtime per rank and engine GPU, + a checkpoint's peak (its own test)
    assert node.total / GIB == pytest.approx(4 * per_rank + 8 * 4 + transient, abs=0.1)
    assert plan.host_budget_bytes == 1024 * GIB and plan.hosts_over_budget() == []
    # without the precision-aware optimizer the hybrid pins a copy of the fp32 main shard, which also stays on
    # the GPU (the distributed optimizer keeps it)
    plain = build_plan(compose(["experiment=qwen3_30b_r3_4p4", "trainer.precision_aware_optimizer=false",
                                "parallelism.gpu_memory_gib=null"])).memory
    assert host(plain)["trainer/offloaded fp32 parameters"][1] is True
    assert parts(plain.gpus[0])["trainer/master weights"] == pytest.approx(per_rank / 4, rel=1e-3)


def test_two_nodes_put_the_trainer_on_node_0_and_the_engines_on_node_1():
    """Fails if host memory is not split by the placement's nodes (trainer ranks first, engines after)."""
    plan = build_plan(compose(["model=qwen3_30b", "parallelism=disaggregated_2n_8p8"])).memory
    n0, n1 = host(plan, 0), host(plan, 1)
    assert "trainer/offloaded Adam moments" in n0 and not any(k.startswith("trainer/") for k in n1)
    assert plan.hosts[1].pinned == 0 and plan.hosts[1].total == 8 * 4 * GIB
    transient = n0["trainer/checkpoint save/load (transient)"][0]
    assert plan.hosts[0].total / GIB == pytest.approx(8 * plan.host_offload_bytes / GIB + 8 * 4 + transient, abs=0.1)


def test_colocated_sleep_level_1_backs_the_engine_weights_up_in_pinned_host_memory():
    """Fails if vLLM's level-1 sleep (weights copied to pinned host memory) is not counted on colocated nodes."""
    two = build_plan(compose(["experiment=qwen3_30b_r3_colocated"])).memory
    one = build_plan(compose(["experiment=qwen3_30b_r3_colocated", "rollout.weight_sync.sleep_level=1"])).memory
    weights = parts(one.gpus[0])["rollout/engine weights"]
    assert host(one)["rollout/engine weights (sleep level 1 backup)"] == (pytest.approx(8 * weights), True)
    assert (one.hosts[0].pinned - two.hosts[0].pinned) / GIB == pytest.approx(8 * weights)


def test_a_node_over_its_host_memory_is_refused_naming_the_keys():
    with pytest.raises(ConfigError) as info:
        compose(["experiment=qwen3_30b_r3_colocated", "parallelism.host_memory_gib=400",
                 "rollout.weight_sync.sleep_level=1"])
    (reason,) = [r for k, r in info.value.problems if k == "parallelism.host_memory_gib"]
    assert "out of host memory" in reason and "pinned" in reason and "pageable" in reason
    assert "rollout.weight_sync.sleep_level=2" in reason and "trainer.optimizer_offload_fraction" in reason


GPU_LAYOUTS = sorted(p.stem for p in (CONF_DIR / "parallelism").glob("*.yaml"))


@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_every_shipped_parallelism_fits_qwen3_30b_without_overrides(layout):
    """Issue 23 item 10: fails if a shipped GPU layout does not carry an engine share (and host budget) that fits,
    e.g. colocated with the 0.85 share of an engine that owns its GPU (~106.5 GiB per GPU). The CPU layouts refuse
    the 30B model for its size only, never for memory."""
    overrides = ["model=qwen3_30b", "rollout=vllm_r3", f"parallelism={layout}"]
    if layout.startswith("cpu"):
        with pytest.raises(ConfigError) as info:
            compose(overrides)
        assert [k for k, _ in info.value.problems] == ["parallelism"]
        return
    cfg = compose(overrides)
    plan = build_plan(cfg).memory
    assert plan.budget_bytes is not None and plan.over_budget() == []
    assert plan.host_budget_bytes is not None and plan.hosts_over_budget() == []
    if cfg.parallelism.colocated:
        assert cfg.parallelism.rollout.gpu_memory_utilization < 0.5


def local_params(cfg) -> float:
    """Parameters one trainer rank of a TP 1 / PP 1 layout holds: every dense one, its share of the experts."""
    counts = param_counts(cfg.model)
    return counts.dense + counts.embeddings + counts.experts / cfg.parallelism.trainer.expert_parallel


def test_checkpoint_host_memory_and_disk_follow_the_optimizer_format():
    """Issue 34 item 1, issue 45 item 2: fails if the plan forgets the fully reshardable gather (12 B per local
    parameter: float32 parameter and both Adam moments of the rank's model-parallel part, on every rank at load) or
    the bf16 weights the writer stages from the GPU (2 B), if dp_reshardable is charged for a gather it does not do
    (or, saved in the background, not for the offloaded state its forked writer shares copy-on-write), if a load
    forgets the hybrid optimizer's rebuilt copies of its offloaded parameters (a pinned bf16 copy and its float32
    ``.float()``: 6 B each precision-aware, 4 B otherwise), if the disk term is not every parameter at 2 + 12 B
    times run.keep_checkpoints + 1, or if a node that cannot hold the gather is let through without naming
    trainer.checkpoint.sharding."""
    full = ["experiment=qwen3_30b_r3_4p4", "trainer.checkpoint.sharding=fully_reshardable"]
    cfg = compose([*full, "parallelism.host_memory_gib=null"])
    plan = build_plan(cfg).memory
    local = local_params(cfg)
    shard = plan.host_offload_bytes / 16  # offloaded parameters per rank (16 B each)
    assert plan.checkpoint_save_host_bytes == pytest.approx(local * (12 + 2), rel=1e-6)
    assert plan.checkpoint_load_host_bytes == pytest.approx(local * (12 + 2) + shard * 6, rel=1e-6)
    assert host(plan)["trainer/checkpoint save/load (transient)"][0] == \
        pytest.approx(4 * plan.checkpoint_load_host_bytes / GIB, rel=1e-6)
    # the shipped 4+4 saves dp_reshardable: the optimizer state is offloaded already, only the GPU's weights are
    # staged; its load still rebuilds the hybrid optimizer's copies
    flat = build_plan(compose(["experiment=qwen3_30b_r3_4p4"])).memory
    assert flat.checkpoint_save_host_bytes == pytest.approx(local * 2, rel=1e-6)
    assert flat.checkpoint_load_host_bytes == pytest.approx(local * 2 + shard * 6, rel=1e-6)
    plain = build_plan(compose(["experiment=qwen3_30b_r3_4p4", "trainer.precision_aware_optimizer=false",
                                "parallelism.gpu_memory_gib=null"])).memory
    assert plain.checkpoint_load_host_bytes == pytest.approx(local * 2 + shard * 4, rel=1e-6)
    # in the background, the forked writer's view of the offloaded state is copied as the next steps write it
    behind = build_plan(compose(["experiment=qwen3_30b_r3_4p4", "trainer.checkpoint.async_save=true"])).memory
    assert behind.checkpoint_save_host_bytes == pytest.approx(local * 2 + shard * 12, rel=1e-6)
    assert host(behind)["trainer/checkpoint save/load (transient)"][0] == \
        pytest.approx(4 * max(local * 2 + shard * 12, local * 2 + shard * 6) / GIB, rel=1e-6)
    assert plan.checkpoint_bytes == int(param_counts(cfg.model).total * 14)
    assert plan.checkpoints_on_disk == cfg.run.keep_checkpoints + 1 == 3
    assert build_plan(compose(["experiment=qwen3_30b_r3_4p4", "run.keep_checkpoints=5"])).memory \
        .checkpoint_disk_bytes == 6 * plan.checkpoint_bytes
    # the shipped 1 TiB node cannot hold a fully reshardable load: refused naming the format; its own format fits
    with pytest.raises(ConfigError) as info:
        compose(full)
    (reason,) = [r for k, r in info.value.problems if k == "parallelism.host_memory_gib"]
    assert "checkpoint save/load (transient)" in reason and "trainer.checkpoint.sharding=dp_reshardable" in reason


def test_launch_refuses_a_disk_that_cannot_hold_the_checkpoints_kept(tmp_path):
    """Fails if the launch checks stop comparing the free disk under run.output_dir with the checkpoints the run
    keeps (a run that fills its disk dies at a save, hours in)."""
    from r3rl.config import compose as compose_config
    from r3rl.preflight import disk_problems

    cfg = compose_config(["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path / 'run'}"])
    assert disk_problems(cfg) == []
    greedy = compose_config(["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path / 'run'}",
                             "run.keep_checkpoints=100000000"])
    ((key, reason),) = disk_problems(greedy)
    assert key == "run.keep_checkpoints" and "GiB are free" in reason and str(tmp_path / "run") in reason


def fully_reshardable_checkpoint(run_dir: Path) -> Path:
    """``run_dir`` holding a step-20 checkpoint whose trainer state says it was saved fully_reshardable."""
    from r3rl import checkpoint as ckpt

    folder = ckpt.begin(run_dir, 20)
    (folder / ckpt.TRAINER_DIR).mkdir()
    (folder / ckpt.TRAINER_DIR / ckpt.COMPLETE).write_text(
        '{"format": "%s", "optimizer_format": "fully_reshardable"}' % ckpt.TRAINER_FORMAT)
    ckpt.publish(run_dir, folder, ckpt.CheckpointMeta(step=20))
    return run_dir


def test_a_resumed_fully_reshardable_checkpoint_is_planned_as_its_load_gathers(tmp_path):
    """A 4+4 checkpoint (fully_reshardable) resumed colocated, whose own saves are dp_reshardable: the load still
    gathers each rank's float32 optimizer state, which eight ranks on a 1 TiB node cannot hold; the launch says so
    instead of planning the colocated layout's own format. Fails if the preflight stops reading the checkpoint it
    would resume, or plans it in the run's format."""
    run_dir = fully_reshardable_checkpoint(tmp_path / "run")
    colocated = ["experiment=qwen3_30b_r3_colocated", f"run.output_dir={run_dir}"]
    with pytest.raises(ConfigError) as info:
        compose(colocated)
    (reason,) = [r for k, r in info.value.problems if k == "parallelism.host_memory_gib"]
    assert "saved fully_reshardable" in reason and "another run.output_dir" in reason
    compose([*colocated, f"run.output_dir={tmp_path / 'fresh'}"])  # a fresh start plans its own format, which fits


def test_the_dry_run_of_a_cross_format_resume_shows_the_load_of_the_format_it_reads(tmp_path, capsys):
    """Issue 45 item 2: the shipped 4+4 saves dp_reshardable; resuming a fully_reshardable checkpoint of another
    layout loads that format. The dry run's checkpoint block shows the save in the run's format and the load in the
    checkpoint's (gather + staging + the hybrid optimizer's rebuilt copies), and the node's host table counts the
    load; on the 1 TiB node that load is refused with the per-rank figure, on a 2 TiB one it plans. Fails if the
    dry run sizes the load by ``trainer.checkpoint.sharding`` (the run's own saves) instead of the checkpoint it
    resumes."""
    import yaml

    from r3rl.config import compose as compose_config
    from r3rl.launch import dry_run

    run_dir = fully_reshardable_checkpoint(tmp_path / "run")
    overrides = ["experiment=qwen3_30b_r3_4p4", f"run.output_dir={run_dir}", "run.dry_run=true"]
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    (reason,) = [r for k, r in info.value.problems if k == "parallelism.host_memory_gib"]
    assert "saved fully_reshardable" in reason and "GiB per trainer rank" in reason

    cfg = compose([*overrides, "parallelism.host_memory_gib=2048"])
    dry_run(cfg)
    out = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])
    block = out["checkpoint_host_gib_per_rank"]
    local = local_params(cfg)
    fresh = build_plan(compose_config(["experiment=qwen3_30b_r3_4p4"])).memory
    shard = fresh.host_offload_bytes / 16
    assert block["save (dp_reshardable)"] == pytest.approx(local * 2 / GIB, abs=0.01)
    load = block["load (fully_reshardable, the checkpoint this launch resumes)"]
    assert load == pytest.approx((local * 14 + shard * 6) / GIB, abs=0.01)
    node = out["host_memory_gib_per_node"]["node 0"]["trainer"]
    assert node["checkpoint save/load (transient) (pageable)"] == pytest.approx(4 * load, abs=0.05)
    # without a checkpoint to resume the same layout plans its own format's load
    assert "load (dp_reshardable)" in memory_block(compose_config(["experiment=qwen3_30b_r3_4p4"]))


def memory_block(cfg) -> dict:
    from r3rl.memory import checkpoint_host_table

    return checkpoint_host_table(cfg, build_plan(cfg).memory)


IN_FLIGHT = ["parallelism=cpu", "algorithm.max_staleness=1", "correction=tis", "algorithm.weight_update=in_flight"]


@pytest.mark.parametrize("intake", [[], ["algorithm.group_intake=completion"]], ids=["batch", "completion"])
def test_in_flight_settings_whose_sequences_outgrow_the_kv_cache_are_refused_naming_the_key(intake):
    """vLLM preempts and recomputes running requests when its KV cache runs short, and a request preempted before an
    in-flight update and resumed after it is recomputed by the new weights while the trainer replays its first
    forward's rows. The CPU default fits (256 running sequences of <= 144 tokens, two blocks of 128 each, in 767
    blocks of 96 MiB, 1 KiB a token of the tiny bf16 model); 8 MiB does not. Fails if the plan ignored the in-flight
    sequences (the 8 MiB config would pass and preempt), named no key, or refused the default."""
    from r3rl import memory
    from r3rl.config.modes import resolve_dtype

    cfg = compose([*IN_FLIGHT, *intake])
    assert memory.kv_bytes_per_token(cfg, "bfloat16") == 4 * 2 * 2 * 32 * 2
    assert memory.in_flight_sequences(cfg) == 256
    fit = memory.in_flight_kv_fit(cfg, "bfloat16", build_plan(cfg).memory)
    assert (fit.block_size, fit.blocks_per_sequence, fit.blocks_needed, fit.blocks_held) == (128, 2, 512, 767)
    assert resolve_dtype(cfg.rollout.engine.dtype, "cpu") == "bfloat16"
    with pytest.raises(ConfigError) as info:
        compose([*IN_FLIGHT, *intake, "rollout.engine.kv_cache_memory_bytes=8388608"])
    (key, reason), = info.value.problems
    assert key == "rollout.engine.kv_cache_memory_bytes" and "256 sequences" in reason and "512 blocks" in reason
    assert ("algorithm.group_buffer" if intake else "rollout.engine.max_concurrency") in reason
    # between batches nothing is recomputed under other weights: the same KV cache is no problem there
    compose(["parallelism=cpu", "rollout.engine.kv_cache_memory_bytes=8388608"])


def test_the_kv_fit_counts_vllm_blocks_and_its_null_block():
    """vLLM allocates whole blocks and keeps one aside: 64 MiB is 65,536 tokens of the tiny model, room for 455
    sequences of 144 tokens counted in tokens, but 256 sequences take 2 blocks of 128 each, 512 blocks, and the cache
    holds 511 once the null block is aside: refused (what the CPU default was before its cache grew to 96 MiB). A
    --block-size of 16 in the engine's extra_args packs them into 9 blocks each, 2,304 of 4,095: accepted. Fails if
    the fit went back to tokens (it would pass at 64 MiB), forgot the null block (512 of 512 would pass), or ignored
    the engine's own --block-size."""
    from r3rl import memory

    at_64 = [*IN_FLIGHT, "rollout.engine.kv_cache_memory_bytes=67108864"]
    cfg = compose(["parallelism=cpu", "algorithm.max_staleness=1", "correction=tis",
                   "rollout.engine.kv_cache_memory_bytes=67108864"])
    tokens = 67108864 // memory.kv_bytes_per_token(cfg, "bfloat16")
    assert tokens == 65536 and 256 * 144 < tokens
    with pytest.raises(ConfigError, match="512 blocks in all, where the cache holds 511") as info:
        compose(at_64)
    assert "rollout.engine.max_num_seqs=255" in str(info.value)
    sixteen = compose([*at_64, "rollout.engine.extra_args=[--block-size,16]"])
    fit = memory.in_flight_kv_fit(sixteen, "bfloat16", build_plan(sixteen).memory)
    assert (fit.block_size, fit.blocks_per_sequence, fit.blocks_needed, fit.blocks_held) == (16, 9, 2304, 4095)


def test_on_gpus_the_kv_cache_is_the_share_less_weights_and_runtime():
    """On a GPU the engine's share holds its weights, its runtime (CUDA graphs, the profiled activations, NCCL) and the
    KV cache in what is left: the in-flight check compares with the cache alone. Fails if the plan counted the
    runtime as KV cache (the check would pass sequences vLLM cannot hold) or left the runtime out of the share."""
    from r3rl import memory

    cfg = compose(["experiment=qwen3_30b_r3_4p4"])
    plan = build_plan(cfg).memory
    rollout = {p.name: p.bytes for g in plan.gpus for role, p in g.parts if role == "rollout"}
    share = int(memory.engine_memory_share(cfg) * plan.budget_bytes)
    assert rollout["engine runtime"] == memory.ENGINE_RUNTIME_BYTES
    assert rollout["engine KV cache"] == share - rollout["engine weights"] - memory.ENGINE_RUNTIME_BYTES
    assert memory.engine_kv_bytes(plan) == rollout["engine KV cache"]


def test_an_in_flight_run_whose_kv_cache_is_not_planned_says_it_is_unchecked():
    """Without a GPU budget (or with an attached engine) the plan cannot size the KV cache, so the in-flight fit is
    not checked: the launch says so, naming the key, instead of passing in silence. Fails if an unplanned cache read as
    checked (no warning), or a planned one warned."""
    from r3rl import memory

    gpu = ["experiment=qwen3_30b_r3_4p4", "algorithm.max_staleness=1", "correction=tis",
           "algorithm.weight_update=in_flight"]
    unset = compose([*gpu, "parallelism.gpu_memory_gib=null"])
    assert "parallelism.gpu_memory_gib is unset" in memory.kv_cache_unplanned(unset, build_plan(unset).memory)
    planned = compose(IN_FLIGHT)
    assert memory.kv_cache_unplanned(planned, build_plan(planned).memory) is None


def test_lora_on_one_node_fits_and_the_plan_shows_what_it_saves():
    """``experiment=qwen3_30b_r3_lora_colocated``: the frozen bf16 base and, beside it, rank-32 adapters on
    attention and every expert; only the adapters have fp32 gradients, masters and Adam state, all on the GPU (no
    offload). Against the full-parameter colocated layout of the same node: the same base weights, gradients 30x
    smaller, no host-offloaded optimizer, a checkpoint of the adapters alone. Fails if the plan gave the frozen base
    gradients or optimizer state (the layout would be refused as out of memory), or counted the adapters nowhere."""
    from r3rl.config.lora import adapter_counts
    from r3rl.memory import checkpoint_bytes

    lora, full = (compose([f"experiment={e}"]) for e in ("qwen3_30b_r3_lora_colocated", "qwen3_30b_r3_colocated"))
    plan, base = build_plan(lora).memory, build_plan(full).memory
    assert plan.over_budget() == [] and plan.host_offload_bytes == 0
    p, q = parts(plan.gpus[0]), parts(base.gpus[0])
    dense, experts = adapter_counts(lora.model, lora.trainer.lora)
    per_rank = dense + experts / 8  # attention adapters on every rank, each rank's 16 experts' adapters
    assert p["trainer/gradients"] == pytest.approx(per_rank * 4 / GIB, rel=1e-3)
    assert p["trainer/weights"] == pytest.approx(q["trainer/weights"] + per_rank * 2 / GIB, rel=1e-3)
    assert q["trainer/gradients"] / p["trainer/gradients"] > 25
    # the distributed optimizer shards the attention adapters' state over the 8 data-parallel ranks
    assert p["trainer/optimizer state"] == pytest.approx((dense + experts) / 8 * 8 / GIB, rel=1e-3)
    # the adapters alone, in bf16 with their fp32 master and moments; the base is the HF checkpoint
    assert checkpoint_bytes(lora, "bfloat16") == (dense + experts) * (2 + 12)
    assert checkpoint_bytes(full, "bfloat16") / checkpoint_bytes(lora, "bfloat16") > 20
    # rank 32 on 48 layers: 128 experts x (32 x (2048 + 1536) + 32 x (768 + 2048)) each, and q, k, v, o
    assert experts == 48 * 128 * 32 * (2048 + 1536 + 768 + 2048)
    assert dense == 48 * 32 * ((2048 + 4096 + 2 * 512) + (4096 + 2048))
