"""The trainer's weights as HF-named tensors, streamed bucket by bucket: no rank ever holds the whole model.

Every rank knows the whole model's plan (one small metadata exchange at construction): each Megatron parameter as
full HF tensors, in one canonical order, the global rank that owns it (tensor-parallel rank 0 of the first
data-parallel replica that holds it) and the bucket it falls in (``bucket_bytes`` of full tensors each). Streaming
walks the plan: a parameter split over tensor-parallel ranks is all-gathered in that TP group only when its bucket
comes up, and the full tensor is either kept by its owner (``stream(dst=None)``: every rank writes its own share, as
the HF export does) or sent point to point to one rank (``stream(dst=0)``: the weight-transfer sender). A bucket is
dropped as soon as the caller moves on, so a rank holds at most its own parameters plus one bucket.

Every collective here follows the same global order on every rank, so the TP all-gathers and the owner->sender
sends cannot cross. Conversion is ``r3rl.train.convert``'s mapping; this module only decides who gathers what, when.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from r3rl.train import lora
from r3rl.train.convert import (
    TOKENIZER_AND_CONFIG,
    HFCheckpoint,
    HFLayout,
    ParamRef,
    ShardInfo,
    full_to_hf,
    layer_numbers,
    named_weights,
    parse_name,
    partition_dim,
    unshard,
)

# canonical order inside a layer (HF's own file order does not matter to loaders; a fixed one keeps ranks in step)
_KIND_ORDER = {k: i for i, k in enumerate(
    ("embed", "input_norm", "qkv", "qkv_bias", "q_full", "q_down", "q_norm", "q_latent_norm", "q_up", "kv_down",
     "kv_latent_norm", "kv_up", "k_norm", "proj", "pre_mlp_norm", "dense_fc1", "dense_fc2",
     "router", "router_bias", "shared_fc1", "shared_fc2", "fc1", "fc2", "final_norm", "output"))}


@dataclass(frozen=True)
class TensorMeta:
    """One HF tensor as the engine receives it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix (what vLLM's update_info carries)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class PlanItem:
    """One Megatron parameter of the whole model: its full shape, owner rank and HF tensors."""

    ref: ParamRef
    owner: int
    full_shape: tuple[int, ...]
    hf: tuple[TensorMeta, ...]

    @property
    def order(self) -> tuple:
        layer = -1 if self.ref.kind == "embed" else (1 << 30 if self.ref.layer is None else self.ref.layer)
        return (layer, _KIND_ORDER[self.ref.kind], -1 if self.ref.expert is None else self.ref.expert)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.hf)


@dataclass
class StreamStats:
    """What one ``stream`` call held: the largest bucket/working set in bytes on this rank, and totals."""

    peak_bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    bytes_out: int = 0
    _held: int = field(default=0, repr=False)

    def hold(self, nbytes: int) -> None:
        self._held += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)

    def release(self, nbytes: int) -> None:
        self._held -= nbytes


def _nbytes(fulls: list[tuple[PlanItem, torch.Tensor]]) -> int:
    return sum(full.numel() * full.element_size() for _, full in fulls)


def _hf_meta(ref: ParamRef, full_shape: tuple[int, ...], dtype: torch.dtype, shape: HFLayout
             ) -> tuple[TensorMeta, ...]:
    # the mapping run on a meta tensor: names and shapes without touching memory
    pieces = full_to_hf(ref, torch.empty(full_shape, dtype=dtype, device="meta"), shape)
    return tuple(TensorMeta(n, tuple(t.shape), str(dtype).removeprefix("torch.")) for n, t in pieces.items())


class HFBucketStream:
    """Bucketed HF export of a (possibly TP/EP/PP-sharded) bare GPTModel. Construction is collective."""

    def __init__(self, model, shape: HFLayout, bucket_bytes: int, info: ShardInfo | None = None):
        from megatron.core import parallel_state as ps

        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (rollout.weight_sync.bucket_mb)")
        self.shape = shape
        self.bucket_bytes = bucket_bytes
        info = info or ShardInfo.current(model)
        self.info = info
        self.distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self._ps = ps
        dense_first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        expert_first = ps.get_expert_data_parallel_rank() == 0
        layers = layer_numbers(model)
        offset = info.ep_rank * info.num_local_experts
        # this rank's parameters by identity; the TP gather runs only in the first replica's TP groups
        self._local: dict[ParamRef, tuple[torch.nn.Parameter, int | None, bool]] = {}
        owned: list[PlanItem] = []
        for name, param in named_weights(model):
            ref = parse_name(name, layers, offset)
            expert = ref.kind in ("fc1", "fc2")
            size, tp_rank = info.of(ref)
            pdim = partition_dim(param)
            first_replica = expert_first if expert else dense_first
            self._local[ref] = (param, pdim, first_replica)
            if first_replica and tp_rank == 0:
                full = list(param.shape)
                if pdim is not None and size > 1:
                    full[pdim] *= size
                owned.append(PlanItem(ref, self.rank, tuple(full), _hf_meta(ref, tuple(full), param.dtype, shape)))
        parts = [owned]
        if self.distributed:
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, owned)
        items = sorted((i for p in parts for i in p), key=lambda i: i.order)
        names = [t.name for i in items for t in i.hf]
        if len(set(names)) != len(names):
            raise RuntimeError("two ranks claim the same HF tensor; the parallel layout is inconsistent")
        self.items = items
        self.buckets: list[list[PlanItem]] = []
        size = 0
        for item in items:
            if not self.buckets or (self.buckets[-1] and size + item.nbytes > bucket_bytes):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(item)
            size += item.nbytes
        self.stats = StreamStats()

    # ------------------------------------------------------------------------------------------------ plan

    def metadata(self) -> list[TensorMeta]:
        """Every HF tensor of the whole model, in stream order (the same list on every rank)."""
        return [t for item in self.items for t in item.hf]

    def bucket_parts(self) -> list[list[tuple[int, list[TensorMeta]]]]:
        """Per bucket, ``(owner rank, its tensors)`` by rank: what ``stream(dst=None)`` yields on each owner, so a
        rank that sends only its own part can be announced by another (the same lists on every rank)."""
        out = []
        for bucket in self.buckets:
            parts: dict[int, list[TensorMeta]] = {}
            for item in bucket:
                parts.setdefault(item.owner, []).extend(item.hf)
            out.append(sorted(parts.items()))
        return out

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    # ------------------------------------------------------------------------------------------------ stream

    def _full(self, item: PlanItem) -> torch.Tensor | None:
        """The full Megatron tensor on the owner (None elsewhere); TP ranks of the owner's replica join the gather."""
        local = self._local.get(item.ref)
        if local is None:
            return None
        param, pdim, first_replica = local
        if not first_replica:
            return None
        size, _ = self.info.of(item.ref)
        data = lora.effective(param)  # an adapted weight goes out merged: W + (alpha / r) B A
        if pdim is not None and size > 1:
            expert = item.ref.kind in ("fc1", "fc2")
            group = self._ps.get_expert_tensor_parallel_group() if expert else \
                self._ps.get_tensor_model_parallel_group()
            pieces = [torch.empty_like(data) for _ in range(size)]
            torch.distributed.all_gather(pieces, data.contiguous(), group=group)
            gathered = sum(p.numel() * p.element_size() for p in pieces)
            self.stats.hold(gathered)  # the pieces and, at the peak, the full tensor made of them
            data = unshard(pieces, item.ref, pdim)
            self.stats.hold(data.numel() * data.element_size())
            self.stats.release(gathered + data.numel() * data.element_size())
        return data if item.owner == self.rank else None

    def stream(self, dst: int | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield one list of ``(hf_name, full tensor)`` per bucket, on every rank (collective: iterate to the end).

        ``dst=None``: each rank gets the tensors it owns. ``dst=r``: rank r gets every tensor of the bucket, the
        others get empty lists; the owners' sends of bucket k+1 are already in flight while the caller handles
        bucket k (sends it on to the engines), so rank r holds at most two buckets. Tensors stay on the parameters'
        device and may be views of live parameters (read them, never write them); a bucket is freed when the next
        is made.
        """
        self.stats = StreamStats()
        if dst is None:
            for bucket in self.buckets:
                fulls = [(item, full) for item in bucket if (full := self._full(item)) is not None]
                held = _nbytes(fulls)
                self.stats.hold(held)
                yield self._emit(fulls)
                del fulls
                self.stats.release(held)
            return
        ahead = self._gather(self.buckets[0], dst) if self.buckets else []
        for k in range(len(self.buckets)):
            for _, _, work in ahead:
                if work is not None:
                    work.wait()
            current = [(item, full) for item, full, _ in ahead if full is not None and self.rank == dst]
            ahead = self._gather(self.buckets[k + 1], dst) if k + 1 < len(self.buckets) else []
            yield self._emit(current)
            held = _nbytes(current)
            del current
            self.stats.release(held)

    def _gather(self, bucket: list[PlanItem], dst: int) -> list[tuple[PlanItem, torch.Tensor | None, object]]:
        """Start moving ``bucket`` to ``dst``: each tensor with its send or receive still in flight (or None)."""
        out = []
        for item in bucket:
            full, work = self._full(item), None
            if item.owner != dst:
                if self.rank == item.owner:
                    full = full.contiguous()  # kept until its send has completed
                    work = torch.distributed.isend(full, dst=dst)
                elif self.rank == dst:
                    full = torch.empty(item.full_shape, dtype=getattr(torch, item.hf[0].dtype), device=self._device())
                    work = torch.distributed.irecv(full, src=item.owner)
            if full is not None and self.rank == dst:
                self.stats.hold(full.numel() * full.element_size())
            out.append((item, full, work))
        return out

    def _emit(self, fulls: list[tuple[PlanItem, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = [pair for item, full in fulls for pair in full_to_hf(item.ref, full, self.shape).items()]
        self.stats.buckets += 1
        self.stats.tensors += len(out)
        self.stats.bytes_out += sum(t.numel() * t.element_size() for _, t in out)
        return out

    def _device(self) -> torch.device:
        return next(iter(self._local.values()))[0].device


# ------------------------------------------------------------------------------------------------ HF folder

INDEX = "model.safetensors.index.json"


CARRIED_FILE = "model-not-trained.safetensors"


def carry_over(source: Path, out: Path) -> dict[str, int]:
    """Copy the source checkpoint's tensors the trainer does not build (MTP modules, ``model.layers.{i}`` with i >=
    num_hidden_layers) into ``out`` unchanged, so an export loads wherever the source did (vLLM's MTP speculative
    decoding included). Returns name -> bytes of what was copied."""
    from safetensors.torch import save_file

    try:
        layers = int(json.loads((source / "config.json").read_text())["num_hidden_layers"])
        source_ckpt = HFCheckpoint(source)
    except (OSError, ValueError, KeyError):  # no HF folder to carry from (a test's bare model)
        return {}
    names = [n for n in source_ckpt.keys()
             if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= layers]
    if not names:
        return {}
    tensors = {n: source_ckpt.get(n).contiguous() for n in names}
    save_file(tensors, str(out / CARRIED_FILE), metadata={"format": "pt"})
    return {n: t.numel() * t.element_size() for n, t in tensors.items()}


def shard_file(rank: int, bucket: int) -> str:
    return f"model-rank{rank:05d}-bucket{bucket:05d}.safetensors"


def write_hf(stream: HFBucketStream, out_dir: str | os.PathLike, source_dir: str | os.PathLike) -> Path:
    """Write an HF checkpoint folder: every rank its own tensors (one safetensors file per non-empty bucket), global
    rank 0 the index and the source's config/tokenizer files. The folder appears atomically. Collective."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    rank = stream.rank
    tmp_name: list[str | None] = [None]
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}-partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        tmp_name[0] = str(tmp)
    if stream.distributed:
        torch.distributed.broadcast_object_list(tmp_name, src=0)
    tmp = Path(tmp_name[0])
    weight_map: dict[str, str] = {}
    failure: str | None = None
    for b, tensors in enumerate(stream.stream(dst=None)):
        if not tensors or failure:
            continue
        file = shard_file(rank, b)
        try:
            save_file({n: t.detach().cpu().contiguous() for n, t in tensors}, str(tmp / file),
                      metadata={"format": "pt"})
        except OSError as err:  # keep iterating: the other ranks are in the same collectives
            failure = f"rank {rank}: writing {tmp / file}: {err}"
        weight_map.update({n: file for n, _ in tensors})
    parts: list = [(weight_map, failure)]
    if stream.distributed:
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, (weight_map, failure))
    failures = [f for _, f in parts if f]
    if failures:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError("; ".join(failures))
    if rank == 0:
        merged = {k: v for m, _ in parts for k, v in m.items()}
        carried = carry_over(Path(source_dir), tmp)
        merged.update({name: CARRIED_FILE for name in carried})
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": stream.total_bytes + sum(carried.values())},
                                             "weight_map": dict(sorted(merged.items()))}, indent=2))
        src = Path(source_dir)
        for name in TOKENIZER_AND_CONFIG:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    if stream.distributed:
        torch.distributed.barrier()
    return out
