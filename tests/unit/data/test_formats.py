"""Prompt data in JSONL, verl's parquet layout and an HF ``datasets`` save_to_disk folder (``data.format``): the same
problems load to the same prompts and labels, and a bad file, a missing column or an empty label fails at validation
naming the file, the row and the key. Every fixture is written here; nothing is downloaded."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path

import pytest

from r3rl.config import ConfigError
from r3rl.preflight import compose
from r3rl.config.schema import DataConfig
from r3rl.data.dataset import DataError, PromptDataset, read_prompt_rows
from r3rl.data.formats import detect_format
from r3rl.data.sft import prompt_texts

GT = "reward_model.ground_truth"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# verl's layout (examples/data_preprocess/*.py): data_source, prompt as chat messages, ability, reward_model struct
# holding ground_truth, extra_info; one problem with a system turn, so the message structs differ in length
PROBLEMS = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": f"Tom has 3 apples and buys 4 more. How many now? {INSTRUCTION}"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"split": "train", "index": 0}},
    {"data_source": "DigitalLearningGmbH/MATH-lighteval",
     "prompt": [{"role": "system", "content": "You are a careful mathematician."},
                {"role": "user", "content": f"Simplify $\\frac{{6}}{{8}}$. {INSTRUCTION}"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"},
     "extra_info": {"split": "train", "index": 1}},
    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": f"Find the sum of the roots of $x^2 - 5x + 6 = 0$. {INSTRUCTION}"}],
     "ability": "MATH", "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 2}},
]
EXPECTED = [(p["prompt"], p["reward_model"]["ground_truth"]) for p in PROBLEMS]
FORMATS = ("jsonl", "parquet", "hf_disk")
# a step of 2 prompts: the fixtures hold 3 problems, fewer than a data config's batch (refused before launch)
STEP = ("algorithm.rollout_batch_size=2", "algorithm.global_batch_size=8", "algorithm.n_samples_per_prompt=4")


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(rows: list[dict], path: Path, **kwargs) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def write_hf_disk(rows: list[dict], path: Path) -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def write(fmt: str, rows: list[dict], folder: Path, stem: str = "train") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        return write_jsonl(rows, folder / f"{stem}.jsonl")
    if fmt == "parquet":
        return write_parquet(rows, folder / f"{stem}.parquet")
    return write_hf_disk(rows, folder / stem)


def where(fmt: str, path: Path, row: int) -> str:
    """How an error names a record: JSONL lines count from 1, table rows from 0 (as ``datasets`` indexes them)."""
    return f"{path}:{row + 1}" if fmt == "jsonl" else f"{path} row {row}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    return {fmt: write(fmt, PROBLEMS, tmp_path / fmt) for fmt in FORMATS}


def test_the_three_formats_load_the_same_prompts_and_labels(files, tiny_cfg, tokenizer):
    """The fixture problems in JSONL, verl's parquet (nested reward_model struct, chat prompt) and a save_to_disk
    folder read, detected from the path, to identical (prompt, label) rows and tokenise to identical prompts. Fails if
    detection picked the wrong reader or a dotted key did not reach into the struct."""
    for fmt, path in files.items():
        assert detect_format(path) == fmt
        rows = read_prompt_rows(path, "prompt", GT)
        assert [(prompt, label) for _, prompt, label in rows] == EXPECTED, fmt
    loaded = {}
    for fmt, path in files.items():
        cfg = dataclasses.replace(tiny_cfg.data, path=str(path), format="auto", label_key=GT, shuffle=False)
        loaded[fmt] = [(p.text, p.prompt_ids.tolist(), p.label) for p in PromptDataset(cfg, tokenizer).prompts]
    assert loaded["parquet"] == loaded["jsonl"] == loaded["hf_disk"]
    assert [label for _, _, label in loaded["jsonl"]] == ["7", "\\frac{3}{4}", "5"]
    assert "You are a careful mathematician." in loaded["parquet"][1][0]  # the system turn is rendered


def test_a_message_field_only_some_rows_have_reads_as_in_jsonl(tmp_path):
    """One message carries a ``name``: a table's struct type gives every other message ``name: null``, which must
    not reach the chat template. Fails if a table's null struct fields were kept (its prompts would differ from the
    JSONL's)."""
    rows = copy.deepcopy(PROBLEMS)
    rows[1]["prompt"][0]["name"] = "tutor"
    by_format = {fmt: [(p, lab) for _, p, lab in read_prompt_rows(write(fmt, rows, tmp_path / fmt), "prompt", GT)]
                 for fmt in FORMATS}
    assert by_format["parquet"] == by_format["hf_disk"] == by_format["jsonl"]
    assert by_format["jsonl"][1][0][0] == {"role": "system", "content": "You are a careful mathematician.",
                                            "name": "tutor"}


def test_an_explicit_format_wins_and_an_unsuffixed_parquet_file_is_recognised(files, tmp_path):
    """Fails if data.format were ignored (a parquet file forced to jsonl must read as JSON and fail), or if a file
    without a telling suffix were not sniffed by parquet's magic bytes."""
    bare = tmp_path / "train.data"
    bare.write_bytes(files["parquet"].read_bytes())
    assert detect_format(bare) == "parquet"
    assert [(p, lab) for _, p, lab in read_prompt_rows(bare, "prompt", GT)] == EXPECTED
    with pytest.raises((DataError, UnicodeDecodeError)):
        read_prompt_rows(files["parquet"], "prompt", GT, fmt="jsonl")
    with pytest.raises(DataError, match="data.format=csv: must be one of"):
        read_prompt_rows(files["parquet"], "prompt", GT, fmt="csv")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gsm8k_config_composes_and_validates_each_format(fmt, files):
    """data=gsm8k with data.path at each fixture validates and keeps verl's keys; its prompts are what the eval sets
    are checked against. Fails if gsm8k.yaml lost label_key=reward_model.ground_truth or validation read a table as
    JSONL."""
    cfg = compose(["parallelism=cpu", "data=gsm8k", f"data.path={files[fmt]}", *STEP])
    assert (cfg.data.format, cfg.data.prompt_key, cfg.data.label_key) == ("auto", "prompt", GT)
    assert prompt_texts(cfg.data) == {m["content"] for p, _ in EXPECTED for m in p if m["role"] == "user"}


def test_dapo_math_and_math_configs_take_a_verl_parquet_path(files):
    """data=math reads verl's parquet as shipped; data=dapo_math with the label key set does too. Fails if either
    config refused a parquet path."""
    assert compose(["parallelism=cpu", "data=math", f"data.path={files['parquet']}", *STEP]).data.name == "math"
    cfg = compose(["parallelism=cpu", "data=dapo_math", f"data.path={files['parquet']}", f"data.label_key={GT}",
                   *STEP])
    assert cfg.data.name == "dapo_math"


def _problem(err: pytest.ExceptionInfo) -> str:
    problems = dict(err.value.problems)
    assert "data.path" in problems, err.value
    return problems["data.path"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_column_fails_validation_naming_file_row_and_key(fmt, tmp_path):
    """Without the reward_model column (or, in the struct, without ground_truth) validation fails before launch with
    data.path, the file, the row and data.label_key. Fails if GRPO prompt files were not read at validation, or the
    message lost any of them."""
    rows = [{k: v for k, v in p.items() if k != "reward_model"} for p in PROBLEMS]
    path = write(fmt, rows, tmp_path / "no_column")
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "data=gsm8k", f"data.path={path}"])
    assert f"{where(fmt, path, 0)}: no key '{GT}' (data.label_key={GT})" in _problem(err)

    rows = copy.deepcopy(PROBLEMS)
    for r in rows:
        r["reward_model"] = {"style": "rule", "answer": r["reward_model"]["ground_truth"]}
    path = write(fmt, rows, tmp_path / "no_field")
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "data=gsm8k", f"data.path={path}"])
    assert f"{where(fmt, path, 0)}: no key '{GT}' (data.label_key={GT})" in _problem(err)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_label_fails_validation_naming_file_row_and_key(fmt, tmp_path):
    """The third problem's ground truth is empty: validation names its line or row and data.label_key. Fails if an
    empty label were accepted (every response would score 0 against it, silently)."""
    rows = copy.deepcopy(PROBLEMS)
    rows[2]["reward_model"]["ground_truth"] = " "
    path = write(fmt, rows, tmp_path / "empty")
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "data=gsm8k", f"data.path={path}"])
    assert f"{where(fmt, path, 2)}: '{GT}' is empty (data.label_key={GT})" in _problem(err)


def test_a_corrupt_parquet_file_fails_validation_naming_file_rows_and_key(tmp_path):
    """A file that is not parquet at all, and one whose second row group is damaged, fail at validation: the first
    names the file and data.format, the second the file and the rows of the damaged group. Fails if pyarrow's error
    escaped as a crash at load time instead."""
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "data=gsm8k", f"data.path={bad}"])
    assert f"{bad}: not a readable parquet file" in _problem(err) and "data.format" in _problem(err)

    import pyarrow.parquet as pq

    good = write_parquet(PROBLEMS * 2, tmp_path / "good.parquet", row_group_size=2, compression="none")
    column = pq.ParquetFile(good).metadata.row_group(1).column(1)  # the prompt's role strings, rows 2..3
    data = bytearray(good.read_bytes())
    data[column.data_page_offset : column.data_page_offset + column.total_compressed_size] = (
        b"\xff" * column.total_compressed_size)
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "data=gsm8k", f"data.path={damaged}"])
    assert f"{damaged} rows 2..3: row group 1 is unreadable" in _problem(err)
    assert "(data.path)" in _problem(err)


def test_a_datasetdict_folder_names_its_splits_and_column_wise_messages_are_read(tmp_path):
    """A save_to_disk folder of a DatasetDict is refused naming a split folder to use; a prompt stored as datasets'
    Sequence of a dict ({"role": [...], "content": [...]}) reads as the list of messages. Fails if either came
    through as a crash or as a prompt the chat template cannot take."""
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({
        "prompt": datasets.Sequence({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "reward_model": {"ground_truth": datasets.Value("string")}})
    columnar = {"prompt": [{"role": [m["role"] for m in p["prompt"]], "content": [m["content"] for m in p["prompt"]]}
                           for p in PROBLEMS],
                "reward_model": [{"ground_truth": label} for _, label in EXPECTED]}
    ds = datasets.Dataset.from_dict(columnar, features=features)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict with splits \['test', 'train'\]; set data.path"):
        read_prompt_rows(tmp_path / "dd", "prompt", GT)
    assert [(p, lab) for _, p, lab in read_prompt_rows(tmp_path / "dd" / "train", "prompt", GT)] == EXPECTED


def test_sft_refuses_a_table_naming_data_format(files):
    """recipe=sft reads JSONL records only: a parquet path is refused at validation naming data.format. Fails if the
    SFT recipe were let through to fail on the first line of a binary file."""
    with pytest.raises(ConfigError) as err:
        compose(["parallelism=cpu", "recipe=sft", "data=gsm8k", f"data.path={files['parquet']}"])
    assert "recipe=sft reads JSONL records only" in dict(err.value.problems)["data.format"]
    with pytest.raises(ConfigError, match="data.format"):
        compose(["parallelism=cpu", "data.format=csv"])


def test_an_eval_set_may_be_a_parquet_file(tmp_path, caplog):
    """eval=math500 with its file in parquet (problem/answer columns) validates and is compared with the training
    prompts: the one training problem in it is left out. Fails if eval files were still read as JSONL only."""
    train = write("parquet", PROBLEMS, tmp_path)
    user = PROBLEMS[0]["prompt"][0]["content"]
    evalf = write_parquet([{"problem": user, "answer": "7"}, {"problem": "What is 2^10?", "answer": "1024"}],
                          tmp_path / "math500.parquet")
    with caplog.at_level(logging.WARNING, logger="r3rl.eval.sets"):
        compose(["parallelism=cpu", "data=gsm8k", f"data.path={train}", "eval=math500",
                 f"eval.sets.math500.path={evalf}", "eval.sets.math500.sampling.top_p=1",
                 "eval.sets.math500.sampling.max_tokens=16", *STEP])
    assert "eval.sets.math500: left out 1 of its 2 problems" in caplog.text
    assert [(p, lab) for _, p, lab in read_prompt_rows(evalf, "problem", "answer")] == [
        (user, "7"), ("What is 2^10?", "1024")]


def test_default_data_config_reads_jsonl_as_before():
    """The default data=arithmetic names format jsonl and the schema defaults to auto. Fails if the default's format
    changed (the learning run depends on the generated JSONL being read exactly as before)."""
    assert compose(["parallelism=cpu"]).data.format == "jsonl"
    assert DataConfig(name="x", path="x").format == "auto"
