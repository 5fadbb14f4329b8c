"""slurm/ray.sub against a real Slurm: the job's exit state, the GPUs Ray saw, the logs folder, signals, failures,
interactive mode, and that nothing of a job is left running afterwards."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from slurm_testbed import REPO

pytestmark = pytest.mark.integration

JOB_TIMEOUT = 240


def test_single_node_job_gets_slurms_gpus_and_cleans_up(slurm, launch):
    """GPUs 0-3 of n1 are taken by another job, so Slurm gives this one 4-7: Ray must hand out exactly those
    (not 0-3, which Ray would number by itself), and the driver must get the shape Slurm gave."""
    blocker = slurm.sbatch(f"--output={launch.root}/blocker-%j.out", "--gres=gpu:4", "-w", "n1", "--wrap", "sleep 600")
    slurm.wait_job(blocker, 60, states={"RUNNING"})
    out_dir = launch.root / "out"
    job = launch.submit("--gres=gpu:4", "-w", "n1",
                        overrides=("parallelism=cpu", "run.dry_run=true", f"run.output_dir={out_dir}"))
    info = slurm.wait_job(job, JOB_TIMEOUT)
    slurm.run("scancel", blocker)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), launch.output(job)

    logs = launch.log_dir(job)
    for name in ("launcher.log", "driver.log", "ray-head-n1.log", "ray-cluster.json", "ray-head-n1/raylet.out"):
        assert (logs / name).is_file(), f"{name} missing from {logs}: {sorted(p.name for p in logs.iterdir())}"

    report = json.loads((logs / "ray-cluster.json").read_text())
    assert report["cluster_resources"]["GPU"] == 4
    [node] = report["nodes"]
    assert node["slurm_node"] == "n1"
    assert node["ray_gpus"] == 4
    assert sorted(node["cuda_visible_devices"].split(",")) == ["4", "5", "6", "7"], node
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in launch.launcher_log(job)

    driver = (logs / "driver.log").read_text()
    gcs = launch.env["GCS_PORT"]
    # the plan printed by the driver carries Slurm's shape and the job's own Ray head
    assert re.search(rf"address: 127\.0\.0\.1:{gcs}\n\s+gpus: 4\n", driver), driver
    assert f"output_dir: {out_dir}" in driver

    head_log = (logs / "ray-head-n1.log").read_text()
    assert f"stopped: no Ray process of {job}.n1.head left" in head_log
    assert "outlived ray start" not in head_log, "Ray did not stop by itself on SIGTERM"
    assert "phase done: exit code 0" in launch.launcher_log(job)
    launch.assert_nothing_left(job)
    launch.assert_nothing_left(blocker)


@pytest.mark.parametrize("cause", ["port-taken", "ray-start-fails"])
def test_head_that_cannot_start_fails_the_job_with_a_clear_message(slurm, launch, cause):
    env = {}
    holder = None
    if cause == "port-taken":
        # what a Ray left over by an earlier job, or another user's, looks like to this one
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", int(launch.env["GCS_PORT"])))
        holder.listen()
        expected = (r"the Ray head could not start on n1 \(exit code 1\): "
                    rf"port\(s\) already in use on n1: GCS_PORT={launch.env['GCS_PORT']}")
    else:
        env["EXTRA_RAY_ARGS"] = "--object-store-memory=1000"
        expected = (r"the Ray head (could not start on n1 \(exit code 1\)|on n1 stopped during start-up): "
                    r"ValueError: .*object store memory")
    try:
        t0 = time.monotonic()
        job = launch.submit("--gres=gpu:2", "-w", "n1", overrides=("parallelism=cpu", "run.dry_run=true"), env=env)
        info = slurm.wait_job(job, 150)
        elapsed = time.monotonic() - t0
    finally:
        if holder is not None:
            holder.close()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), launch.output(job)
    assert re.search(r"error: " + expected, launch.output(job)), launch.output(job)
    assert re.search(r"error: " + expected, launch.launcher_log(job))
    # it gave up on its own, well before the 120 s HEAD_START_TIMEOUT and without starting a driver
    assert elapsed < 100, f"the job took {elapsed:.0f}s to fail"
    assert not (launch.log_dir(job) / "driver.log").exists()
    launch.assert_nothing_left(job)


def test_node_that_does_not_join_fails_the_job_early(slurm, launch):
    """Two nodes on one machine: the head starts on n1, but n2 cannot join. Its port check finds n1's Ray on the
    same fixed ports (on a cluster they are different hosts), or, if it runs before n1's raylet binds them, Ray
    refuses a worker node that is kept on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0). Either way the job must
    say so and name n2, not wait for the 120 s join timeout nor hang in the driver."""
    t0 = time.monotonic()
    job = launch.submit("--nodes=2", "--gres=gpu:2", overrides=("parallelism=cpu", "run.dry_run=true"))
    info = slurm.wait_job(job, JOB_TIMEOUT)
    elapsed = time.monotonic() - t0
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), launch.output(job)
    assert re.search(r"error: the Ray worker on node n2 stopped before joining the cluster: "
                     r"(.*Multi-node Ray|port\(s\) already in use on n2: [A-Z_]+_PORT=)",
                     launch.output(job)), launch.output(job)
    assert elapsed < 100, f"the job took {elapsed:.0f}s to fail"
    logs = launch.log_dir(job)
    assert (logs / "ray-worker-n2.log").is_file()
    assert not (logs / "driver.log").exists()
    assert f"stopped: no Ray process of {job}.n1.head left" in (logs / "ray-head-n1.log").read_text()
    launch.assert_nothing_left(job)


def test_node_whose_ray_gpus_differ_from_slurms_fails_the_job(slurm, launch):
    """Ray told to use fewer GPUs than Slurm gave (a misconfigured node, a site's ray start flags): the placement
    would fail or hang much later, so the node check stops the job before the driver."""
    job = launch.submit("--gres=gpu:2", overrides=("parallelism=cpu", "run.dry_run=true"),
                        env={"EXTRA_RAY_ARGS": "--num-gpus=1"})
    info = slurm.wait_job(job, JOB_TIMEOUT)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), launch.output(job)
    assert re.search(r"error: the Ray cluster is not usable: node n\d has 1 GPUs in Ray but Slurm gave 2 per node",
                     launch.output(job)), launch.output(job)
    assert not (launch.log_dir(job) / "driver.log").exists()
    launch.assert_nothing_left(job)


def test_interactive_mode_writes_an_attach_script_that_runs_drivers(slurm, launch):
    job = launch.submit("--gres=gpu:2", "-w", "n2", env={"INTERACTIVE": "1"})
    attach = launch.root / f"{job}-attach.sh"
    launch.wait_for_file(attach, job, JOB_TIMEOUT)

    def run_attached(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(attach), *args], env=launch.slurm.env, cwd=launch.root,
                              capture_output=True, text=True, timeout=180)

    probe = run_attached("--exec", "python", "-m", "r3rl.orchestration.slurm_env", "probe")
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout[probe.stdout.index("{"):])
    assert seen["driver"]["slurm_job_id"] == job
    assert seen["cluster_resources"]["GPU"] == 2
    [node] = seen["nodes"]
    assert node["slurm_node"] == "n2"
    # the attached driver's step and Ray's GPU task see the same devices, the ones Slurm gave the job
    assert sorted(node["cuda_visible_devices"].split(",")) == sorted(seen["driver"]["cuda_visible_devices"].split(","))
    assert len(seen["driver"]["cuda_visible_devices"].split(",")) == 2
    # issue 59 item 4: Ray's session folder and the env file (which may hold a Ray token) are the user's alone
    ray_dir = Path(launch.env["RAY_TMP_ROOT"]) / f"r3rl-ray-{job}-n2"
    assert ray_dir.stat().st_mode & 0o777 == 0o700
    assert (launch.log_dir(job) / "ray.env").stat().st_mode & 0o777 == 0o600

    out_dir = launch.root / "attached-run"
    plan = run_attached("parallelism=cpu", "run.dry_run=true", f"run.output_dir={out_dir}")
    assert plan.returncode == 0, plan.stderr
    assert re.search(rf"address: 127\.0\.0\.1:{launch.env['GCS_PORT']}\n\s+gpus: 2\n", plan.stdout), plan.stdout

    # the node check of the launcher, asked for a node this cluster does not have, gives up with a message
    missing = run_attached("--exec", "python", "-m", "r3rl.orchestration.slurm_env", "wait",
                           "--address", f"127.0.0.1:{launch.env['GCS_PORT']}", "--nodes", "2", "--timeout", "3",
                           "--no-probe")
    assert missing.returncode == 3, missing.stdout + missing.stderr
    assert "only 1 of 2 nodes joined the Ray cluster within 3s" in missing.stdout

    assert slurm.job(job)["JobState"] == "RUNNING"
    slurm.run("scancel", job)
    info = slurm.wait_job(job, 120)
    assert info["JobState"] == "CANCELLED"
    assert "stopping the interactive cluster (SIGTERM)" in launch.launcher_log(job)
    assert f"stopped: no Ray process of {job}.n2.head left" in (launch.log_dir(job) / "ray-head-n2.log").read_text()
    launch.assert_nothing_left(job)


DRIVER = """\
import json, os, signal, sys, time
import ray

ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
out = sys.argv[1]


def on_term(signum, frame):
    # what the recipe does on SIGTERM (save a checkpoint) needs the cluster: it must still be there
    json.dump({"signal": signum, "gpus": ray.cluster_resources().get("GPU"),
               "setup": os.environ.get("R3RL_TEST_SETUP")}, open(out, "w"))
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
open(out + ".ready", "w").write("ready")
while True:
    time.sleep(0.2)
"""


def test_sigterm_to_the_job_reaches_the_driver_while_ray_is_up(slurm, launch):
    """`scancel --batch --signal=TERM` is what `#SBATCH --signal=B:TERM@120` does before the time limit."""
    driver = launch.root / "driver.py"
    driver.write_text(DRIVER)
    seen = launch.root / "sigterm.json"
    job = launch.submit("--gres=gpu:2", env={"COMMAND": f"python {driver} {seen}",
                                             "SETUP_COMMAND": "export R3RL_TEST_SETUP=done"})
    launch.wait_for_file(Path(f"{seen}.ready"), job, JOB_TIMEOUT)
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    info = slurm.wait_job(job, 120)
    # the driver exited cleanly after its checkpoint, and the job still reports that it was interrupted
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "143:0"), launch.output(job)
    # SETUP_COMMAND ran in the launcher before the driver started
    assert json.loads(seen.read_text()) == {"signal": 15, "gpus": 2.0, "setup": "done"}
    log = launch.launcher_log(job)
    assert "received SIGTERM: forwarding SIGTERM to the driver" in log
    assert "driver stopped after SIGTERM (exit code 0)" in log
    launch.assert_nothing_left(job)


def test_launcher_refuses_to_run_outside_a_job():
    done = subprocess.run(["bash", str(REPO / "slurm" / "ray.sub")], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert done.returncode != 0
    assert "runs inside a Slurm job" in done.stderr
