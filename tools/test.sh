#!/usr/bin/env bash
# Set up (tools/setup.sh), then run the test suite.  Without GPUs the GPU tier is skipped; the
# summary counts the skips by reason (tests/_gpu_tier.py).
# Arguments go to pytest: test paths (tests/test_api_cpu.py, tests/x.py::test_y) run those
# instead of the whole suite (pyproject.toml's testpaths, `tests`); options alone (-rs lists
# every skip, -m "not gpu", -k NAME) apply to the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
