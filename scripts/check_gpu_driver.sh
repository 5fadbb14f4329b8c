#!/usr/bin/env bash
# `make venv` (gpu profile) runs this before installing anything: the stack the gpu extra pins needs a CUDA 13 driver.
# vLLM 0.32.0's wheel requires torch 2.13.0, whose CUDA build is for CUDA 13 (driver >= 580), and TransformerEngine's
# PyTorch extension is an sdist compiled on this node against that torch.
#
#   scripts/check_gpu_driver.sh            # reads the driver version with nvidia-smi
#   scripts/check_gpu_driver.sh 580.65.06  # or takes it as an argument (or R3RL_DRIVER_VERSION), e.g. in tests
#
# Exit 0: the driver is new enough (a missing CUDA toolkit is only warned about); 1: it is too old; 2: no version.
set -euo pipefail
MIN_DRIVER=580  # CUDA 13.0's minimum Linux driver (580.65.06 shipped with it)

version="${1:-${R3RL_DRIVER_VERSION:-}}"
if [ -z "$version" ]; then
  version="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')" \
    || version=""
fi
if ! [[ "$version" =~ ^([0-9]+)(\.[0-9]+)*$ ]]; then
  echo "check_gpu_driver: cannot read the NVIDIA driver version (got '${version}'); 'nvidia-smi" \
    "--query-gpu=driver_version --format=csv,noheader' must print it. PROFILE=cpu installs the CPU stack." >&2
  exit 2
fi
major=$((10#${BASH_REMATCH[1]}))

if [ "$major" -lt "$MIN_DRIVER" ]; then
  cat >&2 <<EOF
check_gpu_driver: NVIDIA driver $version is too old for the gpu profile: it needs driver >= $MIN_DRIVER (CUDA 13).
  vLLM 0.32.0 (pyproject's gpu extra) pins torch 2.13.0, whose CUDA build is for CUDA 13 and does not run on an
  older driver; TransformerEngine's PyTorch extension is then compiled here against that torch, with the CUDA 13
  toolkit (nvcc and headers: CUDA_HOME, or NVTE_CUDA_INCLUDE_PATH for the headers) and cuDNN >= 9.3.
  Upgrade the driver to $MIN_DRIVER or newer, or install the CPU stack with 'make venv PROFILE=cpu'.
EOF
  exit 1
fi

echo "check_gpu_driver: NVIDIA driver $version >= $MIN_DRIVER: CUDA 13 builds run (torch 2.13.0 for vLLM 0.32.0)"
# TransformerEngine compiles its PyTorch extension on this node: say so now rather than after vLLM's download
cuda_home="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}"
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x "$cuda_home/bin/nvcc" ]; then
  echo "check_gpu_driver: warning: no nvcc on PATH or in $cuda_home/bin: TransformerEngine's PyTorch extension is" \
    "built here and needs the CUDA 13 toolkit (set CUDA_HOME) and cuDNN >= 9.3" >&2
fi
exit 0
