"""How a driver chooses Ray's authentication before it starts or joins a cluster (``use_token_auth``); the local
cluster's token is tested for real in tests/integration/test_ray_token_auth.py, Slurm's on the two-host bed."""

from __future__ import annotations

import pytest

from r3rl.orchestration.ray_cluster import use_token_auth


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_an_attached_cluster_uses_token_auth_when_the_environment_holds_a_token(clean_env):
    """Fails if a driver attached to slurm/ray.sub's cluster (RAY_AUTH_TOKEN_PATH exported) connected without token
    mode, if one without any token switched token mode on (it could not connect to an open cluster), or if a mode the
    user set were overridden."""
    import os

    clean_env.setenv("RAY_AUTH_TOKEN_PATH", "/shared/123-logs/ray_auth_token")
    use_token_auth(attaching=True)
    assert os.environ["RAY_AUTH_MODE"] == "token"
    clean_env.delenv("RAY_AUTH_MODE")
    clean_env.delenv("RAY_AUTH_TOKEN_PATH")
    use_token_auth(attaching=True)
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    clean_env.setenv("RAY_AUTH_MODE", "disabled")
    clean_env.setenv("RAY_AUTH_TOKEN", "x" * 64)
    use_token_auth(attaching=False)
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and os.environ["RAY_AUTH_TOKEN"] == "x" * 64


def test_a_ray_without_token_authentication_is_refused_before_anything_starts(compose_cfg, monkeypatch):
    """Ray 2.49-2.51 (allowed by the old floor) has no token authentication: a local run died at import of
    AuthenticationTokenLoader, a Slurm run ran without auth (issue 59 item 8). Simulated install: the version
    string Ray reports. Fails if ``start_or_attach`` stops checking before ``ray.init``, or if pyproject's floor and
    ``MIN_RAY`` part."""
    import re
    from pathlib import Path

    import ray

    from r3rl.orchestration.ray_cluster import MIN_RAY, ClusterError, ray_version_problem, start_or_attach
    from r3rl.plan import build_plan

    assert ray_version_problem(ray.__version__) is None
    assert ray_version_problem("2.52.0") is None and ray_version_problem("2.60.1rc1") is None
    assert "Ray 2.51.2 is installed; r3rl needs ray>=2.52" in ray_version_problem("2.51.2")
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = re.search(r'"ray\[default\]>=(\d+)\.(\d+)', pyproject).groups()
    assert tuple(map(int, floor)) == MIN_RAY
    cfg = compose_cfg("parallelism=cpu")
    monkeypatch.setattr(ray, "__version__", "2.49.0")
    with pytest.raises(ClusterError, match="Ray 2.49.0 is installed"):
        start_or_attach(cfg, build_plan(cfg))
    assert not ray.is_initialized()
