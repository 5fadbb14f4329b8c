"""Every third-party module the rollout and sync packages import is declared in pyproject.toml (a clean install must not
depend on what vLLM happens to pull in: numba and pybase64 carry the routed-experts decode)."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[3]


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def imported_top_level(package: pathlib.Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "r3rl"}


def test_rollout_imports_are_declared_dependencies():
    deps = declared()
    dists = importlib.metadata.packages_distributions()
    modules = imported_top_level(ROOT / "src" / "r3rl" / "rollout") | imported_top_level(ROOT / "src" / "r3rl" / "sync")
    assert {"numba", "pybase64"} <= modules
    undeclared = {m: dists.get(m) for m in modules
                  if not {d.lower().replace("_", "-") for d in dists.get(m, [])} & deps}
    assert not undeclared, f"imported by src/r3rl/rollout or sync but not in pyproject.toml: {undeclared}"
