"""The check before GPU work that starts in Python (pyccl.empty, pyccl.mem_pool,
init_from_env/init_from_mpi, the torch.distributed backend): pyccl.CudaError in
pyccl's words when there is no GPU, or when torch itself was built without CUDA."""
from __future__ import annotations

import torch

from . import _C


def need_gpu(op: str) -> int:
    """The number of CUDA devices; pyccl.CudaError naming `op` when there is none or torch has no CUDA."""
    n = _C._gpu_count(op)  # CudaError "<op>: no CUDA GPU is available (...)"
    if getattr(torch.version, "cuda", None) is None:
        raise _C.CudaError(f"{op}: this torch ({torch.__version__}) is built without CUDA; "
                           "pyccl needs a CUDA build of torch")
    return n
