"""Multi-turn environments and episodes (``env`` config group).

``env=single_turn`` (the default) is one request per sample, as before. Any other environment runs episodes through
``r3rl.env.episodes.EpisodeRunner``: ``base`` is the interface a user implements, ``calculator`` the built-in tool
environment, ``stitch`` the rule that makes one ``Sample`` (and one route array) of an episode's turns.
"""

from __future__ import annotations

from r3rl.env.base import Environment, Episode, Turn

__all__ = ["Environment", "Episode", "Turn", "build_environment", "multi_turn"]


def multi_turn(env_cfg) -> bool:
    """Whether ``env_cfg`` runs episodes (an ``env.environment`` to build) rather than single requests."""
    return env_cfg.environment is not None


def build_environment(env_cfg) -> Environment:
    """The ``Environment`` of ``env.environment`` (Hydra's ``instantiate``: its ``_target_`` with the other keys as
    arguments); a clear error naming the key when it cannot be built or is not an ``Environment``."""
    from hydra.utils import instantiate

    spec = dict(env_cfg.environment)
    try:
        env = instantiate(spec)
    except Exception as err:  # noqa: BLE001  (import errors, wrong arguments: all of them the config's fault)
        cause = err.__cause__ or err
        raise ValueError(f"env.environment: cannot build {spec.get('_target_')!r}: {type(cause).__name__}: "
                         f"{cause}") from err
    if not isinstance(env, Environment):
        raise ValueError(f"env.environment: {spec.get('_target_')!r} built a {type(env).__name__}, not an "
                         "r3rl.env.Environment")
    return env
