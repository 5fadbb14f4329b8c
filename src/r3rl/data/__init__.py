"""Prompt data: the generated arithmetic set, JSONL prompt datasets with a resumable sampler, and the math reward."""

from r3rl.data.arithmetic import ensure_prompts, generate_problems, write_jsonl
from r3rl.data.dataset import DataError, Prompt, PromptDataset
from r3rl.data.reward import extract_answer, math_reward

__all__ = [
    "DataError", "Prompt", "PromptDataset", "ensure_prompts", "extract_answer", "generate_problems", "math_reward",
    "write_jsonl",
]
