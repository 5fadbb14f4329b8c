"""One rank of a tensor-parallel-2 LoRA check (started by test_megatron_lora with RANK/WORLD_SIZE set): Megatron's
ColumnParallelLinear then RowParallelLinear, each with an r3rl adapter, forward and backward on one input; rank 0
writes the output and the gathered gradients of the input and of every adapter factor. With ``sp``, under sequence
parallelism (the input and the output split over the sequence, as Megatron's MoE layers need with tensor
parallel), the sequence-parallel gradients summed over the ranks as Megatron's ``finalize_model_grads`` does. Then
both ranks save the adapters with Megatron's ``dist_checkpointing`` (the trainer's sharded state) to ``CKPT`` and
read them back whole.

Usage: python megatron_lora_tp_worker.py OUT.pkl CKPT [sp]
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")

IN, MID, RANK_R, ALPHA = 16, 12, 4, 8.0
WORKER_PATH = os.path.abspath(__file__)


def full_tensors(seed: int = 0) -> dict:
    """The whole weights, adapter B factors, input and output gradient, the same on every rank (and for the test's
    single-process reference)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(MID, IN, generator=g, dtype=torch.float64) * 0.3,
            "w2": torch.randn(IN, MID, generator=g, dtype=torch.float64) * 0.3,
            "b1": torch.randn(MID, RANK_R, generator=g, dtype=torch.float64) * 0.2,
            "b2": torch.randn(IN, RANK_R, generator=g, dtype=torch.float64) * 0.2,
            "x": torch.randn(4, 2, IN, generator=g, dtype=torch.float64),
            "dy": torch.randn(4, 2, IN, generator=g, dtype=torch.float64)}


def main() -> None:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from r3rl.train import hardware, lora

    from megatron.core import dist_checkpointing

    out, ckpt, sp = sys.argv[1], sys.argv[2], sys.argv[3:] == ["sp"]
    hardware.apply_if_needed()
    # Megatron's groups set up by hand: r3rl's trainer refuses TP on CPU (its LayerNorm refuses sequence parallel),
    # and these two linears need neither
    torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2, tensor_model_parallel_size=tp,
                               params_dtype=torch.float64, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, sequence_parallel=sp)
    init = torch.nn.init.zeros_
    column = ColumnParallelLinear(IN, MID, config=config, init_method=init, bias=False, gather_output=False)
    row = RowParallelLinear(MID, IN, config=config, init_method=init, bias=False, input_is_parallel=True,
                            skip_bias_add=False)
    t = full_tensors()
    with torch.no_grad():
        column.weight.copy_(t["w1"].chunk(tp, 0)[rank])
        row.weight.copy_(t["w2"].chunk(tp, 1)[rank])
    for linear, parallel, b, seed in ((column, "column", t["b1"], 1), (row, "row", t["b2"], 2)):
        linear.requires_grad_(False)
        adapter = lora.LoRAAdapter(linear.weight, parallel, RANK_R, ALPHA, linear.tp_group, seed=seed, tp_size=tp,
                                   tp_rank=rank, expert=False, sequence_parallel=lora._sequence_parallel(linear))
        with torch.no_grad():
            adapter.b.copy_(b.chunk(tp, 0)[rank] if parallel == "column" else b)
        lora._attach(linear, adapter, owner=True)
    def whole(tensor, dim):  # this rank's shard joined with the other's
        pieces = [torch.empty_like(tensor) for _ in range(tp)]
        torch.distributed.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(pieces, dim)

    def mine(tensor):  # this rank's part of the sequence under sequence parallelism
        return tensor.chunk(tp, 0)[rank] if sp else tensor

    x = mine(t["x"]).clone().requires_grad_(True)
    mid, _ = column(x)
    y, _ = row(mid)
    y.backward(mine(t["dy"]))
    for linear in (column, row):  # finalize_model_grads: sequence-parallel gradients are partial per rank
        for p in linear.lora.parameters():
            if getattr(p, "sequence_parallel", False):
                torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    y, dx = (whole(y.detach(), 0), whole(x.grad.detach(), 0)) if sp else (y.detach(), x.grad.detach())

    sharded = {}
    for name, linear in (("column", column), ("row", row)):
        sharded.update(linear.sharded_state_dict(
            prefix=f"{name}.", metadata={"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}))
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(ckpt, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(lora.shard_adapters({k: v for k, v in sharded.items() if lora.is_adapter(k)}), ckpt)
    saved = dist_checkpointing.load_plain_tensors(ckpt)  # every tensor whole, as a one-process load reads it

    result = {"y": y, "dx": dx, "saved": saved,
              "a1": column.lora.a.detach(), "da1": column.lora.a.grad.detach(),
              "db1": whole(column.lora.b.grad.detach(), 0),
              "a2": whole(row.lora.a.detach(), 1), "da2": whole(row.lora.a.grad.detach(), 1),
              "db2": row.lora.b.grad.detach(), "b2_replicas": whole(row.lora.b.grad.detach()[None], 0)}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "wb") as f:
            pickle.dump(result, f)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
