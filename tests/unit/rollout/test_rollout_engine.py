"""Engine launch arguments from the plan, and the launcher's and client's refusals that need no vLLM server:
a port already taken, a bad attach URL, an engine that is not there."""

from __future__ import annotations

import shlex
import socket
import sys
from pathlib import Path

import pytest

from r3rl.config.schema import SamplingConfig
from r3rl.plan import build_plan
from r3rl.rollout.client import RolloutClient
from r3rl.rollout.engine import EngineError, VLLMEngine, local_command


def test_r3_engine_argv_has_what_routed_experts_need(compose_cfg):
    plan = build_plan(compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout=vllm_r3"))
    (engine,) = plan.engines
    argv = list(engine.argv)
    for flag in ("--enable-return-routed-experts", "--enable-scale-out", "--enable-prefix-caching",
                 "--no-async-scheduling", "--enable-prompt-tokens-details"):
        assert flag in argv
    assert argv[argv.index("--worker-extension-cls") + 1] == "r3rl.sync.worker_extension.R3RLWorkerExtension"
    assert engine.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert engine.env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and engine.env["TRITON_INTERPRET"] == "1"
    # the worker swaps MRv2's per-step kernels for torch (r3rl.cpu_only.vllm_mrv2_kernels), only on the CPU profile
    assert engine.env["R3RL_MRV2_TORCH_KERNELS"] == "1"
    # rollout.engine.cpu_threads (1 on the CPU scale) reaches torch through OMP_NUM_THREADS; unset: torch's default
    assert engine.env["OMP_NUM_THREADS"] == "1"
    (default,) = build_plan(compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout.engine.cpu_threads=null")).engines
    assert "OMP_NUM_THREADS" not in default.env


def test_batch_limits_reach_vllm_only_when_set(compose_cfg):
    """rollout.engine.max_num_seqs / max_num_batched_tokens become vLLM's flags (the CPU scale sets both, so an eval
    wave runs in one engine step with its prefill unchunked); null leaves vLLM's device default, so a GPU layout keeps
    vLLM's tuned values. Fails if a key were dropped from the argv or a null one passed as "None"."""
    cfg = compose_cfg("model=tiny_moe", "parallelism=cpu")
    (cpu,) = build_plan(cfg).engines
    argv = list(cpu.argv)
    assert cfg.rollout.engine.max_num_seqs is not None and cfg.rollout.engine.max_num_batched_tokens is not None
    assert argv[argv.index("--max-num-seqs") + 1] == str(cfg.rollout.engine.max_num_seqs)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(cfg.rollout.engine.max_num_batched_tokens)
    for engine in build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4")).engines:
        assert "--max-num-seqs" not in engine.argv and "--max-num-batched-tokens" not in engine.argv
    with pytest.raises(ValueError, match="rollout.engine.max_num_seqs"):
        compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout.engine.max_num_seqs=0")


def test_non_r3_engine_keeps_the_configured_prefix_caching(compose_cfg):
    (engine,) = build_plan(compose_cfg("model=tiny_moe", "parallelism=cpu", "rollout=vllm")).engines
    argv = shlex.join(engine.argv)
    assert "--enable-return-routed-experts" not in argv and "--no-enable-prefix-caching" in argv
    assert "--worker-extension-cls" in argv


def test_cpu_profile_never_on_a_gpu_parallelism(compose_cfg):
    plan = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4", "rollout=vllm_r3"))
    for engine in plan.engines:
        assert "TRITON_INTERPRET" not in engine.env and engine.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
        assert "R3RL_MRV2_TORCH_KERNELS" not in engine.env and "OMP_NUM_THREADS" not in engine.env
        assert engine.env["CUDA_VISIBLE_DEVICES"]


def test_engine_commands_run_from_this_environment(compose_cfg):
    (cpu,) = build_plan(compose_cfg("model=tiny_moe", "parallelism=cpu")).engines
    (gpu,) = build_plan(compose_cfg("model=qwen3_30b", "parallelism=disaggregated_4p4")).engines
    assert local_command(cpu.argv)[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    own = Path(sys.executable).parent / "vllm"
    assert local_command(gpu.argv)[:2] == [str(own) if own.exists() else "vllm", "serve"]
    assert local_command(gpu.argv)[2:] == list(gpu.argv[2:])


def test_launch_refuses_a_port_someone_listens_on(compose_cfg, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = compose_cfg("model=tiny_moe", "parallelism=cpu", f"rollout.engine.base_port={port}")
        with pytest.raises(EngineError, match=f"port {port} .* already in use"):
            VLLMEngine.launch(build_plan(cfg).engines[0], tmp_path, 10)
    assert not list(tmp_path.iterdir())  # nothing was started


_HEALTH_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_free_port_taken_before_the_server_binds_it_is_replaced(monkeypatch, tmp_path):
    """The race of free ports: the port the launcher picked is bound by someone else before the server binds it.
    The race cannot be caused on cue, so the launcher is handed a port another socket holds bound (not listening:
    the launcher's own in-use check passes, the server's bind fails with EADDRINUSE). A real server process (a
    stand-in answering /health; no vLLM needed to bind) then comes up on the next free port. Fails if the launch
    gives up on the first bind error, retries a pinned port, or leaves the placeholder in the server's argv."""
    import r3rl.rollout.engine as engine_mod
    from r3rl.net import free_port
    from r3rl.plan import FREE_PORT, EngineLaunch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(engine_mod, "free_port", lambda host: next(ports, None) or free_port(host))
    launch = EngineLaunch(index=0, node=0, gpus=(), host="127.0.0.1", port=None, env={},
                          argv=("python", "-c", _HEALTH_SERVER, "--port", FREE_PORT))
    try:
        engine = VLLMEngine.launch(launch, tmp_path, 30, check=False)
    finally:
        held.close()
    try:
        port = int(engine.url.rsplit(":", 1)[1])
        assert port != taken
        logs = sorted(p.name for p in tmp_path.iterdir())
        assert len(logs) == 2 and logs[1] != logs[0]  # one log per port tried: the failed bind is kept
        assert "Address already in use" in (tmp_path / f"engine0-{taken}.log").read_text()
        assert f"engine0-{port}.log" in logs
    finally:
        engine.shutdown()
    pinned = EngineLaunch(index=0, node=0, gpus=(), host="127.0.0.1", port=free_port(), env={},
                          argv=("python", "-c", "import sys; sys.exit('Address already in use')"))
    with pytest.raises(EngineError, match="exited with code"):
        VLLMEngine.launch(pinned, tmp_path / "pinned", 30, check=False)
    assert len(list((tmp_path / "pinned").iterdir())) == 1  # a pinned port is the user's: never another


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attach_needs_a_url_and_a_live_server():
    with pytest.raises(EngineError, match="expected http://HOST:PORT"):
        VLLMEngine.attach("localhost:8000")
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(EngineError, match=f"engine at {url} did not answer /health"):
        VLLMEngine.attach(url, timeout_s=1)


def test_client_names_an_engine_that_is_not_there():
    url = f"http://127.0.0.1:{_closed_port()}"
    client = RolloutClient([url], num_layers=4, topk=2, num_experts=8, routing_replay=True, progress=False)
    with pytest.raises(EngineError, match=f"engine {url} failed during sample 0"):
        client.generate_sync([[1, 2, 3]], 1, SamplingConfig(max_tokens=4))


def test_start_up_check_reads_the_route_shape_from_the_served_checkpoint(tiny_model_dir, tmp_path):
    from r3rl.rollout.probe import spec_from_checkpoint

    spec = spec_from_checkpoint(tiny_model_dir)
    assert (spec.num_layers, spec.topk, spec.num_experts) == (4, 2, 8)
    assert spec_from_checkpoint(tmp_path) is None  # no config.json: the client's check (from the config) remains
