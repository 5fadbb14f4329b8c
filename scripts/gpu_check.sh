#!/usr/bin/env bash
# The GPU check: the GPU-marked trainer tests on a machine with ONE GPU, Python 3.12 and CUDA torch, but no network
# and no vLLM (Megatron's CUDA path: local spec on CUDA against transformers, NCCL with world size 1, replay, the
# distributed optimizer with CPU offload, export). Finishes within 8 minutes and prints a summary; exit 0 = passed.
#
#   scripts/gpu_check.sh --download   # here, with network: puts the wheels in scripts/gpu_check_wheels/ (~3 MB,
#                                     # git-ignored; carry that folder with the checkout to the GPU machine)
#   scripts/gpu_check.sh [pytest args] # there: installs the wheels offline, runs `pytest -m gpu` over the train tests
#
# What the GPU machine must already have: torch with CUDA, numpy, transformers, tokenizers, safetensors, PyYAML,
# packaging, pytest, pytest-timeout. What travels: Megatron-core 0.19.x (Python 3.12 only) and the config stack
# (hydra-core, omegaconf, antlr4-python3-runtime), all pure Python or small. vLLM and TransformerEngine are too large
# to travel, so the engine is not checked here and Megatron runs its local (non-TE) spec.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS=scripts/gpu_check_wheels
# the versions pyproject's trainer extra and base dependencies resolve to; antlr 4.9.3 (hydra's pin) is an sdist only
MEGATRON=megatron-core==0.19.2
CONFIG_STACK=(hydra-core==1.3.8 omegaconf==2.3.1)
ANTLR=antlr4-python3-runtime==4.9.3

die() { echo "gpu_check: $*" >&2; exit 2; }

if [ "${1:-}" = "--download" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # binary wheels for the target (CPython 3.12 on x86_64 Linux) whatever Python runs this
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$WHEELS" "$MEGATRON" "${CONFIG_STACK[@]}"
  # a pure-Python wheel built from the sdist, so the offline install needs no build step
  "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$ANTLR"
  ls -l "$WHEELS"
  du -sh "$WHEELS"
  exit 0
fi

"$PY" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' \
  || die "$("$PY" -V 2>&1) found; Megatron-core 0.19 needs Python 3.12 (set PYTHON=...)"
"$PY" -c 'import torch' 2>/dev/null || die "torch is not importable with $PY"
compgen -G "$WHEELS/*.whl" >/dev/null \
  || die "no wheels in $WHEELS: run 'scripts/gpu_check.sh --download' on a machine with network and carry the folder"

site="$(mktemp -d /tmp/r3rl-gpu-check.XXXXXX)"
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$site" "$WHEELS"/*.whl
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# checkpoints are local folders (the tiny model is generated); never reach for a hub on a machine without network
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

PYTHONWARNINGS=ignore "$PY" - 2>/dev/null <<'EOF'
import sys, torch, megatron.core, hydra, omegaconf, transformers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
print(f"gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__},"
      f" megatron-core {megatron.core.__version__}, hydra-core {hydra.__version__}, omegaconf {omegaconf.__version__}, transformers {transformers.__version__};"
      f" CUDA GPU: {gpu}")
EOF

start=$(date +%s)
set +e
timeout 480 "$PY" -m pytest -m gpu tests/integration/train tests/unit/train -p no:cacheprovider -q -rA \
  --timeout 300 "$@"
rc=$?
set -e
secs=$(( $(date +%s) - start ))

if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu_check: NOT CHECKED in ${secs}s: no CUDA GPU visible, so the GPU tests above were collected and skipped"
  exit 3
fi
case $rc in
  0) echo "gpu_check: PASSED in ${secs}s" ;;
  5) echo "gpu_check: FAILED: no GPU-marked tests were selected" ;;
  124) echo "gpu_check: FAILED: over the 8-minute budget (stopped after ${secs}s)" ;;
  *) echo "gpu_check: FAILED (pytest exit $rc) in ${secs}s" ;;
esac
exit $rc
