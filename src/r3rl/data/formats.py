"""The records of a prompt file in any of the formats ``data.format`` names, as plain Python dicts.

- ``jsonl``: one JSON object per line; a record is numbered by its line (from 1), ``file:line`` in messages.
- ``parquet``: a table, verl's layout for instance (``prompt`` a list of chat messages, ``reward_model`` a struct
  holding ``ground_truth``, ``data_source``); read with pyarrow, one row group at a time.
- ``hf_disk``: a folder written by HF ``datasets``' ``Dataset.save_to_disk``, read with ``datasets.load_from_disk``.

A table's record is numbered by its row from 0, as ``datasets`` and pandas index it (``file row 17`` in messages).
``auto`` (the default) takes the format from the path: a folder is ``hf_disk``, ``.parquet``/``.pq`` is parquet,
``.jsonl``/``.ndjson``/``.json`` is JSONL, and any other file is parquet when it starts with parquet's magic bytes,
JSONL otherwise. pyarrow and ``datasets`` are imported only when such a file is read (the engines and the trainer
never pay for them).

A key may be dotted: ``reward_model.ground_truth`` is the ``ground_truth`` field of the ``reward_model`` struct
column (or object, in JSONL); a column whose name holds the dot itself is taken first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

FORMATS = ("auto", "jsonl", "parquet", "hf_disk")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_PARQUET_MAGIC = b"PAR1"

MISSING = object()  # what ``lookup`` returns for a key a record lacks


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line or row and the config key to check."""


def detect_format(path: str | Path, fmt: str = "auto", config_key: str = "data") -> str:
    """``fmt`` itself, or for ``auto`` the format the path shows (see the module's docstring)."""
    if fmt != "auto":
        if fmt not in FORMATS:
            raise DataError(f"{config_key}.format={fmt}: must be one of {', '.join(FORMATS)}")
        return fmt
    p = Path(path)
    if p.is_dir():
        return "hf_disk"
    by_suffix = _SUFFIXES.get(p.suffix.lower())
    if by_suffix is not None:
        return by_suffix
    try:
        with p.open("rb") as f:
            return "parquet" if f.read(4) == _PARQUET_MAGIC else "jsonl"
    except OSError:  # missing: the caller says so
        return "jsonl"


def missing_prompts_message(data_cfg: Any, config_key: str = "data") -> str:
    """What to do about a prompt file that is not there, in the terms of its format (a parquet path gets columns,
    not JSONL lines)."""
    fmt = detect_format(data_cfg.path, data_cfg.format, config_key)
    holding = f"'{data_cfg.prompt_key}' and '{data_cfg.label_key}'"
    what = {"parquet": f"a parquet file with the columns {holding}",
            "hf_disk": f"a datasets save_to_disk folder with the columns {holding}"}.get(
        fmt, f"a JSONL file with one object per line holding {holding}")
    return (f"{config_key}.path={data_cfg.path}: no such file. Point {config_key}.path at {what} "
            f"({config_key}={data_cfg.name}), or use data=arithmetic, which generates its prompts")


def where(path: str | Path, fmt: str, row: int) -> str:
    """How a message points at a record: ``file:line`` in JSONL, ``file row N`` (from 0) in a table."""
    return f"{path}:{row}" if fmt == "jsonl" else f"{path} row {row}"


def lookup(record: dict[str, Any], key: str) -> Any:
    """``record[key]``, a dotted key reaching into nested structs; ``MISSING`` when the record lacks it."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def jsonl_objects(path: str | Path, config_key: str = "data") -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, ``file:line``, object) of every non-blank line of a JSONL file; a line that is not UTF-8, not
    JSON, not an object, or JSON Python cannot hold (an integer past its int-string limit, nesting past its
    recursion limit) raises DataError naming it, and a path that cannot be read (a folder, no permission) names
    ``<config_key>.path``."""
    try:
        with Path(path).open("rb") as f:
            yield from _jsonl_lines(path, f)
    except OSError as err:
        what = "a folder, not a JSONL file" if Path(path).is_dir() else f"cannot be read ({err.strerror or err})"
        raise DataError(f"{path}: {what}; check {config_key}.path (or {config_key}.format for a parquet file or a "
                        "save_to_disk folder)") from None


def _jsonl_lines(path: str | Path, f) -> Iterator[tuple[int, str, dict[str, Any]]]:
    for lineno, data in enumerate(f, start=1):
        here = f"{path}:{lineno}"
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{here}: not UTF-8 (byte {data[e.start]:#04x} at column {e.start + 1}); save the "
                            "file as UTF-8") from None
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{here}: not valid JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:  # an integer of more digits than sys.get_int_max_str_digits()
            raise DataError(f"{here}: a value r3rl cannot read ({' '.join(str(e).split())})") from None
        except RecursionError:
            raise DataError(f"{here}: JSON nested deeper than Python's recursion limit") from None
        if not isinstance(obj, dict):
            raise DataError(f"{here}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, here, obj


def label_text(value: Any, here: str, key: str, config_key: str = "data", *, optional: bool = False) -> str | None:
    """A record's reference answer as the text a grader compares with, or DataError naming ``here`` (``file:line``
    or its row) and the key. Python's JSON reader takes ``NaN``, ``Infinity``, ``1e400`` (read as infinity) and
    ``true``, and no answer a model writes equals their text: every sample of that prompt would grade 0 and its group
    carry no advantage, in silence. ``optional``: a missing label is None (SFT records need none)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        got = "null" if value is None else json.dumps(value) if isinstance(value, bool) else type(value).__name__
        raise DataError(f"{here}: '{key}' must be a string or a number, got {got} ({config_key}.label_key={key})")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{here}: '{key}' is {value} (JSON's NaN or Infinity, or a number past a float's range), "
                        f"which no answer can match; write the reference answer ({config_key}.label_key={key})")
    text = str(value)
    if not text.strip():
        raise DataError(f"{here}: '{key}' is empty ({config_key}.label_key={key})")
    return text


def records(path: str | Path, fmt: str, keys: Iterable[tuple[str, str]],
            config_key: str = "data") -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line or row, where, record) of every record of ``path`` in format ``fmt`` (not ``auto``).

    ``keys`` are the (key, config key) pairs the caller reads: a table is read for their columns only, and a
    column no row can have raises DataError naming the file, row 0 and the config key. A file the format's reader
    cannot read raises DataError naming it (and for a damaged parquet row group, its rows)."""
    keys = list(keys)
    if fmt == "jsonl":
        yield from jsonl_objects(path, config_key)
    elif fmt == "parquet":
        yield from _parquet_records(Path(path), keys, config_key)
    elif fmt == "hf_disk":
        yield from _hf_disk_records(Path(path), keys, config_key)
    else:
        raise DataError(f"{config_key}.format={fmt}: must be one of {', '.join(FORMATS[1:])} here")


def table_value(value: Any) -> Any:
    """A table cell as JSONL would hold it: a struct's null fields (a column's struct type unifies every row's
    fields) are left out, and a list of structs stored column-wise (``datasets``' ``Sequence`` of a dict gives
    ``{"role": [...], "content": [...]}``) becomes the list of dicts."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        lengths = {len(v) for v in value.values()}
        if len(lengths) == 1 and {"role", "content"} <= set(value):
            n = lengths.pop()
            value = [{k: v[i] for k, v in value.items()} for i in range(n)]
    if isinstance(value, list):
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
    return value


def _said(err: Exception) -> str:
    """A reader's exception on one line (pyarrow's messages span several)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _columns(path: Path, names: list[str], keys: list[tuple[str, str]], fmt: str) -> list[str]:
    """The top-level columns that hold ``keys``; a key no column can hold raises DataError."""
    columns: list[str] = []
    for key, cfg_key in keys:
        column = key if key in names else key.split(".", 1)[0]
        if column not in names:
            raise DataError(f"{where(path, fmt, 0)}: no key '{key}' ({cfg_key}={key}); the file's columns are "
                            f"{sorted(names)}. Set {cfg_key} to the column that holds it (a dotted key reaches "
                            f"into a struct column).")
        if column not in columns:
            columns.append(column)
    return columns


def _parquet_records(path: Path, keys: list[tuple[str, str]],
                     config_key: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - a base dependency
        raise DataError(f"{path}: reading parquet needs pyarrow ({err}); pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
        names = list(pf.schema_arrow.names)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a file it cannot open
        raise DataError(f"{path}: not a readable parquet file ({_said(err)}); check "
                        f"{config_key}.path, or set {config_key}.format if the file is in another format") from None
    columns = _columns(path, names, keys, "parquet")
    start = 0
    for group in range(pf.num_row_groups):
        n = pf.metadata.row_group(group).num_rows
        try:
            rows = pf.read_row_group(group, columns=columns).to_pylist()
        except Exception as err:
            raise DataError(f"{path} rows {start}..{start + n - 1}: row group {group} is unreadable "
                            f"({_said(err)}); the file is damaged ({config_key}.path)") from None
        for i, row in enumerate(rows, start=start):
            yield i, where(path, "parquet", i), row
        start += n


def _hf_disk_records(path: Path, keys: list[tuple[str, str]],
                     config_key: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - a base dependency
        raise DataError(f"{path}: reading a save_to_disk folder needs datasets ({err}); pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:
        raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({_said(err)}); "
                        f"check {config_key}.path, or set {config_key}.format") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict with splits {sorted(ds)}; set {config_key}.path to one split's "
                        f"folder, e.g. {path / sorted(ds)[0]}")
    columns = _columns(path, list(ds.column_names), keys, "hf_disk")
    ds = ds.select_columns(columns).with_format(None)
    batch = 1024
    for start in range(0, len(ds), batch):
        part = ds[start : start + batch]
        for offset in range(len(part[columns[0]])):
            i = start + offset
            yield i, where(path, "hf_disk", i), {c: part[c][offset] for c in columns}
