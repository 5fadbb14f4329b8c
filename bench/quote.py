"""Run a bench script and put its last lines, with the command, machine and date, in every page's block for it.

    python bench/quote.py [--lines N] bench/replay_overhead.py [its arguments...]

A page asks for a script's figures with the lines

    <!-- replay_overhead:begin (quoted by bench/quote.py from bench/replay_overhead.py; do not edit) -->
    <!-- replay_overhead:end -->

and this script replaces what stands between them with the command it ran, where and when, and the script's last
``--lines`` lines of output (each bench's last line is its figure). The script's own output streams through as it
runs. A script that fails leaves every page as it was. This is for the scripts that print their figures and have no
``--write-docs`` of their own; the figures of a page's prose are never typed by hand (tests/unit/test_docs_claims.py).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_figures import REPO, measured, write_block  # noqa: E402

PAGES = ("README.md", "slurm/README.md", "docs")


def begin_line(name: str, script: str) -> str:
    return f"<!-- {name}:begin (quoted by bench/quote.py from {script}; do not edit) -->"


def end_line(name: str) -> str:
    return f"<!-- {name}:end -->"


def pages_with(begin: str) -> list[Path]:
    """Every page (README, slurm/README, docs/**) holding the block's first line."""
    found = []
    for entry in PAGES:
        path = REPO / entry
        for page in sorted(path.rglob("*.md")) if path.is_dir() else [path]:
            if page.is_file() and begin in page.read_text():
                found.append(page)
    return found


def block(name: str, script: str, args: list[str], lines: list[str], where: str) -> str:
    """The block's text, its first and last lines included."""
    command = " ".join(["python", script, *map(shlex.quote, args)])
    head = f"`{command}` ({where}), its last line{'s' if len(lines) > 1 else ''}:"
    body = [f"`{lines[0]}`"] if len(lines) == 1 else ["", "```", *lines, "```", ""]
    return "\n".join([begin_line(name, script), head if len(lines) > 1 else f"{head} {body[0]}",
                      *(body if len(lines) > 1 else []), end_line(name)])


def run(script: str, args: list[str]) -> list[str]:
    """The script's stdout lines, echoed as they come; SystemExit naming the script when it fails."""
    proc = subprocess.Popen([sys.executable, str(REPO / script), *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line.rstrip("\n"))
    if proc.wait() != 0:
        raise SystemExit(f"{script} exited {proc.returncode}: no page was changed")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1, help="how many of the script's last lines to quote")
    parser.add_argument("--name", help="the block's name (default: the script's stem)")
    parser.add_argument("script", help="bench/<script>.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    opts = parser.parse_args()
    script = Path(opts.script).as_posix().removeprefix("./")
    if not (REPO / script).is_file():
        raise SystemExit(f"{script}: no such script")
    name = opts.name or Path(script).stem
    begin = begin_line(name, script)
    pages = pages_with(begin)
    if not pages:
        raise SystemExit(f"no page holds the line {begin!r}: add it (and {end_line(name)!r}) where the figures go")
    lines = [line for line in run(script, opts.args) if line.strip()][-opts.lines:]
    if not lines:
        raise SystemExit(f"{script} printed nothing to quote")
    text = block(name, script, opts.args, lines, measured())
    for page in pages:
        write_block(page, text, begin, end_line(name))
    print(f"quoted in {', '.join(str(p.relative_to(REPO)) for p in pages)}")


if __name__ == "__main__":
    main()
