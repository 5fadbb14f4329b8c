"""The docs site's generated references stay true to the code: the config reference (every key of every group with
its type, default and comment) and the metric reference (every key r3rl logs, with its definition)."""

from __future__ import annotations

import re

from r3rl import metric_docs
from r3rl import metrics as M
from r3rl.tools import config_reference


def test_the_config_reference_is_current_and_every_key_is_commented(capsys):
    """Fails when a config key is added without a comment above it in ``conf/`` (it is listed), or a key, default or
    comment changed without ``python -m r3rl.tools.config_reference`` rewriting the committed pages."""
    assert config_reference.main(["--check"]) == 0, capsys.readouterr().err
    pages, uncommented = config_reference.reference()
    assert uncommented == []
    # every group has its page, and a page names the options of its group
    assert set(pages) == {f"{g}.md" for g in config_reference.groups()} | {"index.md"}
    assert "- `vllm_r3`:" in pages["rollout.md"] and "| `algorithm.group_intake` | `str` | `batch` |" in \
        pages["algorithm.md"]


def test_the_metric_reference_is_current_and_documents_every_named_key(capsys):
    """Fails when a metric name is added to ``r3rl.metrics`` without an entry in ``r3rl.metric_docs.METRIC_DOCS``, or
    the entries changed without ``python -m r3rl.metric_docs`` rewriting ``docs/reference/metrics.md``. (A key a run
    logs under no name of ``r3rl.metrics``, the trainer's own, is checked on a real run:
    ``tests/integration/recipe/test_grpo_recipe.py``.)"""
    assert metric_docs.main(["--check"]) == 0, capsys.readouterr().err
    names = [v for k, v in vars(M).items() if k.isupper() and isinstance(v, str) and "/" in v]
    keys = [re.sub(r"\{[^}]*\}", "x", name) for name in names]  # a template's field stands for some value
    assert [k for k in keys if metric_docs.documented(k) is None] == []
    assert metric_docs.documented("r3/routing_flip_rate/layer_07").keys[0] == M.ROUTING_FLIP_RATE
    assert metric_docs.documented("train/not_a_metric") is None


def test_the_site_builds_strictly_and_the_readme_links_resolve(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` runs): fails on a broken link or anchor between pages, a page
    left out of the navigation, or a reference page the navigation names that is not written. The README's relative
    links (into ``docs/``) must name files that exist."""
    import os
    import subprocess
    import sys

    root = config_reference.CONF_DIR.parent
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()
    readme = (root / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert links and [link for link in links if not (root / link).exists()] == []
    assert len(readme.splitlines()) <= 200
