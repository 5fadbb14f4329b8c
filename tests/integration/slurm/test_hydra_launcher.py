"""`python run.py -m hydra/launcher=ray_slurm ...`: a sweep through hydra-submitit-launcher, one Slurm job per run,
each with its own Ray cluster (slurm/ray_up.sh around slurm/ray.sub) that is gone when the run ends."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from slurm_testbed import REPO

pytestmark = pytest.mark.integration


def test_sweep_runs_one_job_per_run_each_with_its_own_ray(slurm, launch):
    sweep = launch.root / "sweep"
    cmd = [
        sys.executable, "run.py", "-m", "hydra/launcher=ray_slurm",
        "ray.address=auto", "parallelism=cpu", "run.dry_run=true", "rollout=vllm,vllm_r3",
        f"hydra.sweep.dir={sweep}", "hydra.launcher.gpus_per_node=4", "hydra.launcher.timeout_min=10",
        # both runs would land on the same machine here; on a cluster they run side by side on separate nodes
        "hydra.launcher.array_parallelism=1",
    ]
    env = {**slurm.env, **launch.env}
    env.pop("LOG_ROOT")  # the launcher config puts the Ray logs next to submitit's
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    logs = sorted((sweep / ".submitit").glob("*-logs"))
    assert len(logs) == 2, sorted(p.name for p in (sweep / ".submitit").iterdir())
    for log_dir in logs:
        job = log_dir.name.removesuffix("-logs")
        # the sweep returns once the runs' results are written; the batch scripts then stop their clusters
        info = slurm.wait_job(job, 120)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
        launcher = (log_dir / "launcher.log").read_text()
        assert "phase cluster-ready" in launcher
        assert "phase done: exit code 0" in launcher
        assert "GPU" in (log_dir / "ray-cluster.json").read_text()
        assert f"stopped: no Ray process of {job}." in (log_dir / f"ray-head-{info['NodeList']}.log").read_text()
        launch.assert_nothing_left(job)

    plans = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(plans) == 2
    names = set()
    for plan in plans:
        text = plan.read_text()
        # the run attached to its job's cluster instead of starting one of its own
        assert re.search(r"\nray:\n\s+address: auto\n", text), text[-2000:]
        names.update(re.findall(r"launch plan: (\S+)", text))
    assert names == {"tiny_moe-cpu-vllm", "tiny_moe-cpu-vllm_r3"}
