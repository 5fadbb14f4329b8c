"""A file the user names on the command line is theirs: never replaced by generated data or weights, never warm-started
again, and never read under the generated task's preset in silence (r3rl.config.intent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from r3rl.config import ConfigError, compose as compose_config
from r3rl.config.intent import with_named_files
from r3rl.preflight import compose, preflight

REPO = Path(__file__).resolve().parents[3]
# the README's GPU command, as a dry run on the GPU layout it plans
README_GPU = ["model=qwen3_30b", "rollout=vllm_r3", "parallelism=disaggregated_4p4",
              "model.checkpoint=/ckpt/Qwen3-30B-A3B", "data.path=/data/dapo-math-17k.jsonl"]


def test_a_prompt_file_under_the_default_arithmetic_preset_is_refused_naming_the_presets():
    """The README's GPU command once kept data=arithmetic: boxed_exact grading and 256-token prompts for DAPO-Math.
    Fails if a data.path named without data=... composes under the arithmetic preset again; the same file with its
    preset (on the command line or from an experiment) composes, graded by math-verify."""
    with pytest.raises(ConfigError) as err:
        compose_config(README_GPU)
    (key, reason), = err.value.problems
    assert key == "data.path" and "data=dapo_math" in reason and "boxed_exact" in reason
    cfg = compose_config([*README_GPU, "data=dapo_math"])
    assert cfg.data.name == "dapo_math" and cfg.reward.name == "math_verify" and not cfg.data.generate_if_missing
    cfg = compose_config(["experiment=qwen3_30b_r3_4p4", *README_GPU[3:]])
    assert cfg.data.name == "dapo_math" and cfg.reward.name == "math_verify"


def test_a_missing_prompt_file_of_the_users_own_is_refused_at_launch_and_nothing_is_generated(tmp_path):
    """``data=arithmetic data.path=<a typo>``: the preset generates its prompts, but never into a file the user
    named. Fails if the launch filled the missing path with generated arithmetic prompts (the run would train on
    them) or exited other than 2 naming data.path; an explicit data.generate_if_missing=true still generates."""
    typo = tmp_path / "my_promts.jsonl"
    out = subprocess.run([sys.executable, "run.py", "parallelism=cpu", "data=arithmetic", f"data.path={typo}",
                          "warm_start.enabled=false"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"data.path={typo}: no such file" in out.stderr and "Traceback" not in out.stderr
    assert not typo.exists()
    asked = compose(["parallelism=cpu", "data=arithmetic", f"data.path={typo}", "warm_start.enabled=false",
                     "data.generate_if_missing=true"])
    assert asked.data.generate_if_missing


def test_a_named_checkpoint_is_not_warm_started_and_the_dry_run_serves_what_the_run_serves(tmp_path):
    """SFT then GRPO (docs/sft.md): ``model.checkpoint=<sft>/hf`` on the CPU scale once ran a new 600-step warm start
    from it, and GRPO started from that export; the dry run printed the base model as the engines' --model. Fails if
    a named checkpoint keeps the warm start or random-weight generation on, or if the dry run names another
    --model than the one the recipe serves (the warm start's export when it runs, the user's checkpoint when not)."""
    assert with_named_files(["model.checkpoint=/x"])[-2:] == ["model.generate_if_missing=false",
                                                              "warm_start.enabled=false"]
    cfg = compose_config(["parallelism=cpu", "model.checkpoint=/sft/hf"])
    assert not cfg.warm_start.enabled and not cfg.model.generate_if_missing
    asked = compose_config(["parallelism=cpu", "model.checkpoint=/sft/hf", "warm_start.enabled=true"])
    assert asked.warm_start.enabled  # asked for on the same command line: honoured

    def dry(*overrides: str) -> str:
        out = subprocess.run([sys.executable, "run.py", "run.dry_run=true", f"run.data_dir={tmp_path}", *overrides],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return " ".join(out.stdout.split())

    plain = dry()
    assert "warm_start: 'runs first: 600 SFT steps" in plain
    assert f"--model {tmp_path}/warm_start/tiny_moe-" in plain
    mine = dry("model.checkpoint=/sft/hf")
    assert "warm_start: 'off: GRPO starts from model.checkpoint=/sft/hf'" in mine and "--model /sft/hf " in mine


def test_a_cached_warm_start_is_said_to_be_cached(tmp_path):
    """Fails if the dry run's warm-start line ignored the cache (it would promise a 600-step SFT that never runs)."""
    from r3rl import warm_start

    cfg = compose_config(["parallelism=cpu", f"run.data_dir={tmp_path}"])
    assert warm_start.describe(cfg).startswith("runs first")
    hf = warm_start.folder(cfg) / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (warm_start.folder(cfg) / warm_start.MARKER).write_text(warm_start.made_from(cfg))
    assert warm_start.describe(cfg) == f"cached: GRPO starts from {hf} (SFT of model.checkpoint={cfg.model.checkpoint})"


@pytest.mark.parametrize("label, said", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"),
                                         ("1e400", "inf"), ("true", "true"), ("false", "false")])
def test_labels_no_answer_can_match_are_refused_naming_file_and_line(tmp_path, label, said):
    """Python's JSON reader takes NaN, Infinity, 1e400 (as infinity) and true; every sample of that prompt would
    grade 0 and its group carry no advantage, in silence. Fails if a prompt file, an eval set or an SFT file with
    such a label passes the preflight, or if the refusal does not name the file's line."""
    good = json.dumps({"prompt": "What is 1 + 1?", "label": "2", "response": "\\boxed{2}"})
    bad = '{"prompt": "What is 2 + 2?", "label": %s, "response": "\\\\boxed{4}"}' % label
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([good] * 70 + [bad]) + "\n")
    where = f"{path}:71"
    for overrides in (["data=dapo_math", f"data.path={path}"],
                      ["eval=math500", f"eval.sets.math500.path={path}", "eval.sets.math500.prompt_key=prompt",
                       "eval.sets.math500.label_key=label", "eval.sets.math500.sampling.top_p=1.0",
                       "eval.sets.math500.sampling.max_tokens=16"],
                      ["recipe=sft", "data=arithmetic_sft", f"data.path={path}"]):
        with pytest.raises(ConfigError) as err:
            compose(["parallelism=cpu", "warm_start.enabled=false", *overrides])
        reasons = " ".join(reason for _, reason in err.value.problems)
        assert where in reasons and said in reasons, (overrides, reasons)


def test_a_folder_as_the_prompt_file_is_refused_naming_the_key(tmp_path):
    """``data.path=<a folder>`` read as JSONL raised a bare IsADirectoryError traceback. Fails if the preflight lets
    an OSError out instead of one problem naming data.path."""
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "data=arithmetic", f"data.path={tmp_path}", "warm_start.enabled=false"],
                launching=True)
    (key, reason), = err.value.problems
    assert key == "data.path" and f"{tmp_path}: a folder, not a JSONL file" in reason


def test_lora_keys_beside_rank_zero_are_refused_naming_them():
    """``trainer.lora.rank=0`` is full-parameter training; a router target, the adapter sync or dropout beside it was
    accepted and ignored. Fails if any of them passes with rank 0; rank 0 alone still passes."""
    with pytest.raises(ConfigError) as err:
        compose_config(["parallelism=cpu", "trainer.lora.targets=[attention,router]", "trainer.lora.sync=adapter",
                        "trainer.lora.dropout=0.1"])
    (key, reason), = err.value.problems
    assert key == "trainer.lora.rank" and "trainer.lora.sync=adapter" in reason and "router" in reason
    assert "trainer.lora.dropout=0.1" in reason
    assert compose_config(["parallelism=cpu", "trainer.lora.rank=0"]).trainer.lora.rank == 0


@pytest.mark.parametrize("url, why", [("http://", "no host"), ("http://127.0.0.1:99999", "not in 1-65535"),
                                      ("http://127.0.0.1 :8000", "whitespace"), ("ftp://h:1", "scheme"),
                                      ("http://h:8000/v1/generate", "after the host"), ("http://h:0", "port 0")])
def test_an_engine_url_that_cannot_be_attached_is_refused_before_launch(url, why):
    """``rollout.engine.url`` was checked by its prefix alone: these passed and failed at attach, after Ray
    started. Fails if any composes, or if a sound URL is refused."""
    with pytest.raises(ConfigError) as err:
        compose_config(["parallelism=cpu", f"rollout.engine.url='{url}'"])
    assert any(key == "rollout.engine.url" and why in reason for key, reason in err.value.problems)
    assert compose_config(["parallelism=cpu", "rollout.engine.url=http://127.0.0.1:8000"]).rollout.engine.url


def test_naming_files_is_idempotent_and_never_overrides_what_the_command_line_says():
    """Hypothesis over command lines (the outside data of run.py): the added overrides are exactly the generations a
    named file turns off, once, never one the command line sets itself, and a second pass adds nothing. Fails if
    run.py's rewrite and compose's disagreed (applied twice) or a user's own setting were overridden."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    keys = st.sampled_from(["data.path", "model.checkpoint", "eval.sets.math500.path", "data.generate_if_missing",
                            "model.generate_if_missing", "warm_start.enabled", "run.num_steps", "data"])
    override = st.builds(lambda p, k, v: f"{p}{k}={v}", st.sampled_from(["", "+", "++"]), keys,
                         st.sampled_from(["true", "x", "/p"]))

    @settings(max_examples=200, derandomize=True, database=None)
    @given(st.lists(override, max_size=6))
    def check(line):
        once = with_named_files(line)
        assert with_named_files(once) == once and once[:len(line)] == line
        named = {o.split("=", 1)[0].lstrip("+") for o in line}
        for added in once[len(line):]:
            key = added.split("=", 1)[0]
            assert added.endswith("=false") and key not in named
        expected = {off for key, offs in (("data.path", ["data.generate_if_missing"]),
                                          ("model.checkpoint", ["model.generate_if_missing", "warm_start.enabled"]),
                                          ("eval.sets.math500.path", ["eval.sets.math500.generate_if_missing"]))
                    if key in named for off in offs if off not in named}
        assert {a.split("=", 1)[0] for a in once[len(line):]} == expected

    check()
