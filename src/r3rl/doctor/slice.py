"""``python doctor.py --slice``: the run's model cut to 2 layers, with random weights of its shape, checked on
the run's own layout in minutes, a go/no-go before a long run.

The slice keeps what R3 depends on (experts, top-k, the router's normalisation, the attention layout, on GPUs the
real width) and generates its weights (``r3rl.models.tiny_moe.generate``: a model of the run's family), so it needs no
checkpoint. Both sides run in float32: a random model's router scores are near ties, which bfloat16 would flip at
random, and what the slice checks is the plumbing, not the model. Without a GPU the width is cut too (the CPU
profile cannot hold 2048-wide layers of 128 experts); with one it is the model's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

SLICE_LAYERS = 2
# random weights drawn wider than a real checkpoint's std, as the tiny model's: peaked router scores, few near ties
SLICE_INIT_STD = 0.1
# the CPU profile's width (the tiny model's), experts and top-k kept
CPU_WIDTH = {"hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 32,
             "moe_ffn_hidden_size": 64, "vocab_size": 1024}


def slice_overrides(name: str, data_dir: str, device: str) -> list[str]:
    """The Hydra overrides that turn a run's config into its slice's (appended after the run's own)."""
    width = [] if device == "cuda" else [f"model.{key}={value}" for key, value in CPU_WIDTH.items()]
    where = "" if device == "cuda" else "_cpu"
    return [f"model.num_layers={SLICE_LAYERS}", "model.generate_if_missing=true", f"model.init_std={SLICE_INIT_STD}",
            f"model.checkpoint={data_dir}/models/{name}_slice{where}", "warm_start.enabled=false",
            "rollout.engine.dtype=float32", "trainer.params_dtype=float32", *width]


def with_slice(overrides: Sequence[str], compose: Callable) -> list[str]:
    """The run's overrides and its slice's. The slice's width depends on the device, which only the composed config
    says: a first composition at the CPU width (valid on every profile: the full model is refused on the CPU one)
    reads it."""
    probe = compose([*overrides, *slice_overrides("probe", "/nonexistent", "cpu")])
    return [*overrides, *slice_overrides(probe.model.name, probe.run.data_dir, probe.parallelism.device)]
