"""The engine's rounding replayed into the trainer's forward, so that the doctor can measure how far hidden-state
drift moves each layer's router margins on this model, at this depth.

A teacher-forced pass (the engine's routes replayed) stops route flips from compounding, but not numerics: the
router of layer l reads a hidden state the engine computed through l layers of its own rounding, which grows with
depth. Rounding the router's own input once (``r3rl.train.replay.rounding_reach``) covers only the last of those.
So the doctor runs the replayed pass twice, once as it is and once with every decoder layer's residual output and
its attention's and MLP's outputs moved as an engine of unit roundoff u may round them (``engine_rounding``); per
row the route probe compares the two passes' margins (``RouteProbe``'s ``drift_reference``). The move measured is
this model's own propagation of per-layer rounding, through its own weights, to every router.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from r3rl import metrics as M

# the bits float32 carries below a bfloat16 mantissa
_BF16_DROPPED_BITS = 16


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) as ``dtype``, rounded up or down at random in proportion to the distance (unbiased), so a
    move smaller than the dtype's spacing still moves a bfloat16 trainer's values on average; float32 as it is."""
    if dtype == torch.float32:
        return x
    if dtype != torch.bfloat16:
        raise ValueError(f"the drift pass emulates rounding for float32 and bfloat16 trainers, not {dtype}")
    bits = x.contiguous().view(torch.int32)
    dither = torch.randint(0, 1 << _BF16_DROPPED_BITS, bits.shape, generator=generator, device=bits.device,
                           dtype=torch.int32)
    # float32 to bfloat16 keeps the top 16 bits: adding a uniform dither below them before the cut rounds at random
    return ((bits + dither) & ~((1 << _BF16_DROPPED_BITS) - 1)).view(torch.float32).to(torch.bfloat16)


def perturbed(t: torch.Tensor, unit_roundoff: float, generator: torch.Generator) -> torch.Tensor:
    """``t`` with each element moved by ``u |t_i| e_i``, e uniform in [-1, 1] and independent: the engine's rounding
    of that value at its worst relative size, in its own direction."""
    e = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float32).mul_(2).sub_(1)
    return stochastic_round(t.float() * (1 + unit_roundoff * e), t.dtype, generator)


def drift_scale(trainer_unit_roundoff: float, engine_unit_roundoff: float) -> float:
    """How much further the engine is from the trainer than the emulated rounding moves the trainer: the engine's
    rounding and the trainer's own add in quadrature, so a bfloat16 trainer beside a bfloat16 engine is sqrt(2)
    further off, a float32 trainer (the CPU profile) no further."""
    return math.sqrt(1.0 + (trainer_unit_roundoff / engine_unit_roundoff) ** 2)


def _decoder_layers(model) -> list:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # the decoder's layers only: MTP layers sit outside the routes (r3rl leaves them out of training and replay)
    decoder = getattr(model, "decoder", None)
    return [m for m in (decoder.layers if decoder is not None else model.modules()) if isinstance(m, TransformerLayer)]


@contextlib.contextmanager
def engine_rounding(model, unit_roundoff: float, seed: int) -> Iterator[None]:
    """Within: each decoder layer's output (the residual stream) and its attention's and MLP's outputs perturbed as
    ``perturbed`` says, where a bfloat16 engine rounds them: three roundings a layer of the several an engine makes,
    the ones that carry to the residual stream. ``seed``: the same on every rank, so ranks that hold one tensor
    (tensor parallel) move it alike."""
    layers = _decoder_layers(model)
    if not layers:
        raise RuntimeError("engine_rounding: the model has no decoder layers to perturb")
    generator: torch.Generator | None = None

    def hook(module, args, output):
        nonlocal generator
        head = output[0] if isinstance(output, tuple) else output
        if generator is None:
            generator = torch.Generator(device=head.device)
            generator.manual_seed(seed)
        moved = perturbed(head, unit_roundoff, generator)
        return (moved, *output[1:]) if isinstance(output, tuple) else moved

    handles = []
    try:
        for layer in layers:
            handles += [m.register_forward_hook(hook) for m in (layer.self_attention, layer.mlp, layer)]
        yield
    finally:
        for h in handles:
            h.remove()


def trainer_unit_roundoff(dtype: torch.dtype) -> float:
    return M.UNIT_ROUNDOFF[str(dtype).removeprefix("torch.")]
