"""A random MoE of any family r3rl builds (``model=tiny_moe``: Qwen3-MoE, ``model=tiny_glm4_moe``: GLM-4.5) and a
byte-level BPE tokenizer made locally, so CPU runs and tests need no model hub.

Generation is deterministic (fixed seeds, fixed corpus): the same config gives the same files on every machine.
A crash never leaves half a checkpoint (``atomic_folder``).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
from pathlib import Path

from r3rl.config.families import QWEN3_MOE, family
from r3rl.config.schema import ModelConfig
from r3rl.fsutil import atomic_folder

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen3 uses it; enough for prompts wrapped by the data pipeline.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """Text the BPE is trained on: arithmetic in the shapes the prompt generator uses, plus some prose."""
    lines = [
        "What is 12 + 7? Think step by step and put the final answer in \\boxed{}.",
        "The answer is \\boxed{19}.",
        "Rollout routing replay keeps the experts of the rollout in the trainer.",
        "Mixture of experts models route every token to a few experts in each layer.",
        "The quick brown fox jumps over the lazy dog.",
    ]
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines.append(f"Compute {a} + {b} = {a + b}. Compute {a} * {b} = {a * b}. {a} - {b} = {a - b}.")
    return lines


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # one token per digit, as Qwen's tokenizer splits numbers: BPE merges ("11" + "1" for 111, "94" whole) would
    # make every sum a different lookup, and the tiny model could not learn arithmetic that carries to new numbers
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is too small for the tokenizer ({tok.get_vocab_size()})")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        unk_token=None, additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_hf_config(model: ModelConfig, eos_token_id: int, pad_token_id: int):
    """The transformers config of ``model``'s family and shape (``r3rl.config.families`` spells its fields)."""
    import transformers

    fam = family(model)
    fields = fam.hf_config(model)
    if fam is QWEN3_MOE:
        # Qwen3's unused dense width, and no dense layers (mlp_only_layers, decoder_sparse_step)
        fields.update(intermediate_size=model.moe_ffn_hidden_size * model.moe_topk, decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.0)
    return getattr(transformers, fam.config_class)(
        **fields, max_position_embeddings=model.max_position_embeddings, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, bos_token_id=None, torch_dtype="float32", initializer_range=model.init_std)


MARKER = "r3rl_generated.json"
# bumped when generation changes for the same config, so cached checkpoints are regenerated
# (2: the padding token's embedding row is random, not zero; 3: one token per digit)
GENERATOR_VERSION = 3


def _fingerprint(model: ModelConfig) -> dict:
    """What a generated checkpoint was made from; a cached one with another shape or seed is regenerated."""
    made_from = {k: v for k, v in vars(model).items()
                 if not k.startswith("_") and k not in ("checkpoint", "generate_if_missing")}
    return {**made_from, "generator_version": GENERATOR_VERSION}


def generate(model: ModelConfig, out_dir: str | os.PathLike) -> Path:
    """Write a random MoE of ``model``'s family and shape with its tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer(model.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    hf_config = build_hf_config(model, eos, pad)
    torch.manual_seed(model.init_seed)
    net = AutoModelForCausalLM.from_config(hf_config).to(torch.float32)
    # HF zeroes the pad token's embedding row. The engine may still sample that token, and a zero input makes the
    # first RMSNorm divide by sqrt(rms_norm_eps): its embedding gradient grows 1/sqrt(eps) = 1000-fold (the default
    # run's grad norm of 4,189 at step 3). A real checkpoint has no zero row; draw it like every other row.
    row = torch.Generator().manual_seed(model.init_seed)
    with torch.no_grad():
        net.get_input_embeddings().weight[pad].normal_(0.0, model.init_std, generator=row)
        # HF starts the expert-score correction bias at 0; a trained model's is not, and a zero bias would let a
        # converter that drops it pass every test
        for layer in family_bias_modules(net, model):
            layer.normal_(0.0, 4 * model.init_std, generator=row)
    with atomic_folder(out) as tmp:
        net.save_pretrained(tmp, safe_serialization=True)
        if model.mtp_layers:
            add_mtp_layers(tmp, model, row)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(_fingerprint(model), sort_keys=True))
    return out


def family_bias_modules(net, model: ModelConfig) -> list:
    """The expert-score correction bias tensors of a transformers model of ``model``'s family."""
    fam = family(model)
    if fam.router_bias is None:
        return []
    return [functools.reduce(getattr, fam.router_bias.split("."), layer.mlp)
            for layer in net.model.layers[model.first_k_dense:]]


def add_mtp_layers(folder: Path, model: ModelConfig, generator) -> None:
    """Append ``model.mtp_layers`` next-token-prediction modules to the saved checkpoint, named as GLM-4.5 and
    DeepSeek-V3 ship them: ``model.layers.{num_layers + i}.`` with a decoder layer's tensors plus ``eh_proj``,
    ``enorm``, ``hnorm`` and ``shared_head.norm``. transformers builds no MTP module, so they are drawn here; r3rl
    never trains or replays them and an export carries them over as they are."""
    import torch
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    last = f"model.layers.{model.num_layers - 1}."
    h = model.hidden_size
    for i in range(model.mtp_layers):
        mtp = f"model.layers.{model.num_layers + i}."
        for name, t in list(tensors.items()):
            if name.startswith(last):
                tensors[mtp + name[len(last):]] = torch.randn(t.shape, generator=generator) * model.init_std
        tensors[mtp + "eh_proj.weight"] = torch.randn((h, 2 * h), generator=generator) * model.init_std
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{mtp}{norm}.weight"] = torch.ones(h)
    save_file(tensors, str(file), metadata={"format": "pt"})


def ensure_checkpoint(model: ModelConfig) -> Path:
    """The checkpoint folder, generated first when the config allows; a clear error when it is missing.

    A folder this module generated is regenerated when the model config changed; any other checkpoint is used as
    it is and never overwritten. Concurrent callers (test workers, Ray actors) serialise on a lock file.
    """
    path = Path(model.checkpoint)
    if not model.generate_if_missing:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.checkpoint={model.checkpoint}: no config.json there. Point model.checkpoint at a local HF "
                f"checkpoint of {model.name} (runs never download from a model hub)."
            )
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = path / MARKER
        if marker.is_file():
            if json.loads(marker.read_text()) == json.loads(json.dumps(_fingerprint(model))):
                return path
        elif (path / "config.json").is_file():
            return path  # a checkpoint of someone else's making: use it, never overwrite it
        return generate(model, path)
