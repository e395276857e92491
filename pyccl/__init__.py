"""pyccl: NCCL collectives for PyTorch tensors from a small C extension.

`from pyccl import nccl` is a drop-in for `torch.cuda.nccl`; `pyccl.Communicator`
is one rank of an NCCL communicator for multi-process programs.  Importing
needs no GPU: GPU work raises pyccl.CudaError when none is there.
"""
# torch first: it loads the libnccl and libcudart that pyccl must share
# (one NCCL per process), which the C side then finds already in memory.
import torch  # noqa: F401

from . import _C, _libs

_C._set_library_candidates(_libs.nccl_candidates(), _libs.cudart_candidates())

from ._C import (  # noqa: E402
    AVG,
    MAX,
    MIN,
    NCCL_UNIQUE_ID_BYTES,
    PROD,
    SUM,
    Communicator,
    CudaError,
    NcclError,
)
from . import nccl  # noqa: E402

__version__ = "0.1.0"


def unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes): make it on one rank, share it."""
    return _C._nccl_unique_id()


def init_rank(world_size: int, unique_id: bytes, rank: int, device=None) -> Communicator:
    """Same as Communicator(world_size, unique_id, rank, device)."""
    return Communicator(world_size, unique_id, rank, device)


__all__ = [
    "AVG", "MAX", "MIN", "PROD", "SUM", "NCCL_UNIQUE_ID_BYTES",
    "Communicator", "CudaError", "NcclError", "init_rank", "nccl", "unique_id",
]
