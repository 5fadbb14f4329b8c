"""The package boundaries the layout promises, checked on the import statements themselves (``ast``), so a new
import that crosses one fails here rather than in a review.

- ``r3rl.train`` (the Megatron side) imports nothing of the rollout or of the weight sync: the trainer only
  produces HF buckets (``r3rl.train.export``), it never talks to an engine.
- ``r3rl.rollout`` is about generation and imports nothing of the sync or the trainer.
- ``r3rl.config`` is validated before any plan exists and imports neither ``r3rl.plan`` nor anything above it:
  checks that read data, eval sets or checkpoints, build the environment or plan memory live in ``r3rl.preflight``.
- ``r3rl.env`` drives episodes over the rollout client and knows neither the trainer nor the weight sync.
- ``r3rl.sync``'s engine side (what vLLM's worker imports) pulls in neither the trainer nor the rollout client.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "r3rl"


def r3rl_imports(path: pathlib.Path) -> set[str]:
    """Every ``r3rl.*`` module a file imports, at any depth (imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("r3rl")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("r3rl"):
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def crossings(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in sorted((SRC / package).rglob("*.py")):
        bad = sorted(m for m in r3rl_imports(path) if m.startswith(forbidden))
        if bad:
            out[str(path.relative_to(SRC))] = bad
    return out


@pytest.mark.parametrize("package, forbidden", [
    ("train", ("r3rl.rollout", "r3rl.sync", "r3rl.orchestration")),
    ("rollout", ("r3rl.sync", "r3rl.train", "r3rl.orchestration")),
    ("config", ("r3rl.plan", "r3rl.placement", "r3rl.rollout", "r3rl.sync", "r3rl.train", "r3rl.orchestration",
                "r3rl.data", "r3rl.eval", "r3rl.memory", "r3rl.models", "r3rl.env", "r3rl.preflight")),
    ("env", ("r3rl.sync", "r3rl.train", "r3rl.orchestration")),
])
def test_package_does_not_import_across_its_boundary(package, forbidden):
    """Fails if e.g. ``r3rl.config.validate`` goes back to ``from r3rl.plan import resolve_dtype``, or a module in
    ``r3rl.train`` imports a wire from ``r3rl.sync``."""
    assert not crossings(package, forbidden), f"r3rl.{package} imports across its boundary"


@pytest.mark.parametrize("module", ["worker_extension.py", "gloo_engine.py", "cpu_experts.py"])
def test_engine_side_of_sync_stays_light(module):
    """Fails if a module the vLLM worker imports starts importing the trainer, the Ray orchestration or the rollout
    client (the worker would load Megatron or httpx-side code it never uses, or fail where it is not installed)."""
    heavy = ("r3rl.train", "r3rl.orchestration", "r3rl.rollout.client", "r3rl.sync.protocol", "r3rl.sync.wires")
    assert not [m for m in r3rl_imports(SRC / "sync" / module) if m.startswith(heavy)]


MAX_CLASS_LINES = 400


def test_no_class_in_src_is_too_large_to_hold():
    """A reader who comes to change one concern should not have to hold a class of every concern (issue 60: the
    trainer was one 800-line class; its concerns are now mixins in modules named for them). Fails when a class
    under ``src/`` grows past ``MAX_CLASS_LINES``: split it by concern before it lands."""
    large = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                large[f"{path.relative_to(SRC)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not large, large


def module_graph() -> dict[str, set[str]]:
    """r3rl module -> the r3rl modules it imports (a ``from package import module`` counts as the module)."""
    modules = {".".join(("r3rl", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        seen = r3rl_imports(path) | {m.rsplit(".", 1)[0] for m in r3rl_imports(path)}
        graph[name] = {m for m in seen if m in modules and m != name}
    return graph


def test_no_two_modules_import_each_other():
    """A circle of two modules (``data/arithmetic.py`` <-> ``data/dataset.py`` was one, held together by an import
    inside a function) means neither can be read, tested or moved alone. Fails when two modules under ``src/``
    import each other at any depth."""
    graph = module_graph()
    circles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert not circles, circles
