#!/bin/bash
# Qwen3-30B-A3B GRPO with R3 on one 8-GPU node: GPUs 0-3 train (Megatron, EP 4), GPUs 4-7 serve (vLLM, TP 4).
#   CKPT=/path/to/Qwen3-30B-A3B DATA=/data/dapo-math-17k.jsonl slurm/examples/qwen3_30b_a3b_4p4_1node.sh [overrides]
# Baseline without R3: add rollout=vllm. Partition/account/time: SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT
# (sbatch reads them), or SBATCH_ARGS="--qos=... --time=...". The job resumes from its latest checkpoint when it is
# submitted again with the same overrides (run.output_dir is derived from them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${CKPT:?set CKPT to the Hugging Face folder of Qwen3-30B-A3B}"
: "${DATA:?set DATA to the prompt dataset (data=dapo_math, data.path)}"
# Intentionally word-split: SBATCH_ARGS holds several flags.
# shellcheck disable=SC2086
exec sbatch --nodes=1 --gres=gpu:8 --exclusive --job-name=qwen3-30b-r3-4p4 ${SBATCH_ARGS:-} slurm/ray.sub \
    experiment=qwen3_30b_r3_4p4 model.checkpoint="$CKPT" data.path="$DATA" "$@"
