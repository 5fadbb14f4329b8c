"""The recipe choice (recipe=grpo|sft) and the SFT keys: GRPO stays the default, every problem names its key."""

from __future__ import annotations

import json

import pytest
from hydra.errors import HydraException

from r3rl.config import ConfigError
from r3rl.preflight import compose


def problem_keys(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose(["parallelism=cpu", *overrides])
    return [key for key, _ in info.value.problems]


def test_grpo_stays_the_default_and_its_run_name_is_unchanged():
    """Fails if adding the recipe group changed what `python run.py` composes (its run folder, W&B name, data)."""
    cfg = compose(["parallelism=cpu"])
    assert cfg.recipe.name == "grpo"
    assert cfg.run.name == "tiny_moe-cpu-vllm_r3" and cfg.data.name == "arithmetic"
    assert compose(["parallelism=cpu", "recipe=grpo"]).run.name == cfg.run.name


def test_sft_picks_its_data_run_folder_and_export_folder():
    """Fails if recipe=sft stops defaulting to the arithmetic solutions, shares GRPO's run folder (it would resume
    from GRPO's checkpoints), or loses the export folder under the run folder; data=... on the command line wins."""
    cfg = compose(["parallelism=cpu", "recipe=sft"])
    assert cfg.recipe.name == "sft" and cfg.data.name == "arithmetic_sft"
    assert cfg.run.name == "tiny_moe-cpu-vllm_r3-sft"
    assert cfg.sft.export_dir == f"outputs/{cfg.run.name}/hf"
    assert cfg.sft.batch_size == 16  # scale/cpu.yaml

def test_data_on_the_command_line_wins_and_a_prompt_file_without_responses_is_refused(tmp_path):
    """Fails if recipe=sft overrides the user's data=..., or accepts GRPO's prompt file (no responses) only to fail
    after every process started."""
    from r3rl.data.arithmetic import ensure_prompts

    cfg = compose(["parallelism=cpu", "data=arithmetic", f"data.path={tmp_path / 'prompts.jsonl'}",
                   "data.generate_if_missing=true"])
    ensure_prompts(cfg.data)
    assert problem_keys(["recipe=sft", "data=arithmetic", f"data.path={cfg.data.path}"]) == ["data.path"]
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text(json.dumps({"prompt": "What is 2 + 2?", "response": "2 + 2 = \\boxed{4}"}) + "\n")
    assert compose(["parallelism=cpu", "recipe=sft", "data=dapo_math", f"data.path={sft_file}"]).data.name == \
        "dapo_math"


def test_a_recipe_typo_is_refused_naming_the_key():
    """Fails if an unknown recipe name is accepted (run.py would launch GRPO for `recipe.name=sfx`)."""
    assert problem_keys(["recipe.name=sfx"]) == ["recipe"]
    with pytest.raises(HydraException, match="recipe"):
        compose(["parallelism=cpu", "recipe=sfx"])
    assert problem_keys(["+sft.batch_sise=4"]) == ["sft.batch_sise"]


@pytest.mark.parametrize("overrides", [["sft.batch_size=0"], ["sft.batch_size=6", "trainer.micro_batch_size=4"]])
def test_sft_batch_size_must_split_into_micro_batches(overrides):
    """Fails if recipe=sft accepts a batch that does not split into whole micro batches per data-parallel rank."""
    assert problem_keys(["recipe=sft", *overrides]) == ["sft.batch_size"]


def test_sft_keys_are_not_checked_for_grpo():
    """Fails if GRPO runs are refused for SFT settings they never use."""
    compose(["parallelism=cpu", "sft.batch_size=6", "trainer.micro_batch_size=4", "algorithm.global_batch_size=8"])


@pytest.mark.parametrize("record, where", [
    ({"prompt": "What is 1 + 1?"}, "no key 'response'"),
    ({"prompt": "What is 1 + 1?", "response": ""}, "non-empty string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "role 'assistant'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}, "role 'assistant'"),
    ("not json", "not valid JSON"),
])
def test_a_bad_sft_record_fails_before_launch_naming_file_and_line(tmp_path, record, where):
    """Fails if a malformed SFT file gets past validation (it would fail only after Ray, trainer and engines
    started), or if the message stops naming data.path, the file and the line."""
    path = tmp_path / "sft.jsonl"
    good = {"prompt": "What is 2 + 2?", "response": "2 + 2 = \\boxed{4}"}
    path.write_text(json.dumps(good) + "\n" + (record if isinstance(record, str) else json.dumps(record)) + "\n")
    with pytest.raises(ConfigError) as info:
        compose(["parallelism=cpu", "recipe=sft", f"data.path={path}"])
    ((key, reason),) = info.value.problems
    assert key == "data.path" and f"{path}:2" in reason and where in reason


def test_sft_accepts_prompt_response_and_chat_records(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": "What is 2 + 2?", "response": "2 + 2 = \\boxed{4}"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"},
                          {"role": "assistant", "content": "1 + 2 = \\boxed{3}"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(["parallelism=cpu", "recipe=sft", f"data.path={path}", "data.generate_if_missing=false"])
    assert cfg.data.path == str(path)


def test_a_missing_sft_file_that_is_not_generated_is_refused(tmp_path):
    assert problem_keys(["recipe=sft", f"data.path={tmp_path / 'none.jsonl'}",
                         "data.generate_if_missing=false"]) == ["data.path"]


def test_a_foreign_checkpoint_of_another_shape_is_refused_naming_model_checkpoint(tmp_path, tiny_model_dir):
    """Fails if model.checkpoint=<folder> (an SFT export, a downloaded model) is accepted for a model config of
    another shape, or if a copy of the right shape is refused; r3rl's own generated folder stays exempt (it is
    regenerated when the shape changes)."""
    import shutil

    folder = tmp_path / "export"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    # a run folder of its own: the default one may hold a developer's finished run of another shape
    run = f"run.output_dir={tmp_path / 'run'}"
    compose(["parallelism=cpu", run, f"model.checkpoint={folder}"])  # the tiny model's shape: accepted
    with pytest.raises(ConfigError) as info:
        compose(["parallelism=cpu", run, f"model.checkpoint={folder}", "model.num_layers=2"])
    ((key, reason),) = info.value.problems
    assert key == "model.checkpoint" and "num_hidden_layers=4 but model.num_layers=2" in reason
    # named on the command line it is the user's, unless generation is asked for with it (r3rl.config.intent)
    compose(["parallelism=cpu", run, f"model.checkpoint={tiny_model_dir}", "model.num_layers=2",
             "model.generate_if_missing=true"])


def test_a_checkpoint_of_another_family_or_with_dense_layers_is_refused_before_launch(tmp_path, tiny_model_dir):
    """r3rl builds every decoder layer as a Qwen3-MoE layer. Fails if a checkpoint whose config declares a dense MLP
    layer (Qwen's mlp_only_layers; GLM's and DeepSeek's first_k_dense_replace) or another model_type were accepted:
    Megatron would build a router where the checkpoint has none, and every route after it would be replayed one
    layer off (verl #5037), or another family's fields would go unread; or if a checkpoint whose routing weights'
    normalisation, RoPE base or norm epsilon differ from the model config's passed (vLLM would serve the checkpoint's,
    Megatron train the config's: a mismatch replay cannot remove). Also fails if a typo of model.architecture
    passed."""
    import json

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    run = f"run.output_dir={tmp_path / 'run'}"

    def refused(name: str, **fields) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**hf, **fields}))
        with pytest.raises(ConfigError) as info:
            compose(["parallelism=cpu", run, f"model.checkpoint={folder}"])
        ((key, reason),) = info.value.problems
        assert key == "model.checkpoint"
        return reason

    assert "decoder layers [0] have a dense MLP" in refused("dense_first", mlp_only_layers=[0])
    assert "decoder layers [0, 2] have a dense MLP" in refused("sparse_step", decoder_sparse_step=2)
    assert "model_type='glm4_moe'" in refused("glm", model_type="glm4_moe", first_k_dense_replace=1)
    # what vLLM reads from the checkpoint and Megatron from the model config must agree too
    assert "norm_topk_prob=False but model.norm_topk_prob=True" in refused("no_norm", norm_topk_prob=False)
    assert "rope_theta=10000.0 but model.rope_theta=1000000.0" in refused(
        "rope", rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert "rms_norm_eps=1e-05" in refused("eps", rms_norm_eps=1e-5)
    with pytest.raises(ConfigError) as info:
        compose(["parallelism=cpu", run, "model.architecture=qwen3moe"])
    assert [key for key, _ in info.value.problems] == ["model.architecture"]
