#!/usr/bin/env bash
# Set up (tools/setup.sh), then all-reduce across every local GPU, one process
# per GPU.  Exits non-zero, saying why, on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "${PYTHON:-python3}" examples/01_all_reduce.py "$@"
