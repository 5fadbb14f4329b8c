"""Bytes each GPU holds, per role, derived from the config alone (pure, no I/O): the plan's memory budget.

Trainer rank (Megatron, distributed optimizer as Megatron shards it):
- weights: this rank's parameters in ``params_dtype``: dense layers split over tensor parallel, experts over expert
  parallel x expert-tensor parallel, layers over pipeline stages (embedding and output layer counted on every
  stage, which is exact for one stage and an upper bound otherwise);
- gradients: Megatron DDP's float32 ``main_grad`` buffer, one entry per local parameter (``grad_reduce_in_fp32``);
- master weights: a float32 copy of every non-float32 parameter; optimizer state: Adam's two float32 moments. With
  the distributed optimizer both are sharded: dense parameters over data parallel (x context parallel), experts
  over expert-data parallel = trainer GPUs / (EP x ETP x PP). ``trainer.optimizer_cpu_offload`` moves
  ``optimizer_offload_fraction`` of both to host memory;
- activations: per micro batch of ``T`` tokens (``max_tokens_per_micro_batch``, else ``micro_batch_size`` samples
  of ``rollout.engine.max_model_len``), split over context parallel and, under sequence parallel, tensor parallel.
  The budget bounds the tokens a micro batch feeds either way: a packed row (``trainer.packing``) holds its samples'
  own tokens plus alignment, a padded micro batch its samples x their longest.
  Without recompute every layer keeps its working set; with full recompute each layer keeps its input and one
  layer's working set is rebuilt at a time. Attention is fused (TransformerEngine, or torch's SDPA in the local
  spec on CUDA: r3rl.train.te_fallback): no S x S scores;
- logits: the output layer's ``[T, vocab / TP]`` in ``params_dtype`` plus the float32 copy the cross entropy works on
  (its gradient is written into that copy in place: 6.05 bytes per logit measured in bf16, ``bench/gpu_memory_probe.py``);
- runtime: CUDA context, NCCL buffers and allocator slack, a fixed allowance;
- weight sync: while the weights go to launched engines, rank 0 holds two gathered buckets in flight and vLLM's
  packed chunk of one (``rollout.weight_sync.bucket_mb`` each; colocated, every rank holds the chunk). Counted on
  every trainer GPU, an upper bound for the others.

Rollout engine (vLLM) GPU: ``gpu_memory_utilization x GPU memory`` is the whole engine share (weights, then KV cache
in what is left), or weights + ``kv_cache_memory_bytes`` when that is set. Weights: dense layers split over the
engine's tensor parallel, experts over tensor x data parallel with ``--enable-expert-parallel``.

Colocated GPUs hold one trainer rank and one engine share at once (as long as engines do not sleep). The engine
share is ``rollout.engine.gpu_memory_utilization`` when set, else the parallelism group's
``parallelism.rollout.gpu_memory_utilization`` (each layout carries the share that suits it).

Host memory, per node (``parallelism.host_memory_gib``), pinned and pageable apart:
- each trainer rank's offloaded optimizer (Megatron's ``HybridDeviceOptimizer`` over ``optimizer_offload_fraction``
  of the rank's optimizer shard): the pinned float32 gradient copy it steps from (4 B/param), the float32 parameters
  the CPU AdamW updates (4 B/param: pageable with ``precision_aware_optimizer``, where the hybrid makes them with
  ``.float()`` from a bf16 shard; pinned otherwise, a ``pin_memory()`` copy of the float32 main shard) and Adam's two
  moments (8 B/param, pageable): 16 B/param in all;
- colocated with ``rollout.weight_sync.sleep_level=1``: each engine GPU's weights, which vLLM's sleep mode backs up
  in pinned host memory;
- runtime: Python, torch and the CUDA runtime's host side, a fixed allowance per trainer rank and engine GPU;
- checkpoint save and load (r3rl.train.checkpoint, while one runs), the larger of the two: with the distributed
  optimizer's ``fully_reshardable`` format every rank's model-parallel part of the float32 parameters and Adam
  moments (12 B per local parameter) is gathered into host "world" tensors (on data-parallel rank 0 to save, on every
  rank to load: Megatron 0.19 ``distrib_optimizer.py`` allocates them ``return_on_all_ranks or is_loading``); and
  what lives on the GPU is staged in host memory for the writer (the weights; the optimizer state not offloaded, for
  the other formats). An async save of ``dp_reshardable`` state also counts the offloaded state once more: its
  forked writer reads it in place, and the optimizer steps meanwhile copy each page they write. A load is sized for
  the format it reads, which is the checkpoint's own (a resume of another layout's checkpoint, ``load_format``),
  and with the offloaded optimizer it adds the hybrid optimizer's rebuilt copies: every ``load_state_dict``
  re-creates its sub-optimizers with a new pinned copy of each offloaded parameter (and, precision-aware, a new
  float32 ``.float()`` of it) while the previous ones stay referenced as ``master_param`` until the next step
  (``hybrid_optimizer.py`` ``_init_sub_optimizers``, ``_sync_sub_optimizers_state_to_hdo``): 4 B per offloaded
  parameter, 6 B precision-aware in bf16. Transient, but at its peak while everything above is held.

Disk, per checkpoint: every parameter once in ``params_dtype`` plus the float32 parameter and two Adam moments
(12 B/param) of the optimizer, whatever the layout; ``run.keep_checkpoints`` of them plus the one being written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from r3rl.config.families import kv_cache_per_token_layer, param_counts
from r3rl.config.lora import adapter_counts, adapter_slots, adapter_sync, engine_lora_rank
from r3rl.config.schema import R3RLConfig

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# CUDA context, NCCL communicators and allocator fragmentation on a trainer GPU
RUNTIME_BYTES = 2 * GIB
# one engine GPU's memory besides its weights and KV cache: the CUDA context, NCCL buffers, CUDA graphs and the
# activation peak vLLM profiles before it sizes the cache from what is left of its share
ENGINE_RUNTIME_BYTES = 2 * GIB
# the KV cache a CPU engine gets when rollout.engine.kv_cache_memory_bytes is unset (r3rl.plan passes it)
CPU_KV_CACHE_BYTES = 64 * 1024 * 1024
# host memory of one process (trainer rank, engine GPU worker): Python, torch, the CUDA runtime's host side
HOST_RUNTIME_BYTES = 4 * GIB
# bytes per offloaded parameter Megatron's HybridDeviceOptimizer keeps in host memory (see the module docstring)
HOST_GRAD_BYTES, HOST_PARAM_BYTES, HOST_MOMENT_BYTES = 4, 4, 8
# float32 parameter + two Adam moments: the optimizer state a checkpoint holds (and the fully reshardable gather)
OPTIMIZER_CHECKPOINT_BYTES = 12


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int


@dataclass(frozen=True)
class GpuMemory:
    """One kind of GPU in the plan and what each role puts on it."""

    gpu: str  # "trainer", "rollout" or "colocated"
    count: int  # GPUs of this kind
    parts: tuple[tuple[str, Part], ...]  # (role, part)

    @property
    def total(self) -> int:
        return sum(p.bytes for _, p in self.parts)

    def role_total(self, role: str) -> int:
        return sum(p.bytes for r, p in self.parts if r == role)


@dataclass(frozen=True)
class HostPart:
    name: str
    bytes: int
    pinned: bool  # page-locked (cudaHostAlloc / pin_memory): cannot be swapped, counts against locked memory


@dataclass(frozen=True)
class HostMemory:
    """One node's host memory: what its trainer ranks and engine GPUs put there."""

    node: int
    parts: tuple[tuple[str, HostPart], ...]  # (role, part), summed over the node's ranks / engine GPUs

    @property
    def pinned(self) -> int:
        return sum(p.bytes for _, p in self.parts if p.pinned)

    @property
    def pageable(self) -> int:
        return sum(p.bytes for _, p in self.parts if not p.pinned)

    @property
    def total(self) -> int:
        return self.pinned + self.pageable


@dataclass(frozen=True)
class MemoryPlan:
    gpus: tuple[GpuMemory, ...]
    budget_bytes: int | None  # parallelism.gpu_memory_gib, None: not checked
    host_offload_bytes: int  # per trainer rank, optimizer state (and the gradients it steps from) in host memory
    hosts: tuple[HostMemory, ...] = ()
    host_budget_bytes: int | None = None  # parallelism.host_memory_gib, None: not checked
    checkpoint_bytes: int = 0  # disk of one checkpoint
    checkpoints_on_disk: int = 0  # run.keep_checkpoints + the one being written
    # per trainer rank, host memory of a save in the run's format and of a load in the format it will read
    checkpoint_save_host_bytes: int = 0
    checkpoint_load_host_bytes: int = 0
    checkpoint_load_format: str = ""

    @property
    def checkpoint_disk_bytes(self) -> int:
        return self.checkpoint_bytes * self.checkpoints_on_disk

    def over_budget(self) -> list[GpuMemory]:
        if self.budget_bytes is None:
            return []
        return [g for g in self.gpus if g.total > self.budget_bytes]

    def hosts_over_budget(self) -> list[HostMemory]:
        if self.host_budget_bytes is None:
            return []
        return [h for h in self.hosts if h.total > self.host_budget_bytes]


def micro_batch_tokens(cfg: R3RLConfig) -> int:
    tr = cfg.trainer
    if tr.max_tokens_per_micro_batch is not None:
        return tr.max_tokens_per_micro_batch
    return tr.micro_batch_size * cfg.rollout.engine.max_model_len


def engine_memory_share(cfg: R3RLConfig) -> float:
    """The engines' ``--gpu-memory-utilization``: ``rollout.engine.gpu_memory_utilization`` when set, else the
    parallelism group's ``parallelism.rollout.gpu_memory_utilization``."""
    share = cfg.rollout.engine.gpu_memory_utilization
    return cfg.parallelism.rollout.gpu_memory_utilization if share is None else share


def engine_memory_share_key(cfg: R3RLConfig) -> str:
    """The key that set the engines' share (the one to change)."""
    return "rollout.engine.gpu_memory_utilization" if cfg.rollout.engine.gpu_memory_utilization is not None \
        else "parallelism.rollout.gpu_memory_utilization"


def trainer_host_parts(cfg: R3RLConfig, params_dtype: str, load_format: str | None = None) -> list[HostPart]:
    """One trainer rank's host memory: its offloaded optimizer shard (16 B/param), the process's allowance, and a
    checkpoint's save or load at its peak (``load_format``: the format of the checkpoint the run resumes, if not its
    own)."""
    shard, on_host = _optimizer_shard(cfg), _on_host(cfg)
    n = shard * on_host
    params_pinned = not (cfg.trainer.precision_aware_optimizer and params_dtype != "float32")
    parts = [HostPart("offloaded gradients (fp32)", int(n * HOST_GRAD_BYTES), True),
             HostPart("offloaded fp32 parameters", int(n * HOST_PARAM_BYTES), params_pinned),
             HostPart("offloaded Adam moments", int(n * HOST_MOMENT_BYTES), False),
             HostPart("runtime", HOST_RUNTIME_BYTES if cfg.parallelism.device == "cuda" else 0, False),
             HostPart("checkpoint save/load (transient)", checkpoint_host_bytes(cfg, params_dtype, load_format),
                      False)]
    return [p for p in parts if p.bytes or p.name == "runtime"]


def checkpoint_host_bytes(cfg: R3RLConfig, params_dtype: str, load_format: str | None = None) -> int:
    """One trainer rank's extra host memory while a checkpoint is saved or loaded: the larger of the two."""
    return max(checkpoint_save_host_bytes(cfg, params_dtype),
               checkpoint_load_host_bytes(cfg, params_dtype, load_format))


def checkpoint_save_host_bytes(cfg: R3RLConfig, params_dtype: str) -> int:
    """One trainer rank's extra host memory while it saves in ``trainer.checkpoint.sharding`` (module docstring)."""
    tr = cfg.trainer
    gathered = _gathers(cfg, tr.checkpoint.sharding)
    staged = _staged(cfg, params_dtype, gathered)
    if tr.checkpoint.async_save and tr.use_distributed_optimizer and not gathered:
        # the forked writer reads the offloaded state in place: every page the next optimizer steps write while it
        # runs is copied (copy-on-write), up to all of it
        staged += _optimizer_shard(cfg) * OPTIMIZER_CHECKPOINT_BYTES * _on_host(cfg)
    return int(gathered + staged)


def checkpoint_load_host_bytes(cfg: R3RLConfig, params_dtype: str, load_format: str | None = None) -> int:
    """One trainer rank's extra host memory while it loads a checkpoint saved in ``load_format`` (default: the
    run's own ``trainer.checkpoint.sharding``), the hybrid optimizer's rebuilt copies included (module docstring)."""
    gathered = _gathers(cfg, load_format or cfg.trainer.checkpoint.sharding)
    rebuilt = 0.0
    if _on_host(cfg):
        per_param = HOST_PARAM_BYTES
        if cfg.trainer.precision_aware_optimizer and params_dtype != "float32":
            per_param += DTYPE_BYTES[params_dtype]  # the pinned low-precision copy its .float() is made from
        rebuilt = _optimizer_shard(cfg) * _on_host(cfg) * per_param
    return int(gathered + _staged(cfg, params_dtype, gathered) + rebuilt)


def _gathers(cfg: R3RLConfig, optimizer_format: str) -> float:
    """The fully reshardable gather's world tensors of one rank (0 for the other formats)."""
    if cfg.trainer.use_distributed_optimizer and optimizer_format == "fully_reshardable":
        return sum(_trained_split(cfg)) * OPTIMIZER_CHECKPOINT_BYTES
    return 0.0


def _staged(cfg: R3RLConfig, params_dtype: str, gathered: float) -> float:
    """What a GPU rank stages in host memory for the writer (on a CPU the writer reads the tensors in place)."""
    tr = cfg.trainer
    if cfg.parallelism.device != "cuda":
        return 0.0
    local = sum(_trained_split(cfg))  # what a checkpoint holds: all weights, or under LoRA the adapters alone
    staged = local * DTYPE_BYTES[params_dtype]
    if not tr.use_distributed_optimizer:
        staged += local * OPTIMIZER_CHECKPOINT_BYTES
    elif not gathered:
        staged += _optimizer_shard(cfg) * OPTIMIZER_CHECKPOINT_BYTES * (1 - _on_host(cfg))
    return staged


def checkpoint_bytes(cfg: R3RLConfig, params_dtype: str) -> int:
    """Disk of one checkpoint: each trained parameter once in ``params_dtype`` with its optimizer state (12 B); under
    LoRA the adapters alone (the frozen base is the HF checkpoint the run starts from)."""
    adapters = sum(adapter_counts(cfg.model, cfg.trainer.lora))
    trained = adapters if cfg.trainer.lora.rank > 0 else param_counts(cfg.model).total
    return int(trained * (DTYPE_BYTES[params_dtype] + OPTIMIZER_CHECKPOINT_BYTES))


def _local_split(cfg: R3RLConfig) -> tuple[int, int]:
    """(dense, expert) parameters one trainer rank holds: dense over TP, experts over EP x ETP, layers over PP (an
    even share of the layers' parameters per stage)."""
    t = cfg.parallelism.trainer
    counts = param_counts(cfg.model)
    pp = t.pipeline_parallel
    dense = -(-counts.dense // pp) // t.tensor_parallel + counts.embeddings // t.tensor_parallel
    return dense, -(-counts.experts // pp) // (t.expert_parallel * t.expert_tensor_parallel)


def _local_params(cfg: R3RLConfig) -> int:
    return sum(_local_split(cfg))


def _trained_split(cfg: R3RLConfig) -> tuple[int, int]:
    """(dense, expert) parameters one trainer rank trains: all it holds, or under LoRA its adapters alone (split as
    their linears are: dense over PP, per-expert adapters over EP x PP; under tensor parallel a dense adapter
    splits one factor of two, counted whole here: an upper bound)."""
    if cfg.trainer.lora.rank <= 0:
        return _local_split(cfg)
    t = cfg.parallelism.trainer
    dense, experts = adapter_counts(cfg.model, cfg.trainer.lora)
    pp = t.pipeline_parallel
    return -(-dense // pp), -(-experts // pp) // (t.expert_parallel * t.expert_tensor_parallel)


def _optimizer_shard(cfg: R3RLConfig) -> float:
    """Parameters of one trainer rank's optimizer shard (dense over DP x CP, experts over expert-data parallel)."""
    t = cfg.parallelism.trainer
    dense, experts = _trained_split(cfg)
    if not cfg.trainer.use_distributed_optimizer:
        return dense + experts
    dp = max(t.num_gpus // (t.tensor_parallel * t.pipeline_parallel * t.context_parallel), 1) * t.context_parallel
    edp = max(t.num_gpus // (t.expert_parallel * t.expert_tensor_parallel * t.pipeline_parallel), 1)
    return dense / dp + experts / edp


def _on_host(cfg: R3RLConfig) -> float:
    tr = cfg.trainer
    return tr.optimizer_offload_fraction if tr.optimizer_cpu_offload else 0.0


def trainer_parts(cfg: R3RLConfig, params_dtype: str) -> tuple[list[Part], int]:
    """One trainer rank's parts and the bytes its optimizer keeps in host memory."""
    m, t, tr = cfg.model, cfg.parallelism.trainer, cfg.trainer
    tp, pp, cp, etp = t.tensor_parallel, t.pipeline_parallel, t.context_parallel, t.expert_tensor_parallel
    layers = -(-m.num_layers // pp)
    width = DTYPE_BYTES[params_dtype]
    trained = sum(_trained_split(cfg))
    # the weights held: the base and, under LoRA, the adapters beside it (which alone have gradients)
    local = _local_params(cfg) + (trained if tr.lora.rank > 0 else 0)
    master_width = 4 if width != 4 else 0
    shard = _optimizer_shard(cfg)  # Megatron shards dense state over DP x CP, experts over expert-data parallel
    on_host = _on_host(cfg)
    # without the precision-aware optimizer Megatron's distributed optimizer keeps its float32 main shards on the GPU
    # whatever it offloads (the hybrid optimizer steps a pinned host copy of them)
    master_on_gpu = 1.0 if tr.optimizer_cpu_offload and not tr.precision_aware_optimizer else 1 - on_host

    tokens = micro_batch_tokens(cfg) / cp
    if t.sequence_parallel:
        tokens /= tp
    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    attn_heads = (q + 2 * kv + q) / tp
    moe = m.moe_topk * (h + 3 * m.moe_ffn_hidden_size / etp + h)  # permuted input, fc1 (gate, up), act, fc2 out
    router = m.num_experts * 4 / width  # float32 logits and probabilities
    per_layer_token = width * (4 * h + attn_heads + moe + router)
    if tr.recompute_granularity == "full":
        # kept: each layer's input; rebuilt: one layer's working set and its gradient
        activations = tokens * width * h * layers + 2 * tokens * per_layer_token
    else:
        activations = tokens * per_layer_token * layers
    full_tokens = micro_batch_tokens(cfg) / cp  # the output layer sees every token of the rank's sequence shard
    logits = full_tokens * (m.vocab_size / tp) * (width + 4)

    parts = [
        Part("weights", int(local * width)),
        Part("gradients", int(trained * 4)),
        Part("master weights", int(shard * master_width * master_on_gpu)),
        Part("optimizer state", int(shard * 8 * (1 - on_host))),
        Part("activations", int(activations)),
        Part("logits", int(logits)),
        Part("runtime", RUNTIME_BYTES if cfg.parallelism.device == "cuda" else 0),
        Part("weight sync buffers", sync_buffer_bytes(cfg)),
    ]
    return parts, int(shard * (HOST_GRAD_BYTES + HOST_PARAM_BYTES + HOST_MOMENT_BYTES) * on_host)


# buckets a weight sync keeps on the sending GPU: two in flight (r3rl.sync.wires.NcclWire.in_flight) and vLLM's
# packed chunk of one
SYNC_BUCKETS = 3


def sync_buffer_bytes(cfg: R3RLConfig) -> int:
    """A trainer GPU's weight-sync working set (GPU layouts with launched engines; the CPU profile's sync runs in
    host memory and an attached engine reloads from disk)."""
    if cfg.parallelism.device != "cuda" or cfg.rollout.engine.url or adapter_sync(cfg):
        return 0
    return int(SYNC_BUCKETS * cfg.rollout.weight_sync.bucket_mb * (1 << 20))


def engine_parts(cfg: R3RLConfig, engine_dtype: str, budget_bytes: int | None) -> list[Part]:
    """One engine GPU's share: its weights, and the KV cache in the rest of ``gpu_memory_utilization``."""
    m, r, eng = cfg.model, cfg.parallelism.rollout, cfg.rollout.engine
    counts = param_counts(m)
    dense = (counts.dense + counts.embeddings) / r.tensor_parallel
    expert_split = r.tensor_parallel * (r.data_parallel if r.expert_parallel else 1)
    weights = int((dense + counts.experts / expert_split) * DTYPE_BYTES[engine_dtype])
    parts = [Part("engine weights", weights)]
    if adapter_sync(cfg):  # vLLM's adapter slots, each as wide as its --max-lora-rank, split as their linears
        wide = dataclasses.replace(cfg.trainer.lora, rank=engine_lora_rank(cfg.trainer.lora.rank))
        dense_a, experts_a = adapter_counts(m, wide)
        slots = adapter_slots(cfg) * (dense_a / r.tensor_parallel + experts_a / expert_split)
        parts.append(Part("engine LoRA slots", int(slots * DTYPE_BYTES[engine_dtype])))
    held = sum(p.bytes for p in parts)
    if eng.kv_cache_memory_bytes is not None:
        return [*parts, Part("engine KV cache", eng.kv_cache_memory_bytes)]
    if cfg.parallelism.device == "cpu":
        return [*parts, Part("engine KV cache", CPU_KV_CACHE_BYTES)]
    if budget_bytes is None:
        return parts
    share = int(engine_memory_share(cfg) * budget_bytes)
    return [*parts, Part("engine runtime", ENGINE_RUNTIME_BYTES),
            Part("engine KV cache", max(share - held - ENGINE_RUNTIME_BYTES, 0))]


def host_memory(cfg: R3RLConfig, trainer_dtype: str, engine_weights: int, load_format: str | None = None
                ) -> tuple[HostMemory, ...]:
    """Per node, the host memory of the trainer ranks and engine GPUs placed there (placement's node-major order:
    the trainer takes the first GPUs, disaggregated engines the next ones, colocated engines the trainer's)."""
    par = cfg.parallelism
    n_train, n_roll = par.trainer.num_gpus, par.rollout.num_gpus
    rollout_start = 0 if par.colocated else n_train
    rank = trainer_host_parts(cfg, trainer_dtype, load_format)
    backup = par.colocated and par.device == "cuda" and cfg.rollout.weight_sync.sleep_level == 1
    out = []
    for node in range(par.nnodes):
        gpus = range(node * par.gpus_per_node, (node + 1) * par.gpus_per_node)
        ranks = sum(1 for g in gpus if g < n_train)
        engine_gpus = sum(1 for g in gpus if rollout_start <= g < rollout_start + n_roll)
        parts: list[tuple[str, HostPart]] = [("trainer", HostPart(p.name, p.bytes * ranks, p.pinned))
                                             for p in rank if ranks]
        if engine_gpus:
            if backup:
                parts.append(("rollout", HostPart("engine weights (sleep level 1 backup)",
                                                  engine_weights * engine_gpus, True)))
            parts.append(("rollout", HostPart("runtime", HOST_RUNTIME_BYTES * engine_gpus
                                              if par.device == "cuda" else 0, False)))
        out.append(HostMemory(node, tuple(parts)))
    return tuple(out)


def estimate(cfg: R3RLConfig, trainer_dtype: str, engine_dtype: str, load_format: str | None = None) -> MemoryPlan:
    """``load_format``: the optimizer format of the checkpoint the run resumes (``r3rl.preflight`` reads it), when
    it is not the run's own ``trainer.checkpoint.sharding``."""
    par = cfg.parallelism
    budget = int(par.gpu_memory_gib * GIB) if par.gpu_memory_gib is not None else None
    host_budget = int(par.host_memory_gib * GIB) if par.host_memory_gib is not None else None
    trainer, offloaded = trainer_parts(cfg, trainer_dtype)
    engine = engine_parts(cfg, engine_dtype, budget)
    hosts = host_memory(cfg, trainer_dtype, next(p.bytes for p in engine if p.name == "engine weights"), load_format)
    if par.colocated:
        gpus = (GpuMemory("colocated", par.trainer.num_gpus,
                          tuple(("trainer", p) for p in trainer) + tuple(("rollout", p) for p in engine)),)
    else:
        gpus = (GpuMemory("trainer", par.trainer.num_gpus, tuple(("trainer", p) for p in trainer)),
                GpuMemory("rollout", par.rollout.num_gpus, tuple(("rollout", p) for p in engine)))
    return MemoryPlan(gpus=gpus, budget_bytes=budget, host_offload_bytes=offloaded, hosts=hosts,
                      host_budget_bytes=host_budget, checkpoint_bytes=checkpoint_bytes(cfg, trainer_dtype),
                      checkpoints_on_disk=cfg.run.keep_checkpoints + 1,
                      checkpoint_save_host_bytes=checkpoint_save_host_bytes(cfg, trainer_dtype),
                      checkpoint_load_host_bytes=checkpoint_load_host_bytes(cfg, trainer_dtype, load_format),
                      checkpoint_load_format=load_format or cfg.trainer.checkpoint.sharding)


def kv_bytes_per_token(cfg: R3RLConfig, engine_dtype: str) -> int:
    """KV cache bytes one token takes on one engine GPU: every layer's K and V of the GPU's KV heads (split over the
    engine's tensor parallel, at least one head a GPU), or multi-latent attention's latent."""
    m = cfg.model
    per_layer = kv_cache_per_token_layer(m, cfg.parallelism.rollout.tensor_parallel)
    return int(m.num_layers * per_layer * DTYPE_BYTES[engine_dtype])


def in_flight_sequences(cfg: R3RLConfig) -> int:
    """``algorithm.weight_update=in_flight``: the sequences one engine may hold running at once. Batch intake has
    two batches generating (the one the trainer waits for and the next, started before it ends), completion
    intake its group buffer; vLLM runs at most ``rollout.engine.max_num_seqs`` of them."""
    from r3rl.config.modes import engine_concurrency, group_buffer

    alg = cfg.algorithm
    engines = 1 if cfg.rollout.engine.url else max(cfg.parallelism.rollout.num_engines, 1)
    if alg.group_intake == "completion":
        running = -(-group_buffer(cfg) * alg.n_samples_per_prompt // engines)
    else:
        running = 2 * engine_concurrency(cfg)
    cap = cfg.rollout.engine.max_num_seqs
    return min(running, cap) if cap else running


def engine_block_size(cfg: R3RLConfig) -> int:
    """The tokens of one vLLM KV block: ``--block-size`` in ``rollout.engine.extra_args``, else what vLLM picks on
    the device: its CPU backend 128 (the CPU profile serves MLA as plain attention, ``r3rl.plan.cpu_engine_env``,
    so never its MLA kernel's 16), CUDA 16 (64 under FlashMLA)."""
    args = cfg.rollout.engine.extra_args
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--block-size" and i + 1 < len(args) else \
            arg.split("=", 1)[1] if arg.startswith("--block-size=") else None
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    if cfg.parallelism.device == "cpu":
        return 128
    return 64 if cfg.model.kv_lora_rank is not None else 16


@dataclasses.dataclass(frozen=True)
class KvFit:
    """In-flight sequences against one engine GPU's KV cache, in vLLM's blocks: a sequence holds a block for every
    ``block_size`` tokens, the last one partly filled, and the pool keeps one block aside (its null block)."""
    sequences: int
    length: int  # tokens a sequence can grow to
    block_size: int
    blocks_held: int  # blocks the cache holds, the null block taken out
    kv_bytes: int  # the cache, by the plan

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.length // self.block_size)

    @property
    def blocks_needed(self) -> int:
        return self.sequences * self.blocks_per_sequence

    @property
    def fits(self) -> bool:
        return self.blocks_needed <= self.blocks_held


def engine_kv_bytes(plan: MemoryPlan) -> int | None:
    """One engine GPU's KV cache by the plan, or None where the plan does not size it (a GPU layout without
    ``parallelism.gpu_memory_gib`` or ``rollout.engine.kv_cache_memory_bytes``)."""
    kv = [p.bytes for g in plan.gpus for role, p in g.parts if role == "rollout" and p.name == "engine KV cache"]
    return kv[0] if kv else None


def in_flight_kv_fit(cfg: R3RLConfig, engine_dtype: str, plan: MemoryPlan) -> KvFit | None:
    """``algorithm.weight_update=in_flight``: the sequences that may run at once on an engine against its KV cache.
    When they outgrow it vLLM preempts and recomputes running requests, and one preempted before an in-flight update
    and resumed after it is recomputed by the new weights while the trainer replays its first forward's rows. A
    sequence grows to its prompt plus ``max_tokens`` at most (never past ``max_model_len``). None for other updates
    or where the KV cache is not planned (``kv_cache_unplanned`` says so)."""
    kv = engine_kv_bytes(plan)
    if cfg.algorithm.weight_update != "in_flight" or kv is None:
        return None
    length = min(cfg.rollout.engine.max_model_len, cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens)
    block = engine_block_size(cfg)
    held = kv // (block * kv_bytes_per_token(cfg, engine_dtype)) - 1
    return KvFit(in_flight_sequences(cfg), length, block, held, kv)


def kv_cache_unplanned(cfg: R3RLConfig, plan: MemoryPlan) -> str | None:
    """Why an in-flight run's KV cache cannot be checked before launch, or None: an attached engine's cache is its
    own, and a GPU layout without a budget leaves vLLM to size it."""
    if cfg.algorithm.weight_update != "in_flight":
        return None
    if cfg.rollout.engine.url:
        return ("rollout.engine.url: the attached engine's KV cache is not planned, so whether the in-flight "
                "sequences fit it (without preemptions, which recompute requests under newer weights) is not checked; "
                "watch rollout/preemptions")
    if engine_kv_bytes(plan) is None:
        return ("parallelism.gpu_memory_gib is unset: the engines' KV cache is not planned, so whether the in-flight "
                "sequences fit it is not checked; set it (or rollout.engine.kv_cache_memory_bytes), or watch "
                "rollout/preemptions")
    return None


def engine_weights_fit(cfg: R3RLConfig, plan: MemoryPlan) -> bool:
    """The engine's weights fit in its ``gpu_memory_utilization`` share (vLLM refuses to start otherwise)."""
    eng = cfg.rollout.engine
    if plan.budget_bytes is None or eng.kv_cache_memory_bytes is not None:
        return True
    weights = sum(p.bytes for g in plan.gpus for r, p in g.parts if p.name == "engine weights") // len(plan.gpus)
    return weights < engine_memory_share(cfg) * plan.budget_bytes


# keys that shrink a trainer GPU, named when a plan does not fit
TRAINER_FIXES = ("trainer.optimizer_cpu_offload=true", "trainer.recompute_granularity=full",
                 "trainer.max_tokens_per_micro_batch / trainer.micro_batch_size (smaller)",
                 "parallelism.trainer.expert_parallel / tensor_parallel (larger)",
                 "parallelism.trainer.num_gpus (more)", "parallelism.gpu_memory_gib (if the GPUs are larger)")
ENGINE_FIXES = ("rollout.engine.gpu_memory_utilization or parallelism.rollout.gpu_memory_utilization (smaller on "
                "colocated GPUs)",)
# keys that shrink a node's host memory, named when a plan does not fit parallelism.host_memory_gib
HOST_FIXES = ("trainer.checkpoint.sharding=dp_reshardable (checkpoints without the host gather of the optimizer "
              "state; a resume then keeps the layout)",
              "trainer.optimizer_offload_fraction (smaller: fewer optimizer bytes in host memory, more on the GPU)",
              "parallelism.nnodes with parallelism.trainer.num_gpus (the trainer over more nodes: fewer ranks per "
              "node, each a smaller optimizer shard)",
              "parallelism.host_memory_gib (if the nodes have more)")


def host_fixes(cfg: R3RLConfig) -> list[str]:
    """The keys that would bring an over-budget node's host memory down."""
    tr = cfg.trainer
    out = [k for k in HOST_FIXES
           if not (k.startswith("trainer.optimizer_offload_fraction") and not tr.optimizer_cpu_offload)
           and not (k.startswith("trainer.checkpoint.sharding") and
                    (tr.checkpoint.sharding == "dp_reshardable" or not tr.use_distributed_optimizer))]
    if cfg.parallelism.colocated and cfg.rollout.weight_sync.sleep_level == 1:
        out.insert(0, "rollout.weight_sync.sleep_level=2 (the engines drop their weights instead of backing them up)")
    return out


def fixes(cfg: R3RLConfig) -> list[str]:
    """The keys that would bring an over-budget plan down, the ones not already at their saving value first."""
    tr = cfg.trainer
    out = [k for k in TRAINER_FIXES
           if not (k.startswith("trainer.optimizer_cpu_offload") and tr.optimizer_cpu_offload and
                   tr.optimizer_offload_fraction == 1.0)
           and not (k.startswith("trainer.recompute_granularity") and tr.recompute_granularity == "full")]
    if cfg.parallelism.colocated:
        out += list(ENGINE_FIXES)
    return out


def gib(b: float) -> float:
    """Bytes as GiB, rounded for printing."""
    return round(b / GIB, 2)


def table(plan: MemoryPlan) -> dict:
    """The plan as plain data in GiB (what the dry run prints)."""
    out: dict = {}
    for g in plan.gpus:
        rows: dict = {}
        for role, p in g.parts:
            rows.setdefault(role, {})[p.name] = gib(p.bytes)
        for role in rows:
            rows[role]["total"] = gib(g.role_total(role))
        out[f"{g.gpu} GPU (x{g.count})"] = {**rows, "total": gib(g.total)}
    out["budget per GPU"] = gib(plan.budget_bytes) if plan.budget_bytes is not None else "not checked"
    out["optimizer state and fp32 gradients in host memory per trainer rank"] = gib(plan.host_offload_bytes)
    return out


def host_table(plan: MemoryPlan) -> dict:
    """Host memory per node in GiB, pinned and pageable apart (what the dry run prints)."""
    out: dict = {}
    for h in plan.hosts:
        rows: dict = {}
        for role, p in h.parts:
            rows.setdefault(role, {})[f"{p.name} ({'pinned' if p.pinned else 'pageable'})"] = gib(p.bytes)
        out[f"node {h.node}"] = {**rows, "pinned": gib(h.pinned), "pageable": gib(h.pageable), "total": gib(h.total)}
    out["budget per node"] = gib(plan.host_budget_bytes) if plan.host_budget_bytes is not None else "not checked"
    return out


def checkpoint_host_table(cfg: R3RLConfig, plan: MemoryPlan) -> dict:
    """A checkpoint's save and load per trainer rank in GiB, each in the format it handles (what the dry run
    prints; the host table counts the larger)."""
    resumed = plan.checkpoint_load_format != cfg.trainer.checkpoint.sharding
    return {f"save ({cfg.trainer.checkpoint.sharding})": gib(plan.checkpoint_save_host_bytes),
            f"load ({plan.checkpoint_load_format}{', the checkpoint this launch resumes' if resumed else ''})":
                gib(plan.checkpoint_load_host_bytes)}


def disk_table(plan: MemoryPlan) -> dict:
    """Checkpoint disk in GiB (what the dry run prints)."""
    return {"per checkpoint": gib(plan.checkpoint_bytes), "checkpoints on disk at once": plan.checkpoints_on_disk,
            "total": gib(plan.checkpoint_disk_bytes)}
