"""Helpers shared by the Megatron trainer tests: samples with varied lengths, routes, and transformers' view."""

from __future__ import annotations

import numpy as np
import torch

from r3rl.sample import Sample, SampleStatus


def build_samples(n: int, seed: int, vocab: int = 1024, groups_of: int = 4,
                  lengths: tuple[int, int] | None = None) -> list[Sample]:
    """Random prompts and responses, no routes yet. Lengths vary (micro batches carry padding) unless ``lengths``
    fixes (prompt, response)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = lengths or (int(rng.integers(4, 12)), int(rng.integers(3, 10)))
        mask = np.ones(r, dtype=np.float32)
        if i % 3 == 2:
            mask[-1] = 0.0  # a token left out of the loss
        out.append(Sample(
            index=i, group=i // groups_of, request_id=f"req-{seed}-{i}",
            prompt_ids=rng.integers(3, vocab, p).astype(np.int32),
            response_ids=rng.integers(3, vocab, r).astype(np.int32),
            rollout_logprobs=np.zeros(r, dtype=np.float32), loss_mask=mask, finish_reason="length",
            status=SampleStatus.TRUNCATED, reward=float(rng.integers(0, 2)),
        ))
    return out


def random_routes(samples: list[Sample], num_layers: int, topk: int, num_experts: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((s.num_tokens - 1, num_layers, num_experts)), axis=-1)[..., :topk].astype(np.uint8)
            for s in samples]


def with_routes(samples: list[Sample], routes: list[np.ndarray]) -> list[Sample]:
    for s, r in zip(samples, routes):
        s.routed_experts = r
    return samples


class HFReference:
    """transformers' own model on the same checkpoint (any family): response log-probs and, per MoE layer in order,
    the top-k its router chose for each token (each ``mlp.gate`` returns logits, weights and indices; GLM-4.5's
    picks on sigmoid scores plus the correction bias, so the indices are read, not recomputed from the logits)."""

    def __init__(self, folder, topk: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.topk = topk
        self._chosen: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, torch.nn.Module):  # a dense layer's mlp.gate_proj is not one
                gate.register_forward_hook(lambda _m, _i, out: self._chosen.append(out[2]))

    @torch.no_grad()
    def run(self, sample: Sample) -> tuple[np.ndarray, np.ndarray]:
        ids = torch.from_numpy(sample.tokens.astype(np.int64))[None]
        self._chosen.clear()
        out = self.model(ids)
        logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
        p = len(sample.prompt_ids)
        response = logprobs[p - 1:-1].gather(1, ids[0, p:, None])[:, 0].numpy()
        routes = torch.stack(self._chosen, dim=1)
        return response, routes[:-1].numpy().astype(np.uint8)
