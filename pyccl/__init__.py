"""pyccl: NCCL collectives for PyTorch tensors from a small C extension.

- `pyccl.Communicator`: one rank of an NCCL communicator, with the collectives
  as methods (all_reduce, broadcast, reduce, all_gather, reduce_scatter, send,
  recv, all_to_all, all_to_all_single, gather, scatter, barrier, split).
- `from pyccl import nccl`: a drop-in for `torch.cuda.nccl`.
- `dist.init_process_group("pyccl")`: importing pyccl registers it as a
  torch.distributed backend (pyccl/distributed.py).
- `pyccl.ops`: the collectives as torch custom ops (`torch.ops.pyccl.*`), so
  torch.compile traces them with fullgraph=True and CUDA graphs capture them.
- Registered memory: empty() and mem_pool() allocate with ncclMemAlloc;
  comm.register(t) / comm.register_window(t) register it with NCCL.
- Bootstrap: unique_id() + Communicator(...), init_from_env() (torchrun),
  init_from_mpi(), init_ranks() for several GPUs per process.

Importing needs no GPU: GPU work raises pyccl.CudaError when none is there.
Communicator(..., timeout=seconds) bounds every wait on peers: a lost peer
makes the others raise pyccl.NcclTimeoutError instead of hanging.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

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
    NcclTimeoutError,
    Registration,
)
from . import nccl  # noqa: E402
from .memory import empty, mem_pool  # noqa: E402
from .launch import init_from_env, init_from_mpi, init_ranks, place_rank  # noqa: E402
from .launch import _share_at_import  # noqa: E402
from ._api import group, premul_sum  # noqa: E402

_share_at_import()

if TYPE_CHECKING:
    import datetime


def _has_torch_distributed() -> bool:
    try:
        import torch.distributed
    except ImportError:  # a torch without it (or the CPU tests' stand-in torch)
        return False
    return torch.distributed.is_available()


if _has_torch_distributed():
    # registers the torch.distributed backend "pyccl" (CUDA tensors)
    from . import distributed  # noqa: E402,F401

if hasattr(getattr(torch, "library", None), "custom_op"):
    # registers torch.ops.pyccl.* (torch custom ops, for torch.compile)
    from . import ops  # noqa: E402,F401

from ._version import __version__ as __version__  # noqa: E402  (re-exported)


def unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes): make it on one rank, share it."""
    return _C._nccl_unique_id()


def init_rank(
    world_size: int,
    unique_id: bytes,
    rank: int,
    device: int | str | torch.device | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Communicator:
    """Same as Communicator(world_size, unique_id, rank, device, timeout)."""
    return Communicator(world_size, unique_id, rank, device, timeout)


__all__ = [
    "AVG", "MAX", "MIN", "PROD", "SUM", "NCCL_UNIQUE_ID_BYTES",
    "Communicator", "CudaError", "NcclError", "NcclTimeoutError", "Registration", "empty",
    "group", "init_from_env", "mem_pool",
    "init_from_mpi",
    "init_rank", "init_ranks", "nccl", "place_rank", "premul_sum", "unique_id",
]
