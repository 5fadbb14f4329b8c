"""The config reference of the docs site: every key of every config group with its type, default and comment, from
the schemas (``r3rl.config.schema``) and the comments above each key in ``conf/``.

    python -m r3rl.tools.config_reference            # write docs/reference/config/*.md
    python -m r3rl.tools.config_reference --check    # exit 1 if a page is stale or a key has no comment

The defaults are those of ``python run.py`` on a machine without a GPU (``parallelism=cpu``, whose ``scale/cpu.yaml``
sizes the CPU profile); each group's page lists its options (``group=option``) with the first line of their files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path

from omegaconf import OmegaConf

from r3rl.config import CONF_DIR, compose
from r3rl.config.schema import R3RLConfig

OUT_DIR = CONF_DIR.parent / "docs" / "reference" / "config"
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(?:\s|$)")


def yaml_comments(path: Path) -> dict[str, str]:
    """Dotted key -> the comment lines right above it (joined), for one YAML file of ``conf/``. The file's own
    header (its first comment lines, ending with a sentence) is not the first key's comment."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    pending: list[str] = []
    first = True
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if not stripped.startswith("# @package"):
                pending.append(stripped.lstrip("#").strip())
            continue
        if stripped.startswith("-"):  # an entry of the defaults list
            continue
        match = _KEY.match(line)
        if not match:
            pending = []
            continue
        if first:  # the key's own lines: after the header's last sentence, starting lower case as key comments do
            ends = [i for i, text in enumerate(pending) if text.endswith(".")]
            pending = pending[ends[-1] + 1:] if ends else pending
            while pending and not pending[0][:1].islower():
                pending = pending[1:]
            first = False
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([k for _, k in stack] + [key])
        if pending and key != "defaults":
            out[dotted] = " ".join(pending)
        pending = []
        stack.append((indent, key))
    return out


def group_comments(group: str, default: str | None = None) -> dict[str, str]:
    """A group's key comments: its options' files (the default option's first), and ``config.yaml`` for the groups
    it holds itself (``run``, ``ray``, ``debug``, ...). ``default``: the option composed by default."""
    out: dict[str, str] = {}
    folder = CONF_DIR / group
    if folder.is_dir():
        for path in sorted(folder.glob("*.yaml"), key=lambda p: p.stem != default):
            global_package = "# @package _global_" in path.read_text()
            for key, text in yaml_comments(path).items():
                out.setdefault(key if global_package else f"{group}.{key}", text)
    for key, text in yaml_comments(CONF_DIR / "config.yaml").items():
        if key == group or key.startswith(f"{group}."):
            out.setdefault(key, text)
    return out


def _type_name(tp) -> str:
    text = tp if isinstance(tp, str) else str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    return str(text).replace("typing.", "")


def schema_types(cls, prefix: str) -> dict[str, str]:
    """Dotted key -> the annotation of its schema field (nested dataclasses walked)."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, f.type)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(tp):
            out[key] = tp.__name__
            out.update(schema_types(tp, key))
        else:
            out[key] = _type_name(tp)
    return out


def _leaves(node, prefix: str) -> dict[str, object]:
    if isinstance(node, dict) and node:
        out: dict[str, object] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def _value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def options(group: str) -> list[tuple[str, str]]:
    """(option, first comment line) of each file of a config group."""
    folder = CONF_DIR / group
    out = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        first = next((line.lstrip("#").strip() for line in path.read_text().splitlines()
                      if line.startswith("#")), "")
        out.append((path.stem, first))
    return out


def groups() -> list[str]:
    return [f.name for f in dataclasses.fields(R3RLConfig)]


def reference() -> tuple[dict[str, str], list[str]]:
    """The pages (file name -> Markdown) and the keys that have no comment anywhere."""
    # the defaults as a fresh checkout composes them, whatever this shell's R3RL_DATA_DIR (the tests set one)
    saved = os.environ.pop("R3RL_DATA_DIR", None)
    try:
        cfg = compose(["parallelism=cpu"])
    finally:
        if saved is not None:
            os.environ["R3RL_DATA_DIR"] = saved
    plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False)
    types = schema_types(R3RLConfig, "")
    pages: dict[str, str] = {}
    uncommented: list[str] = []
    index = ["# Config reference", "",
             "Every key r3rl reads, by group, with its type, its default (`python run.py` on a machine without a GPU) "
             "and what it does. Written by `python -m r3rl.tools.config_reference` from the schemas and `conf/`; a "
             "test fails when it is stale.", "", "| group | keys |", "|---|---|"]
    for group in groups():
        comments = group_comments(group, plain[group].get("name") if isinstance(plain[group], dict) else None)
        rows = []
        for key, value in _leaves(plain[group], group).items():
            text = comments.get(key)
            if text is None:
                # a key of a named entry (eval.sets.<name>.x) is commented under the entry of its own file
                parts = key.split(".")
                text = next((comments[k] for k in (".".join(parts[:i] + parts[i + 1:]) for i in range(len(parts)))
                             if k in comments), None)
            if text is None:
                uncommented.append(key)
            type_name = types.get("." + key, type(value).__name__ if value is not None else "")
            cell = (text or "").replace("|", "\\|")
            rows.append(f"| `{key}` | `{type_name}` | `{_value(value)}` | {cell} |")
        lines = [f"# `{group}`", ""]
        if opts := options(group):
            lines += [f"Options (`{group}=<option>`):", ""]
            lines += [f"- `{name}`: {first}" for name, first in opts]
            lines.append("")
        lines += ["| key | type | default | what it does |", "|---|---|---|---|", *rows, ""]
        pages[f"{group}.md"] = "\n".join(lines)
        index.append(f"| [`{group}`]({group}.md) | {len(rows)} |")
    pages["index.md"] = "\n".join(index) + "\n"
    return pages, uncommented


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale or a key has no comment")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    pages, uncommented = reference()
    if args.check:
        stale = [name for name, text in pages.items()
                 if not (args.out / name).is_file() or (args.out / name).read_text() != text]
        for key in uncommented:
            print(f"{key}: no comment above it in conf/", file=sys.stderr)
        if stale:
            print(f"stale: {', '.join(stale)} in {args.out}; run python -m r3rl.tools.config_reference",
                  file=sys.stderr)
        return 1 if stale or uncommented else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (args.out / name).write_text(text)
    print(f"{len(pages)} pages written to {args.out}; {len(uncommented)} keys without a comment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
