"""Fixtures, markers and hooks only: GPU counts and the skip marker (from _gpu_tier.py,
which also holds PYCCL_EXPECT_GPUS and the split pass count).  Helper modules are the
tests/_*.py files (stand-ins in _fakes.py); scripts run as child processes are tests/child_*.py."""
import os

# Lease rule of the GPU hosts, inherited by every child process: no NVLink multicast.
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_k, "0" if _k == "NCCL_NVLS_ENABLE" else "1")

# gpu_count/needs_gpus: tests import them from here; the hooks take effect by being named here
# (after the loop above, which the helpers' imports must see: E402)
from _gpu_tier import (bounded_in_process, gpu_count, needs_gpus, needs_ranks,  # noqa: F401,E402
                       ranks_share_gpus,
                       pytest_runtest_makereport, pytest_sessionstart, pytest_terminal_summary)
