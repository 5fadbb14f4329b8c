#!/bin/bash
# Qwen3-30B-A3B GRPO with R3 on NODES 8-GPU nodes (2, 4, 6, ...): the first half of the nodes train (Megatron,
# EP = their GPUs), the other half serve (one vLLM engine of TP 4 per 4 GPUs).
#   NODES=2 CKPT=/path/to/Qwen3-30B-A3B DATA=/data/dapo-math-17k.jsonl slurm/examples/qwen3_30b_a3b_multinode.sh
# Same knobs as qwen3_30b_a3b_4p4_1node.sh; all nodes must share the repository and CKPT at the same paths.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${CKPT:?set CKPT to the Hugging Face folder of Qwen3-30B-A3B}"
: "${DATA:?set DATA to the prompt dataset (data=dapo_math, data.path)}"
NODES=${NODES:-2}
if (( NODES < 2 || NODES % 2 )); then
    echo "error: NODES=$NODES; this layout needs an even number of nodes (>= 2), half training, half serving" >&2
    exit 2
fi
gpus=$(( NODES * 8 / 2 ))
# The layout's name goes into the run name, hence run.output_dir: runs on different node counts must not resume
# from each other's checkpoints.
layout="disaggregated_${NODES}n_${gpus}p${gpus}"
# Intentionally word-split: SBATCH_ARGS holds several flags.
# shellcheck disable=SC2086
exec sbatch --nodes="$NODES" --gres=gpu:8 --exclusive --job-name="qwen3-30b-r3-${NODES}n" ${SBATCH_ARGS:-} slurm/ray.sub \
    experiment=qwen3_30b_r3_4p4 parallelism=disaggregated_2n_8p8 parallelism.name="$layout" \
    parallelism.trainer.num_gpus="$gpus" parallelism.trainer.expert_parallel="$gpus" \
    parallelism.rollout.num_gpus="$gpus" parallelism.rollout.num_engines=$(( gpus / 4 )) \
    model.checkpoint="$CKPT" data.path="$DATA" "$@"
