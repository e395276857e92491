"""Fixtures, markers and hooks only: GPU counts, the skip marker and the `gpu` marker (from
_gpu_tier.py, which also holds PYCCL_EXPECT_GPUS and the split pass count).  Helper modules are the
tests/_*.py files (stand-ins in _fakes.py); scripts run as child processes are tests/child_*.py."""
import os

# The suite's runs keep NVLink SHARP and multicast off unless set (pyccl and pyccl.bench leave
# them to the user): every child process, benchmark runs and ranks included, inherits them.
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_k, "0" if _k == "NCCL_NVLS_ENABLE" else "1")

# gpu_count/needs_gpus: tests import them from here; the hooks take effect by being named here
# (after the loop above, which the helpers' imports must see: E402)
from _gpu_tier import (bounded_in_process, gpu_count, needs_gpus, needs_ranks,  # noqa: F401,E402
                       pytest_collection_modifyitems, ranks_share_gpus,
                       pytest_runtest_makereport, pytest_sessionstart, pytest_terminal_summary)
