"""The local Ray cluster of a run takes Ray's token authentication with a token of the run's own
(``r3rl.orchestration.ray_cluster.use_token_auth``); the two-host test bed checks the Slurm cluster's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

# the run's side: start the local cluster as a recipe does, then try to join it from two other processes
DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys
    import ray
    from r3rl.config import compose
    from r3rl.orchestration.ray_cluster import start_or_attach
    from r3rl.plan import build_plan

    cfg = compose(["parallelism=cpu"])
    cluster = start_or_attach(cfg, build_plan(cfg))
    address = ray.get_runtime_context().gcs_address
    modes = {"ours": oct(cluster.temp_dir.stat().st_mode & 0o777),
             "ray": oct((cluster.temp_dir / "r").stat().st_mode & 0o777)}
    # a client without the right token retries its handshake for longer than the test waits
    join = "import ray, sys; ray.init(address=sys.argv[1]); print('joined')"
    out, procs = {}, {}
    try:
        for name, token in (("stranger", None), ("wrong", "0" * 64), ("run", os.environ["RAY_AUTH_TOKEN"])):
            env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
            if token is not None:
                env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
            procs[name] = subprocess.Popen([sys.executable, "-c", join, address], env=env, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, p in procs.items():  # side by side: the refused ones each wait out the timeout
            try:
                stdout, stderr = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
            out[name] = {"rc": p.returncode, "joined": "joined" in stdout, "log": stderr[-3000:]}
    finally:
        cluster.shutdown()
    print(json.dumps({**out, "modes": modes}))
""")


def test_a_client_without_the_runs_token_cannot_join_its_local_cluster(tmp_path):
    """Fails if the local cluster started without token authentication (anyone on the machine could then reach
    its loopback ports and run code in the run's workers), if a wrong token got in, if the token went to a file
    under the home folder (Ray's default), or if the run's own processes could not join; or if Ray's temp dir (which
    Ray makes world-writable) is not inside a 0700 folder of the run's (issue 59 item 4)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # where Ray would write ~/.ray/auth_token
    out = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["run"]["joined"], result["run"]["log"]
    for name in ("stranger", "wrong"):
        assert not result[name]["joined"], name
        assert "Authentication" in result[name]["log"] or "InvalidAuthToken" in result[name]["log"], result[name]
    assert not (tmp_path / ".ray").exists()
    # Ray makes its temp dir 0777; the run's folder around it stays 0700, so its sockets are the user's alone
    assert result["modes"] == {"ours": "0o700", "ray": "0o777"}, result["modes"]
