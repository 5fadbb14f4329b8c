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
