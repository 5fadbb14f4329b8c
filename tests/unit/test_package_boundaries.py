"""The package boundaries the layout promises, checked on the import statements themselves (``ast``), so a new
import that crosses one fails here rather than in a review.

- ``r3rl.train`` (the Megatron side) imports nothing of the rollout or of the weight sync: the trainer only
  produces HF buckets (``r3rl.train.export``), it never talks to an engine.
- ``r3rl.rollout`` is about generation and imports nothing of the sync or the trainer.
- ``r3rl.config`` is validated before any plan exists and imports neither ``r3rl.plan`` nor anything above it:
  checks that read data, eval sets or checkpoints, build the environment or plan memory live in ``r3rl.preflight``.
- ``r3rl.env`` drives episodes over the rollout client and knows neither the trainer nor the weight sync.
- ``r3rl.sync``'s engine side (what vLLM's worker imports) pulls in neither the trainer nor the rollout client.
- The library under ``src/`` never imports ``recipes/``: the recipes and the scripts that start them (``run.py``,
  ``doctor.py``) sit above it, beside ``conf/``.
- What exists only because there is no GPU sits in ``r3rl.cpu_only`` and is imported by nothing at module level:
  only ``r3rl.train.hardware`` and the engine worker's ``r3rl.sync.worker_extension``, inside functions that run
  without CUDA (``tests/unit/train/test_train_cpu_compat.py`` proves it stays unimported with CUDA present).
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


def imported_names(tree: ast.AST) -> set[str]:
    """Modules a parsed file imports by statement, or by ``importlib.import_module`` with a literal or f-string
    whose start is literal."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def test_the_library_never_imports_the_recipes():
    """``python -m r3rl.doctor`` imported ``recipes.doctor`` and ``r3rl.launch`` imported ``recipes.<name>``, so the
    library ran only with the checkout's root on ``sys.path``. Fails if any module under ``src/`` imports
    ``recipes`` again, by statement (at any depth) or through ``importlib.import_module("recipes...")``."""
    offenders = {str(p.relative_to(SRC)): sorted(m for m in imported_names(ast.parse(p.read_text()))
                                                 if m == "recipes" or m.startswith("recipes."))
                 for p in sorted(SRC.rglob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_scan_sees_an_import_of_the_recipes():
    """The control of the rule above: each form of import it must catch is caught."""
    for source in ("import recipes.grpo", "from recipes.doctor import run_doctor",
                   "def f():\n    from recipes import common", "importlib.import_module(f'recipes.{name}')"):
        assert any(m.startswith("recipes") for m in imported_names(ast.parse(source))), source


def room_imports(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The ``r3rl.cpu_only`` modules a parsed file imports at module level, and at any depth."""
    top = imported_names(ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                                    type_ignores=[]))
    room = lambda names: {m for m in names if m.startswith("r3rl.cpu_only")}  # noqa: E731
    return room(top), room(imported_names(tree))


def test_cpu_only_code_is_imported_only_inside_functions_of_its_two_doors():
    """Fails if a module imports ``r3rl.cpu_only`` at module level (it would load on a GPU too), or if a module other
    than the trainer's hardware seam and the engine worker's extension imports it at all."""
    doors = {"train/hardware.py", "sync/worker_extension.py"}
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel.startswith("cpu_only/"):
            continue
        top, every = room_imports(ast.parse(path.read_text()))
        if top or (rel not in doors and every):
            found[rel] = sorted(every)
    assert not found, found
    assert all(room_imports(ast.parse((SRC / d).read_text()))[1] for d in doors), "a door no longer imports the room"


def test_the_scan_sees_an_import_of_the_room_at_module_level():
    """The control of the rule above: a module-level import is caught, one inside a function is told apart."""
    assert room_imports(ast.parse("from r3rl.cpu_only import megatron"))[0] == {"r3rl.cpu_only"}
    assert room_imports(ast.parse("def f():\n    from r3rl.cpu_only import megatron")) == (set(), {"r3rl.cpu_only"})
