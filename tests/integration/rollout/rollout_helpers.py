"""Helpers of the rollout integration tests: configs on free ports, the transformers reference, new weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np



def engine_cfg(*overrides: str):
    """The tiny-MoE CPU config with a float32 engine (on a free port, the default)."""
    from r3rl.config import compose

    return compose(["model=tiny_moe", "parallelism=cpu", "rollout.engine.dtype=float32",
                    *overrides])


class HFReference:
    """Teacher-forced log-probs and router top-k sets of a Qwen3-MoE checkpoint, float32 on the CPU."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.topk = self.model.config.num_experts_per_tok

    def run(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(log-prob of token t given tokens < t for t >= 1 [T-1], top-k expert sets [T, L, K] sorted)."""
        import torch

        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
        with torch.no_grad():
            out = self.model(ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits[0].double(), dim=-1)
        token_logprobs = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()
        # softmax is monotonic: the top-k of router logits or of router probabilities is the same set
        topk = torch.stack([r.topk(self.topk, dim=-1).indices for r in out.router_logits], dim=1)
        return token_logprobs, np.sort(topk.numpy(), axis=-1)

    def check_sample(self, sample, *, atol: float = 1e-4) -> tuple[float, float]:
        """(max |rollout - HF| log-prob, share of (token, layer) rows whose expert set equals HF's)."""
        lp, sets = self.run(sample.tokens)
        p = len(sample.prompt_ids)
        diff = float(np.max(np.abs(sample.rollout_logprobs - lp[p - 1:]))) if sample.response_length else 0.0
        routes = np.sort(sample.routed_experts.astype(np.int64), axis=-1)
        agree = float(np.mean(np.all(routes == sets[: len(routes)], axis=-1)))
        return diff, agree


def perturbed_checkpoint(src: Path, dst: Path, seed: int = 7, scale: float = 0.5) -> Path:
    """A copy of ``src`` with every non-constant tensor moved by ``scale`` of its std: new routing, new outputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and float(p.std()) > 0:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst
