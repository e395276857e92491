"""Shared test helpers: GPU counts, skip markers, integer-valued data."""
import os

# Lease rule of the GPU hosts, inherited by every child process: no NVLink multicast.
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_k, "0" if _k == "NCCL_NVLS_ENABLE" else "1")

import pytest
import torch


def gpu_count():
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def needs_gpus(n):
    have = gpu_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs, this machine has {have}")
