"""The SFT loss on a real Megatron trainer (the tiny Qwen3-MoE on the CPU): it learns, and only response tokens count.

The samples are the generated arithmetic solutions, tokenised by ``SFTDataset`` as the SFT recipe does.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

# a large step for a tiny model: a few steps move the loss clearly
OVERRIDES = ("model=tiny_moe", "parallelism=cpu", "recipe=sft", "trainer.lr=1e-3", "run.num_steps=100",
             "trainer.max_tokens_per_micro_batch=256")


@pytest.fixture(scope="module")
def sft_cfg(tmp_path_factory):
    from r3rl.config import compose

    data = tmp_path_factory.mktemp("sft_data") / "arithmetic_sft.jsonl"
    return compose([*OVERRIDES, f"data.path={data}", "data.generate_if_missing=true", "data.num_generated_prompts=32"])


@pytest.fixture(scope="module")
def examples(sft_cfg, tiny_model_dir):
    from transformers import AutoTokenizer

    from r3rl.data.arithmetic import ensure_sft_data
    from r3rl.data.sft import SFTDataset

    ensure_sft_data(sft_cfg.data)
    return SFTDataset(sft_cfg.data, AutoTokenizer.from_pretrained(tiny_model_dir)).examples


@pytest.fixture(scope="module")
def trainer(sft_cfg, tiny_model_dir):
    from r3rl.train.trainer import MegatronTrainer

    t = MegatronTrainer(sft_cfg)
    yield t
    t.shutdown()


def response_nll(trainer, samples) -> float:
    """Mean over every response token of the batch of -log p, from the trainer's no-grad log-prob pass."""
    lps = trainer.logprobs(samples, replay=False).logprobs
    return -float(np.concatenate(lps).mean())


def test_masked_tokens_carry_no_loss_whatever_their_targets(trainer, examples):
    """A sample whose loss mask is all zero adds nothing: neither loss nor gradient, whichever tokens (prompt targets
    included) it holds, and the loss is the mean NLL of the response tokens only.

    Fails if the SFT loss ignores the Sample's loss mask (e.g. scores every label position, prompt included), if
    it normalises by anything but the loss tokens, or if masked positions leak gradient."""
    batch = examples[:4]
    base = trainer.sft_gradients(batch)
    masked = dataclasses.replace(examples[4], loss_mask=np.zeros_like(examples[4].loss_mask))
    # the same shape of sample, every prompt token (so every prompt target) changed
    rng = np.random.default_rng(0)
    other = dataclasses.replace(masked, prompt_ids=rng.integers(3, 1000, size=len(masked.prompt_ids)).astype(np.int32))
    with_masked = trainer.sft_gradients([*batch, masked])
    with_other = trainer.sft_gradients([*batch, other])
    assert with_masked["loss_tokens"] == with_other["loss_tokens"] == base["loss_tokens"] == \
        sum(s.response_length for s in batch)
    # the loss is the response tokens' mean NLL (the prompt is ~3x longer than the response: counting it would move
    # the figure far beyond this tolerance)
    assert base["loss"] == pytest.approx(response_nll(trainer, batch), rel=1e-4)
    for run in (with_masked, with_other):
        assert run["loss"] == pytest.approx(base["loss"], rel=1e-6)
        for name, grad in base["grads"].items():
            np.testing.assert_allclose(run["grads"][name].numpy(), grad.numpy(), rtol=1e-4, atol=1e-7,
                                       err_msg=name)
    assert any(float(g.abs().sum()) > 0 for g in base["grads"].values())


def test_sft_loss_falls_over_a_few_steps(trainer, examples):
    """Four optimizer steps on a fixed batch of arithmetic solutions lower the response NLL by a clear margin.

    Fails if the SFT step's gradient has the wrong sign, never reaches the optimizer, or the loss is computed on
    other tokens than the ones trained (the reported loss must track the measured response NLL)."""
    batch = examples[:16]
    before = response_nll(trainer, batch)
    losses = [trainer.sft_step(batch)["loss"] for _ in range(4)]
    after = response_nll(trainer, batch)
    print(f"SFT response NLL: {before:.3f} -> {after:.3f}; step losses {[round(x, 3) for x in losses]}")
    assert losses[0] == pytest.approx(before, rel=1e-4)
    assert after < 0.7 * before, (before, after, losses)
    assert losses[-1] < losses[0]
