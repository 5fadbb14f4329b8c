"""``MegatronTrainer``: one instance per trainer rank (Ray actor, torchrun process, or a plain process).

Every rank is called with the same full list of samples and takes its data-parallel share itself; results
(log-probs, metrics) come back complete on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from r3rl import metrics as M
from r3rl.config.modes import resolve_dtype, soft_replay_ratio
from r3rl.config.schema import R3RLConfig
from r3rl.train import checkpoint, convert, distributed, export, lora, offload, optim, peft_adapter
from r3rl.train import model as model_lib
from r3rl.train.batch import RouteShape
from r3rl.train.checkpointing import Checkpointing
from r3rl.train.layout import TokenLayout
from r3rl.train.policy_step import PolicySteps
from r3rl.train.replay import ReplayDriver, check_megatron_api, forget_instances


class MegatronTrainer(PolicySteps, Checkpointing):
    """One trainer rank: the model built from the HF checkpoint with Megatron's settings, its optimizer, the routing
    replay driver and the parallel layout. Each concern it serves lives in a module of its own, mixed in here:
    ``r3rl.train.forward`` (micro batches, forwards, the pipeline schedule), ``r3rl.train.logprob_pass`` (log-probs,
    route probe, recorded routes), ``r3rl.train.policy_step`` (GRPO and SFT steps), ``r3rl.train.checkpointing``
    (save, load, the background queue); the weights, offload and inventory stay below."""

    def __init__(self, cfg: R3RLConfig):
        self.cfg = cfg
        self._closed = True
        self.routers: list = []
        self.replay = None
        self._weight_stream: export.HFBucketStream | None = None
        self._saves = None  # Megatron's AsyncCallsQueue, once an async checkpoint save was scheduled
        par = cfg.parallelism.trainer
        self.info = distributed.init(
            distributed.Layout(par.tensor_parallel, par.pipeline_parallel, par.expert_parallel,
                               par.context_parallel, par.expert_tensor_parallel), seed=cfg.run.seed)
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.shutdown()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.device = self.info.device
        self.settings = model_lib.model_settings(cfg)
        self.replay_enabled = bool(self.settings.transformer.get("moe_enable_routing_replay"))
        if self.replay_enabled:
            check_megatron_api()
        self.attention = convert.HFLayout.of(cfg.model)
        self.route_shape = RouteShape(cfg.model.num_moe_layers, cfg.model.moe_topk, cfg.model.num_experts)
        self.source = self._ensure_checkpoint()

        self.bare = model_lib.build_gpt(self.settings, self.device)
        convert.load_hf(self.bare, convert.HFCheckpoint(self.source), self.attention)
        if cfg.trainer.lora.rank > 0:  # before DDP and the optimizer: only the adapters get buffers and state
            lora.add_adapters(self.bare, cfg.trainer.lora, cfg.run.seed)
        elif cfg.trainer.freeze_router:  # the same for the routers alone
            for router in model_lib.routers(self.bare):
                router.requires_grad_(False)
        self.model = model_lib.wrap_ddp(self.bare, self.settings)
        self.routers = model_lib.routers(self.bare)
        self.soft_ratio = soft_replay_ratio(cfg)
        # the unit roundoff of the engine's dtype: how far its rounding can move a router logit, relatively
        self.engine_unit_roundoff = M.UNIT_ROUNDOFF[resolve_dtype(cfg.rollout.engine.dtype, cfg.parallelism.device)]
        self.replay = ReplayDriver(self.routers, self.soft_ratio) if self.replay_enabled else None
        self.optimizer = optim.build_optimizer(cfg, self.model, self.settings.dtype,
                                               self.settings.use_distributed_optimizer)
        self.total_steps = optim.total_optimizer_steps(cfg)
        self.optimizer_step = 0

        self.ref_model = None
        if cfg.algorithm.use_kl_loss:
            ref_settings = model_lib.model_settings(cfg, replay=False)  # never replays (pitfall P12)
            self.ref_model = model_lib.build_gpt(ref_settings, self.device)
            convert.load_hf(self.ref_model, convert.HFCheckpoint(self.source), self.attention)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)

        from megatron.core import parallel_state as ps

        self._ps = ps
        tp = ps.get_tensor_model_parallel_world_size()
        sp = self.settings.transformer.get("sequence_parallel", False)
        self.layout = TokenLayout(cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                                  sp_size=tp if sp else 1, sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0)
        self.pipelined = ps.get_pipeline_model_parallel_world_size() > 1
        # pipeline stages pass fixed-size activations, and the allgather dispatcher gathers equal token counts from
        # the expert-parallel ranks: then micro batches share one shape. alltoall takes unequal counts (GPU runs).
        self.equal_shapes = ps.get_expert_model_parallel_world_size() > 1 and \
            self.settings.transformer.get("moe_token_dispatcher_type") == "allgather"
        self.uniform_length = self.equal_shapes or self.pipelined
        # micro batches as packed rows (trainer.packing); an attribute so a test can run both layouts on one model
        self.packing = cfg.trainer.packing

    # ------------------------------------------------------------------------------------------------ setup

    def _ensure_checkpoint(self) -> Path:
        """The HF checkpoint folder; rank 0 generates it first when the model config allows (the tiny model)."""
        from r3rl.models.tiny_moe import ensure_checkpoint

        if self.info.rank == 0:
            ensure_checkpoint(self.cfg.model)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return ensure_checkpoint(self.cfg.model)

    # ------------------------------------------------------------------------------------------------ weights

    def weight_stream(self) -> export.HFBucketStream:
        """The weights as HF-named tensors in buckets of ``rollout.weight_sync.bucket_mb`` (what a weight sync
        sends). The plan is built once (collective); the stream reads the live parameters every time."""
        if self._weight_stream is None:
            bucket = int(self.cfg.rollout.weight_sync.bucket_mb * (1 << 20))
            self._weight_stream = export.HFBucketStream(self.bare, self.attention, bucket)
        return self._weight_stream

    def export_hf(self, out_dir: str | Path) -> Path:
        """Write the current weights as an HF checkpoint (safetensors + config + tokenizer): every rank writes its
        own tensors bucket by bucket, rank 0 the index. Collective."""
        return export.write_hf(self.weight_stream(), out_dir, self.source)

    def export_adapter(self, out_dir: str | Path, info: dict, per_expert: bool = False) -> Path:
        """Write the LoRA adapters as a PEFT adapter folder for the base this run adapts (``self.source``); rank 0
        gathers every rank's pairs and writes it (``per_expert``: vLLM's layout of the experts' adapters, for
        ``sync=adapter``). Collective."""
        pairs = peft_adapter.local_pairs(self.bare)
        parts = [pairs]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            parts = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
            torch.distributed.gather_object(pairs, parts, dst=0)
        out = Path(out_dir)
        if parts is not None:
            lora_cfg = self.cfg.trainer.lora
            tensors = peft_adapter.peft_tensors([p for part in parts for p in part], self.attention,
                                                self.cfg.model.num_experts, per_expert=per_expert)
            config = peft_adapter.peft_config(tensors, lora_cfg.rank, lora_cfg.alpha, str(self.source),
                                              per_expert=per_expert)
            peft_adapter.write_folder(tensors, config, out, info)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out

    def offload_optimizer_state(self) -> int:
        """Optimizer state to host memory (colocated engines generate meanwhile); bytes moved."""
        return offload.move_optimizer_state(self.optimizer, "cpu")

    def onload_optimizer_state(self) -> int:
        return offload.move_optimizer_state(self.optimizer, self.device)

    def yield_device(self) -> int:
        """Before colocated engines wake: the optimizer state to host (a no-op when it is there already) and the
        allocator's cached blocks released; the bytes this rank still reserves on its device."""
        offload.move_optimizer_state(self.optimizer, "cpu")
        return offload.release_cached_memory()

    def peak_device_memory(self) -> int | None:
        """The most device memory this rank's allocator held since it started (bytes; None without a GPU)."""
        return int(torch.cuda.max_memory_reserved(self.device)) if self.device.type == "cuda" else None

    def router_inventory(self) -> dict[str, Any]:
        """The routers this rank built (a pipeline stage holds its own): their 0-based decoder layers and weight
        dtype, with the params and router compute dtypes (``python doctor.py``'s layer map and precision)."""
        weights = sorted({str(r.weight.dtype).removeprefix("torch.") for r in self.routers})
        return {"layers": [int(r.layer_number) - 1 for r in self.routers],
                "router_weight_dtype": ",".join(weights) or "none",
                "params_dtype": str(self.settings.dtype).removeprefix("torch."),
                "router_compute_dtype": self.settings.transformer.get("moe_router_dtype") or "params"}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.replay is not None:
            self.replay.clear()
        if self.routers:
            forget_instances(self.routers)
        if self._saves is not None and self._saves.get_num_unfinalized_calls():
            # shutdown goes rank by rank, and finalizing is collective: what was not finished stays a .partial
            self._saves.close(abort=True)
        self._saves = None
        checkpoint.close_writer()
        self.model = self.bare = self.ref_model = self.optimizer = self._weight_stream = None
        self.routers = []
        distributed.release()

    def __enter__(self) -> "MegatronTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
