"""slurm/ray.sub and the recipe on two hosts (network namespaces joined by a veth pair): Ray across both, the
trainer on host A and the vLLM engine on host B reached at B's address, and a host that dies mid-run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from r3rl import checkpoint
from r3rl import metrics as M
from r3rl.tracking.offline_reader import read_runs

pytestmark = pytest.mark.integration
slow = pytest.mark.slow

JOB_TIMEOUT = 240
RUN_TIMEOUT = 900
# these runs are about placement and transport: the random model without the SFT warm start (which scale/cpu_2n.yaml
# inherits from scale/cpu.yaml), partial credit so its steps still train
PLUMBING = ("warm_start.enabled=false", "data.partial_credit=0.1")


# what a stranger on the cluster network tries: each request must come back 401 without the run's engine token
STRANGER = textwrap.dedent("""
    import json, sys, httpx
    url = sys.argv[1]
    calls = [("POST", "/pause", {"params": {"mode": "wait"}}), ("POST", "/collective_rpc", {"json": {"method": "x"}}),
             ("POST", "/update_weights", {"json": {}}), ("POST", "/inference/v1/generate", {"json": {}})]
    print(json.dumps({path: httpx.request(m, url + path, timeout=30, **kw).status_code for m, path, kw in calls}))
""")
JOIN = "import ray, sys; ray.init(address=sys.argv[1]); print('joined')"


def assert_strangers_are_refused(launch2, job: str, a, b, engine_url: str) -> None:
    """From host A, requests to the engine on host B without the token; from host B, a Ray client without the
    job's token. Fails if the engine served any of them (its middleware missing, or /health-style exemptions
    grown), or if the client joined the cluster (Ray started without token authentication)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "R3RL_ENGINE_TOKEN"))}
    codes = subprocess.run([*a.exec_prefix(), sys.executable, "-c", STRANGER, engine_url], env=clean,
                           capture_output=True, text=True, timeout=120)
    assert codes.returncode == 0, codes.stderr[-2000:]
    assert set(json.loads(codes.stdout).values()) == {401}, codes.stdout
    address = re.search(r"head \S+ at (\S+),", launch2.launcher_log(job)).group(1)
    joiner = subprocess.Popen([*b.exec_prefix(), sys.executable, "-c", JOIN, address], env=clean, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = joiner.communicate(timeout=15)  # refused clients retry for longer than this
    except subprocess.TimeoutExpired:
        joiner.kill()
        stdout, stderr = joiner.communicate()
    assert "joined" not in stdout and ("InvalidAuthToken" in stderr or "Authentication" in stderr), stderr[-2000:]


def _wait_for(predicate, what: str, launch2, job: str, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        state = launch2.slurm.job(job).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} ended ({state}) before {what}:\n{launch2.output(job)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s:\n{launch2.output(job)[-4000:]}")
        time.sleep(1)
    return value


def test_two_node_job_brings_ray_up_on_both_hosts_and_tears_it_down(slurm2, launch2, hosts):
    a, b = hosts.hosts
    job = launch2.submit("--nodes=2", "--gres=gpu:1", overrides=("parallelism=cpu_2n", "run.dry_run=true"))
    info = slurm2.wait_job(job, JOB_TIMEOUT)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), launch2.output(job)

    logs = launch2.log_dir(job)
    report = json.loads((logs / "ray-cluster.json").read_text())
    assert report["cluster_resources"]["GPU"] == 2
    nodes = {n["slurm_node"]: n for n in report["nodes"]}
    assert sorted(nodes) == [a.name, b.name]
    for h in (a, b):
        # each host joined at its own address, with the GPU Slurm gave it there
        assert nodes[h.name]["node_ip"] == h.ip
        assert nodes[h.name]["ray_gpus"] == 1
        assert len(nodes[h.name]["cuda_visible_devices"].split(",")) == 1

    driver = (logs / "driver.log").read_text()
    assert f"address: {a.ip}:" in driver, driver
    # the plan of a 2-node job: engines bind to and are reached at their node's address, on a free port of that
    # node, both resolved there
    assert re.search(r"url: http://<ip of node 1>:<free port>\n\s+node: 1\n", driver), driver

    assert f"stopped: no Ray process of {job}.{a.name}.head left" in (logs / f"ray-head-{a.name}.log").read_text()
    assert f"stopped: no Ray process of {job}.{b.name}.worker left" in (logs / f"ray-worker-{b.name}.log").read_text()
    assert "phase done: exit code 0" in launch2.launcher_log(job)
    launch2.assert_nothing_left(job)


@slow
def test_recipe_trains_on_host_a_serves_from_host_b_and_ends_naming_b_when_it_dies(slurm2, launch2, hosts, tmp_path):
    """One job, two halves (one recipe start instead of two: a two-host start costs ~1.5 min on 2 cores).

    First, parallelism=cpu_2n trains: the trainer on host A, the vLLM engine on host B, one step off-policy
    (algorithm.max_staleness=1: B generates the next batch while A trains); rollouts with routed experts, replay, and
    weight sync all cross the veth, and W&B (offline) gets both mismatch metrics and the staleness at every step.
    Fails if the batch generated ahead lost its routes or version on the way, or if B skipped the sync before
    step 3's batch (its samples would be 2 versions old and dropped).

    Then host B loses every process at once, slurmd included. The job must end within 60 s with an error that names
    host B, and the checkpoint written before must be whole. Fails if the driver waited on the dead engine (or its
    producer thread) instead of ending the job. Runs last: host B stays dead."""
    a, b = hosts.hosts
    out = tmp_path / "run"
    job = launch2.submit("--nodes=2", "--gres=gpu:1", overrides=(
        "parallelism=cpu_2n", *PLUMBING, f"run.output_dir={out}", "run.num_steps=50", "run.save_every=1",
        "run.eval_every=0", "logger.wandb.mode=offline", "algorithm.max_staleness=1", "correction=tis"))
    trained = 3

    def checkpointed_step() -> int:
        return checkpoint.read_meta(checkpoint.latest(out)).step \
            if (checkpoint.checkpoint_root(out) / "latest").is_file() else 0

    _wait_for(lambda: checkpointed_step() >= trained, f"step {trained}'s checkpoint", launch2, job, RUN_TIMEOUT)

    table = json.loads((out / "processes.json").read_text())
    [engine] = table["engines"]
    assert engine["url"].startswith(f"http://{b.ip}:") and engine["node"] == b.name, engine
    assert [t["node"] for t in table["trainers"]] == [a.name], table["trainers"]
    assert_strangers_are_refused(launch2, job, a, b, engine["url"])

    killed = hosts.kill_host(b)
    t0 = time.monotonic()
    assert killed, "host B ran nothing"
    deadline = t0 + 120
    while not (done := re.search(r"phase done: exit code (\d+)", launch2.launcher_log(job))):
        assert time.monotonic() < deadline, f"the job did not end within 120 s:\n{launch2.output(job)[-6000:]}"
        time.sleep(0.5)
    elapsed = time.monotonic() - t0
    text = launch2.output(job)
    assert done.group(1) != "0", text[-6000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after host B died:\n{text[-6000:]}"
    assert re.search(rf"error: .*{b.name}", text), text[-6000:]
    print(f"host B killed: the job's launcher ended {elapsed:.1f} s later")

    # the steps trained before B died, as W&B recorded them
    [run] = read_runs(out)
    steps = {row["_step"]: row for row in run.history if M.LOGPROB_ABS_DIFF in row}
    assert sorted(steps)[:trained] == list(range(1, trained + 1)), sorted(steps)
    for step, row in steps.items():
        for key in (M.LOGPROB_ABS_DIFF_NO_REPLAY, M.perf_time_key("weight_sync")):
            assert key in row, f"step {step} lacks {key}"
        # the routes came back from host B and Megatron on host A replayed exactly them
        assert row[M.REPLAY_MISMATCH_ROWS] == 0.0
        assert row[M.STALENESS_MAX] == (0 if step == 1 else 1) and row[M.DROPPED_STALE] == 0
    assert steps[2][M.perf_time_key("weight_sync")] > 0  # before step 3's batch, across the veth

    # the job's tokens: each in its 0600 file, in no other file the run or the job wrote
    engine_token, ray_token = out / "engine_token", launch2.log_dir(job) / "ray_auth_token"
    for token_file in (engine_token, ray_token):
        assert token_file.stat().st_mode & 0o777 == 0o600
        secret = token_file.read_bytes()
        written = [p for root in (out, launch2.log_dir(job)) for p in root.rglob("*") if p.is_file()]
        assert not [str(p) for p in written if p not in (engine_token, ray_token) and secret in p.read_bytes()]

    ckpt = checkpoint.latest(out)
    meta = checkpoint.read_meta(ckpt)
    assert meta.step >= trained and any((ckpt / "trainer").iterdir()), ckpt
    launch2.assert_nothing_left(job, dead=b.name)
    # what an admin does with a node that died: Slurm stops waiting for it to finish the job
    slurm2.run("scontrol", "update", f"nodename={b.name}", "state=down", "reason=killed by the test")
