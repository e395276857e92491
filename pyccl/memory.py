"""Memory NCCL can register as a symmetric window: pyccl.empty() and pyccl.mem_pool().

Both take their memory from ncclMemAlloc (cuMem-backed, NCCL >= 2.19), which
Communicator.register_window needs; torch's default caching allocator uses cudaMalloc.
"""
from __future__ import annotations

import operator
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any, SupportsIndex

from . import _C
from ._gpu import need_gpu


def _shape(shape: Any) -> tuple[int, ...]:  # Any: any object a user passed, checked here
    if isinstance(shape, bool):
        raise TypeError(f"empty: shape must be an int or a sequence of ints, got {shape!r}")
    try:
        return (operator.index(shape),)
    except TypeError:
        pass
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"empty: shape must be an int or a sequence of ints, got {type(shape).__name__}")
    dims: list[int] = []
    for d in shape:
        if isinstance(d, bool):
            raise TypeError(f"empty: shape must hold ints, got {d!r} in {tuple(shape)!r}")
        try:
            dims.append(operator.index(d))
        except TypeError:
            raise TypeError(f"empty: shape must hold ints, got {type(d).__name__} in {tuple(shape)!r}") from None
    return tuple(dims)


def _need_numpy() -> None:
    # torch reads __cuda_array_interface__'s typestr through NumPy; checked before allocating,
    # as torch keeps a reference to the buffer when it fails later (the memory would leak)
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise RuntimeError("empty: torch.as_tensor needs NumPy to wrap the memory "
                           "(__cuda_array_interface__); pip install numpy") from None


def empty(
    shape: SupportsIndex | Iterable[SupportsIndex],
    dtype: torch.dtype = torch.float32,
    device: int | str | torch.device | None = None,
) -> torch.Tensor:
    """An uninitialised tensor whose memory comes from ncclMemAlloc.

    `shape`: an int or a sequence of ints (no element may be 0: NCCL allocates no empty
    buffer); `device`: an int, 'cuda:N' or a torch.device (default: the current device).
    The memory is freed with ncclMemFree once the tensor and every view of it are gone.
    It can be registered with Communicator.register_window (a symmetric window).
    """
    dims = _shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"empty: dtype must be a torch.dtype, got {type(dtype).__name__}")
    for d in dims:
        if d < 0:
            raise ValueError(f"empty: shape must not hold negative sizes, got {dims!r}")
    numel = 1
    for d in dims:
        numel *= d
    if numel == 0:
        raise ValueError(f"empty: the tensor must have at least one element, got shape {dims!r}")
    nbytes = numel * dtype.itemsize
    if nbytes >= 1 << 63:
        raise ValueError(f"empty: {nbytes} bytes (shape {dims!r}, {dtype}) is too large")
    dev = _C._read_device("empty", "device", device)  # the Communicator's reading; None: current
    need_gpu("empty")
    _need_numpy()
    buf = _C._nccl_mem_alloc(nbytes, -1 if dev is None else dev)
    # zero-copy: torch keeps a reference to `buf` in the tensor's deleter
    # (tensor_from_cuda_array_interface), so ncclMemFree waits for the last view
    t = torch.as_tensor(buf, device=torch.device("cuda", buf.device))
    return t.view(dtype).view(dims)


_pool: torch.cuda.MemPool | None = None
_pool_lock = threading.Lock()


def mem_pool() -> torch.cuda.MemPool:
    """The process's torch.cuda.MemPool over ncclMemAlloc/ncclMemFree (made on first call).

        with torch.cuda.use_mem_pool(pyccl.mem_pool()):
            model = Model().cuda()     # parameters in memory NCCL can window-register

    torch's caching allocator serves the tensors from segments of that memory and keeps
    freed segments cached in the pool (returned by torch.cuda.empty_cache() once unused).
    """
    global _pool
    with _pool_lock:
        if _pool is None:
            need_gpu("mem_pool")
            alloc_name, free_name = _C._mem_pool_functions()  # loads NCCL, checks the version
            allocator = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, alloc_name, free_name)
            _pool = torch.cuda.MemPool(allocator.allocator())
        return _pool
