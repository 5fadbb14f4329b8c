"""The record that crosses from rollout to training: one generated sample.

Both sides test against this contract. Routed experts stay in the engine's narrow dtype (uint8 for up to 256
experts, uint16 above) from the wire to the trainer; they are widened only at the replay gather, per layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # stopped on EOS or a stop token
    TRUNCATED = "truncated"  # hit max_tokens
    ABORTED = "aborted"  # ended by /pause?mode=abort or a client abort: never trained on


def routes_dtype(num_experts: int) -> np.dtype:
    """The narrowest dtype that holds expert ids < num_experts (vLLM's own rule: uint8 up to 256 experts)."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


@dataclass
class Sample:
    index: int  # position in the rollout batch
    group: int  # prompt index; GRPO normalises rewards within a group
    request_id: str
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    rollout_logprobs: np.ndarray  # float32 [R], log-prob of each response token under the engine
    loss_mask: np.ndarray  # float32 [R], 1 where the token is trained on
    finish_reason: str  # as the engine reported it ("stop", "length", "abort", ...)
    status: SampleStatus
    routed_experts: np.ndarray | None = None  # uint8/uint16 [P + R - 1, L, K]; None only when aborted with R == 0
    label: str | None = None  # reference answer
    reward: float | None = None
    weight_version: int | None = None  # policy version the engine served
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        # Sizes, not contents: the dataclass repr printed every array, and asyncio.run reprs the finished task, result
        # included, when it restores SIGINT (20 ms per 128-sample rollout, 4% of a CPU batch; far more at 32K tokens)
        routes = "None" if self.routed_experts is None else \
            f"{tuple(self.routed_experts.shape)} {self.routed_experts.dtype}"
        return (f"Sample(index={self.index}, group={self.group}, request_id={self.request_id!r}, "
                f"status={self.status.value}, finish_reason={self.finish_reason!r}, prompt={len(self.prompt_ids)} "
                f"tokens, response={len(self.response_ids)} tokens, routed_experts={routes}, label={self.label!r}, "
                f"reward={self.reward}, weight_version={self.weight_version})")

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, self.response_ids]).astype(np.int32, copy=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)
