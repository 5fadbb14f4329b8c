"""The doctor's verdict: one table on the console, ``doctor.json`` and ``doctor.md`` in its folder."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from r3rl.doctor.checks import FAIL, Check

_COLOUR = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}


def table(results: Sequence[Check]) -> Table:
    out = Table(title="r3rl doctor", show_lines=True)
    for column in ("check", "result", "figure", "why / what to change"):
        out.add_column(column, overflow="fold")
    for r in results:
        note = r.detail if r.status != FAIL else f"{r.detail}\n-> {r.fix}" if r.fix else r.detail
        out.add_row(r.name, f"[{_COLOUR[r.status]}]{r.status}[/]", r.figure, note)
    return out


def bounds(results: Sequence[Check]) -> list[str]:
    """One line per check that compared against a bound: the bound this run used, and where it comes from."""
    return [f"{r.name}: {r.bound}" for r in results if r.bound]


def markdown(results: Sequence[Check], command: str) -> str:
    lines = [f"# r3rl doctor\n\n`{command}`\n", "| check | result | figure | why / what to change |",
             "|---|---|---|---|"]
    for r in results:
        note = " ".join(x for x in (r.detail, f"Change: {r.fix}" if r.status == FAIL and r.fix else "") if x)
        cells = (cell.replace("|", "\\|").replace("\n", " ") for cell in (r.name, r.status, r.figure, note))
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r.name for r in results if r.status == FAIL]
    lines.append(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'every check that could run passed'}\n")
    if bounds(results):
        lines += ["## Bounds used", "", *(f"- {line}" for line in bounds(results)), ""]
    return "\n".join(lines)


def write(results: Sequence[Check], folder: Path, command: str, console: Console) -> int:
    """Print the table, write ``doctor.json`` and ``doctor.md``; the exit status: 1 when a check failed."""
    console.print(table(results))
    for line in bounds(results):
        console.print(f"bound, {line}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "doctor.json").write_text(json.dumps(
        {"command": command, "checks": [dataclasses.asdict(r) for r in results]}, indent=2, default=str))
    (folder / "doctor.md").write_text(markdown(results, command))
    console.print(f"doctor report: {folder / 'doctor.md'} and doctor.json")
    return 1 if any(r.status == FAIL for r in results) else 0
