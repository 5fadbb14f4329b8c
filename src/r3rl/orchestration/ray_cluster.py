"""Attach to a running Ray cluster or start a local one, and stop only what was started here."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from r3rl.config.schema import R3RLConfig
from r3rl.plan import LaunchPlan
from r3rl.platform import version_tuple


class ClusterError(RuntimeError):
    pass


# Ray's token authentication (RAY_AUTH_MODE=token, and the AuthenticationTokenLoader ``use_token_auth`` resets)
# first shipped in 2.52: before it a local run died at import and a Slurm run ran silently without authentication
MIN_RAY = (2, 52)


def ray_version_problem(version: str) -> str | None:
    """Why the installed Ray (``version``) cannot run r3rl, or None."""
    if version_tuple(version)[:2] >= MIN_RAY:
        return None
    need = ".".join(map(str, MIN_RAY))
    return (f"Ray {version} is installed; r3rl needs ray>={need}, the first release with token authentication "
            f"(without it a run's cluster takes any client): pip install 'ray[default]>={need},<3', or make venv")


@dataclass
class RayCluster:
    started_here: bool
    temp_dir: Path | None

    def shutdown(self) -> None:
        import ray

        # ray.shutdown() ends the processes of a cluster this driver started and only detaches from an attached one.
        if ray.is_initialized():
            ray.shutdown()
        if self.started_here and self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def use_token_auth(*, attaching: bool) -> None:
    """Ray's token authentication (``RAY_AUTH_MODE=token``): a client without the cluster's token can neither join
    nor submit work. A local cluster gets a token of its own, in this process's environment only (its raylet and
    workers inherit it; no file under the home folder, where Ray would write one). An attached cluster's settings
    come from the environment (``slurm/ray.sub`` exports ``RAY_AUTH_TOKEN_PATH`` to a 0600 file of the job's);
    without a token there, the client connects as before. ``RAY_AUTH_MODE`` set by the user is kept either way."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if attaching:
        has_token = bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"))
        os.environ["RAY_AUTH_MODE"] = "token" if has_token else "disabled"
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # Ray reads both once per process and caches them (an import of a Ray module can be enough): read them again
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def start_or_attach(cfg: R3RLConfig, plan: LaunchPlan) -> RayCluster:
    import ray

    problem = ray_version_problem(ray.__version__)
    if problem:  # before anything starts, attached clusters included
        raise ClusterError(problem)
    use_token_auth(attaching=bool(cfg.ray.address))
    # listeners on loopback for a local cluster
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    need = len(plan.placement.trainer) + (0 if plan.placement.colocated else
                                          sum(len(e.gpus) for e in plan.placement.engines))
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, namespace="r3rl", log_to_driver=True)
        cluster = RayCluster(started_here=False, temp_dir=None)
    else:
        # Ray's unix socket paths must stay short: a temp folder under /tmp, not under the run folder.
        temp = Path(cfg.ray.temp_dir) if cfg.ray.temp_dir else Path(tempfile.mkdtemp(prefix="r3rl-ray-"))
        num_gpus = plan.ray_num_gpus if plan.placement.logical_gpus else None
        ray.init(
            num_cpus=cfg.ray.num_cpus or os.cpu_count(),
            num_gpus=num_gpus,
            include_dashboard=False,
            # Ray makes its temp dir world-writable (0777) for multi-user machines: inside a 0700 folder of
            # ours (mkdtemp's), other users cannot reach its sockets and objects
            _temp_dir=str(temp if cfg.ray.temp_dir else temp / "r"),
            _node_ip_address="127.0.0.1",
            namespace="r3rl",
            log_to_driver=True,
        )
        cluster = RayCluster(started_here=True, temp_dir=temp if not cfg.ray.temp_dir else None)
    have = ray.cluster_resources().get("GPU", 0)
    if have < need:
        cluster.shutdown()
        raise ClusterError(
            f"the Ray cluster has {have:g} GPUs but parallelism={cfg.parallelism.name} needs {need} "
            f"(trainer {len(plan.placement.trainer)}, rollout {sum(len(e.gpus) for e in plan.placement.engines)}"
            f"{', shared' if plan.placement.colocated else ''}); change parallelism or the cluster"
        )
    return cluster
