#!/usr/bin/env bash
# Set up (tools/setup.sh), then run the whole test suite.  Without GPUs the GPU
# tier is skipped; the summary counts the skips by reason (tests/_gpu_tier.py).
# Extra arguments go to pytest (-rs lists every skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "${PYTHON:-python3}" -m pytest tests -q -p no:cacheprovider "$@"
