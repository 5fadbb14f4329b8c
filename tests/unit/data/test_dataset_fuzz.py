"""Prompt files are outside data: whatever a file holds, reading it gives rows or r3rl's own ``DataError`` naming
the file and the line or row, never another exception and never a hang (issue 59). The reproductions first (each
raised a bare ``ValueError``/``RecursionError``/``UnicodeDecodeError`` naming nothing), then Hypothesis over bytes,
records and tables, with a fixed example budget and derandomised so CI is repeatable."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3rl.data.dataset import read_prompt_rows
from r3rl.data.formats import DataError

FUZZ = settings(max_examples=150, derandomize=True, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.too_slow])
GOOD = json.dumps({"prompt": "1+1?", "label": "2"})


def read(path: Path, fmt: str = "auto"):
    return read_prompt_rows(path, "prompt", "label", fmt=fmt)


@pytest.mark.parametrize("bad, said", [
    ('{"prompt": "x", "label": ' + "7" * 5000 + "}", "cannot read"),  # Python's int-string limit
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "label": "1"}', "nested deeper"),
    (b'{"prompt": "caf\xe9", "label": "1"}', "not UTF-8 (byte 0xe9 at column 16)"),  # Latin-1, not UTF-8
])
def test_lines_that_raised_without_a_line_name_it(tmp_path, bad, said):
    """Line 2 of three holds it. Fails if the reader lets Python's own exception out (naming no file or line)."""
    path = tmp_path / "prompts.jsonl"
    line = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(GOOD.encode() + b"\n" + line + b"\n" + GOOD.encode() + b"\n")
    with pytest.raises(DataError, match=rf"prompts.jsonl:2: .*{said.split('(')[0]}") as info:
        read(path)
    assert said in str(info.value)


def outcome(path: Path, fmt: str = "auto") -> None:
    """The one outcome allowed: rows whose prompt and label are usable, or a DataError naming the file."""
    try:
        rows = read(path, fmt)
    except DataError as err:
        assert str(path) in str(err), err
        return
    assert rows
    for _, prompt, label in rows:
        assert isinstance(label, str) and label.strip()
        assert isinstance(prompt, (str, list))


@FUZZ
@given(data=st.binary(max_size=2000))
def test_any_bytes_as_jsonl(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.jsonl"
        path.write_bytes(data)
        outcome(path)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 3]),
                                           "content": st.one_of(st.text(max_size=20), st.none())}), max_size=3)
RECORD = st.dictionaries(st.sampled_from(["prompt", "label", "extra", "Prompt", ""]),
                         st.one_of(JSON, MESSAGES, st.text(max_size=3000)), max_size=4)


@FUZZ
@given(records=st.lists(st.one_of(RECORD, JSON), max_size=6), blank=st.booleans())
def test_any_records_as_jsonl(records, blank):
    """Missing, extra and mistyped keys, huge and empty values, non-objects, blank lines."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.jsonl"
        lines = [json.dumps(r) for r in records]
        path.write_text(("\n\n" if blank else "\n").join(lines))
        outcome(path)


@FUZZ
@given(data=st.binary(max_size=600))
def test_any_bytes_as_parquet(data):
    """A file that starts with parquet's magic bytes and is not parquet."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.bin"
        path.write_bytes(b"PAR1" + data)
        outcome(path)


@settings(FUZZ, max_examples=60)
@given(prompts=st.lists(st.one_of(st.text(max_size=50), st.none(), MESSAGES), min_size=1, max_size=5),
       labels=st.one_of(st.lists(st.one_of(st.text(max_size=10), st.none()), min_size=5, max_size=5),
                        st.lists(st.integers(-2**63, 2**63 - 1), min_size=5, max_size=5)),
       label_column=st.sampled_from(["label", "answer"]))
def test_any_table_as_parquet(prompts, labels, label_column):
    """Mistyped cells (null, messages with a non-string role or null content, integer labels) and a missing
    column, in a real parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.parquet"
        n = len(prompts)
        prompt_col = pa.array([json.dumps(p) if isinstance(p, list) else p for p in prompts], pa.string())
        pq.write_table(pa.table({"prompt": prompt_col, label_column: pa.array(labels[:n])}), path)
        outcome(path)


@pytest.mark.parametrize("layout", ["empty", "junk_files", "dataset_dict_json"])
def test_a_folder_that_is_no_saved_dataset(tmp_path, layout):
    """``hf_disk`` is a folder: an empty one, one of junk, one whose metadata is garbage. Fails if ``datasets``'
    own exception gets out."""
    folder = tmp_path / "ds"
    folder.mkdir()
    if layout == "junk_files":
        (folder / "data-00000-of-00001.arrow").write_bytes(b"\x00" * 100)
        (folder / "state.json").write_text("{")
    elif layout == "dataset_dict_json":
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match=str(folder)):
        read(folder)


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=20))


@FUZZ
@given(label=st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3),
                       st.dictionaries(st.text(max_size=5), JSON_SCALARS, max_size=3)))
def test_any_label_reads_as_text_a_grader_can_match_or_is_refused_naming_its_line(label):
    """Whatever a record's label holds, reading gives a non-empty text that is no rendering of NaN, infinity or a
    JSON boolean, or DataError naming the line (issue 69). Fails if a label no answer can equal (NaN, Infinity,
    1e400, true) reaches a grader again."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text(GOOD + "\n" + json.dumps({"prompt": "x?", "label": label}) + "\n")
        try:
            rows = read(path)
        except DataError as err:
            assert "prompts.jsonl:2: 'label'" in str(err)
            return
    text = rows[1][2]
    assert text.strip() and text not in ("nan", "inf", "-inf", "True", "False")
    assert not isinstance(label, bool) and label is not None


@FUZZ
@given(url=st.one_of(st.text(max_size=40), st.builds(lambda h, p: f"http://{h}:{p}", st.text(max_size=12),
                                                      st.integers(-10, 100_000))))
def test_any_engine_url_is_accepted_only_when_it_parses_to_a_host_and_port(url):
    """``rollout.engine.url`` is outside data: any text gives None or a reason, never an exception, and a URL it
    accepts splits into http(s), a host and a port in range (what the client joins its routes to)."""
    from urllib.parse import urlsplit

    from r3rl.config.validate import engine_url_problem

    problem = engine_url_problem(url)
    if problem is None:
        parts = urlsplit(url)
        assert parts.scheme in ("http", "https") and parts.hostname and (parts.port is None or 1 <= parts.port <= 65535)
        assert not any(ch.isspace() for ch in url)
