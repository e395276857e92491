"""Drop-in for torch.cuda.nccl: the same calls with the same results and errors.

`from pyccl import nccl` where a program had `import torch.cuda.nccl as nccl`.
One process drives one tensor per GPU (comms=None: a cached communicator
clique over those devices), or each process passes its own communicators from
init_rank (comms=[comm]).  Differences from torch are fixes only: init_rank
works on Python >= 3.10, broadcast honours root, fp8 is reduced natively and
bool is never reduced as bytes, communicators can be destroyed, NCCL errors
raise pyccl.NcclError instead of aborting, and in the one-tensor-per-process
form all_gather/reduce_scatter sizes use the communicator's rank count.
"""
from __future__ import annotations

import collections.abc
import warnings
from typing import TYPE_CHECKING

import torch

from . import _C

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"]

SUM = _C.SUM
PROD = _C.PROD
MAX = _C.MAX
MIN = _C.MIN
AVG = _C.AVG


def is_available(tensors: Iterable[torch.Tensor]) -> bool:
    """True when `tensors` can go to one call: dense, contiguous, CUDA, one per device."""
    seen: set[int] = set()
    for t in tensors:
        if t.is_sparse or not t.is_contiguous() or not t.is_cuda:
            return False
        dev = t.get_device()
        if dev in seen:
            return False
        seen.add(dev)
    return True


def version() -> tuple[int, int, int] | tuple[int, int, int, str]:
    """(major, minor, patch) of the NCCL in this process, plus the suffix if it has one."""
    code = _C._nccl_version()
    if code >= 10000:  # NCCL >= 2.9 encodes X*10000 + Y*100 + Z
        ver = (code // 10000, (code % 10000) // 100, code % 100)
    else:
        ver = (code // 1000, (code % 1000) // 100, code % 100)
    suffix = _C._nccl_version_suffix().decode("utf-8")
    return ver + (suffix,) if suffix else ver


def unique_id() -> bytes:
    """A fresh ncclUniqueId as bytes (NCCL_UNIQUE_ID_BYTES long)."""
    return _C._nccl_unique_id()


def init_rank(num_ranks: int, uid: bytes, rank: int) -> _C.Communicator:
    """This process's communicator of a `num_ranks` job, on the current device."""
    return _C._nccl_init_rank(num_ranks, uid, rank)


# The C bindings check `inputs` ("Inputs should be a collection of tensors"
# and the rest of torch's texts), so these wrappers stay one call deep.

def all_reduce(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor] | None = None,
    op: int = SUM,
    streams: Sequence[torch.cuda.Stream | None] | None = None,
    comms: Sequence[_C.Communicator] | None = None,
) -> None:
    """Reduce `inputs` (one tensor per device, or this rank's one tensor) into `outputs`.

    `outputs` defaults to `inputs` (in place); `op` is SUM, PROD, MAX, MIN or AVG.
    `streams`: one per tensor (default: each device's current stream); `comms`: from
    init_rank (default: a cached clique over the tensors' devices).  As torch.cuda.nccl.
    """
    _C._nccl_all_reduce(inputs, inputs if outputs is None else outputs, op, streams, comms)


def _root_output(
    outputs: Sequence[torch.Tensor], root: int, comms: Sequence[_C.Communicator] | None
) -> torch.Tensor | None:
    """The entry of an output list that belongs to the root rank."""
    if comms is None:
        return outputs[root]
    for out, comm in zip(outputs, comms):
        if getattr(comm, "rank", None) == root:
            return out
    return None


def reduce(
    inputs: Sequence[torch.Tensor],
    output: torch.Tensor | Sequence[torch.Tensor] | None = None,
    root: int = 0,
    op: int = SUM,
    streams: Sequence[torch.cuda.Stream | None] | None = None,
    comms: Sequence[_C.Communicator] | None = None,
    *,
    outputs: Sequence[torch.Tensor] | None = None,
) -> None:
    """Reduce `inputs` over the ranks into the root's `output` (default: the root's input).

    `outputs` (a list) is torch.cuda.nccl's deprecated form and warns.  Other arguments as
    all_reduce.
    """
    if outputs is not None:
        if output is not None:
            raise ValueError(
                "reduce: give either 'output' (one tensor) or the deprecated "
                "'outputs' (a list), not both")
        warnings.warn(
            "nccl.reduce with a list of outputs is deprecated; pass the root's "
            "output tensor as 'output'", FutureWarning, stacklevel=2)
        output = _root_output(outputs, root, comms)
    elif output is not None and not isinstance(output, torch.Tensor) and \
            isinstance(output, collections.abc.Sequence):
        warnings.warn(
            "nccl.reduce with a list of outputs is deprecated; pass the root's "
            "output tensor as 'output'", FutureWarning, stacklevel=2)
        output = _root_output(output, root, comms)
    # output=None: the root's own input receives the result (in place).
    _C._nccl_reduce(inputs, output, root, op, streams, comms)


def broadcast(
    inputs: Sequence[torch.Tensor],
    root: int = 0,
    streams: Sequence[torch.cuda.Stream | None] | None = None,
    comms: Sequence[_C.Communicator] | None = None,
) -> None:
    """Copy rank `root`'s tensor into every other tensor of `inputs`, in place."""
    _C._nccl_broadcast(inputs, root, streams, comms)


def all_gather(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    streams: Sequence[torch.cuda.Stream | None] | None = None,
    comms: Sequence[_C.Communicator] | None = None,
) -> None:
    """Every rank's input, in rank order, into each of `outputs` (rank count x input elements)."""
    _C._nccl_all_gather(inputs, outputs, streams, comms)


def reduce_scatter(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    op: int = SUM,
    streams: Sequence[torch.cuda.Stream | None] | None = None,
    comms: Sequence[_C.Communicator] | None = None,
) -> None:
    """Reduce `inputs` (rank count x output elements) and give rank r part r in `outputs`."""
    _C._nccl_reduce_scatter(inputs, outputs, op, streams, comms)
