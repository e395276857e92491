"""pyccl's collectives as torch custom ops, for torch.compile.

Importing pyccl registers them (torch.library) as `torch.ops.pyccl.<op>`:

    all_reduce(Tensor input, str group, str op="sum") -> Tensor
    all_reduce_(Tensor(a!) tensor, str group, str op="sum") -> ()
    all_gather(Tensor input, str group, int group_size) -> Tensor   (along dim 0)
    reduce_scatter(Tensor input, str group, int group_size, str op="sum") -> Tensor  (along dim 0)
    broadcast(Tensor input, str group, int root) -> Tensor
    broadcast_(Tensor(a!) tensor, str group, int root) -> ()
    all_to_all_single(Tensor input, str group, int group_size) -> Tensor  (equal parts of dim 0)

`group` names the communicator: a `Communicator.name`, or the `group_name` of
a torch.distributed group on backend "pyccl".  Where the output's shape depends
on the number of ranks, that number is an argument too (checked against the
group): the compiler and its caches see shapes from the arguments alone.  The functions below take the
communicator or the group itself and find the name, in a way torch.compile
traces without a graph break:

    y = pyccl.ops.all_reduce(x, comm)       # comm: pyccl.Communicator or a "pyccl" ProcessGroup

(A name instead of the object works in eager code; compiled code passes the object.)

Each op has a fake implementation (shapes only), so the compiler sees shapes
without running anything; the functional forms (no `_`) are the ones CUDA
graphs (`mode="reduce-overhead"`) take without copies.  op is a reduction in
any of pyccl's spellings: "sum", "prod", "min", "max", "avg" (any case),
pyccl.SUM/PROD/MIN/MAX/AVG or a torch.distributed.ReduceOp; the functions
below pass it to the ops by name.  The work is enqueued on the current stream, as every
pyccl collective.  NCCL's destroy waits until every CUDA graph that captured work of the
communicator is freed: free torch.compile's graphs first
(`pyccl.distributed.free_compiled_cuda_graphs()`, or `torch._dynamo.reset()`)
before `comm.destroy()`; `dist.destroy_process_group()` on a "pyccl" group does
it by itself.  There is no autograd formula: wrap an op in a
torch.autograd.Function for training (a tensor-parallel layer's backward is
usually the identity or the other collective, which only the model knows).
"""
from typing import TYPE_CHECKING, Union

import torch

from . import _C

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, ReduceOp

    # (no `from __future__ import annotations` here: torch.library reads the ops' annotations)
    _Group = Union[_C.Communicator, ProcessGroup, str]
    _Op = Union[str, int, ReduceOp]

# torch's names of the reductions (as its functional collectives spell them) -> pyccl's
REDUCE_OPS = {"sum": _C.SUM, "prod": _C.PROD, "min": _C.MIN, "max": _C.MAX, "avg": _C.AVG}
_NAMES = {v: k for k, v in REDUCE_OPS.items()}


def _redop(opname, op):
    """pyccl's op (an int) for `op` in any spelling; the reading is the Communicator's (C)."""
    return _C._reduce_op(f"pyccl.ops.{opname}", op)


def _assume_constant(fn):
    # torch.compile evaluates the op's name while tracing instead of tracing into C.
    # torch.compiler.assume_constant_result imports torch._dynamo (about a second) only to set
    # this mark on fn; set it here so that importing pyccl leaves the compiler unloaded
    # (tests/test_ops_cpu.py checks the mark is the one torch's function sets).
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant
def _op_name(opname, op):
    """The name the ops' schemas take ("sum", ...) for `op` in any spelling."""
    return _NAMES[_redop(opname, op)]


def _dist_ops():
    """torch.distributed's ReduceOp values pyccl has, each with its name (none without
    torch.distributed)."""
    try:
        from torch.distributed import ReduceOp
    except ImportError:
        return ()
    return tuple((getattr(ReduceOp, k.upper() if k != "prod" else "PRODUCT"), k)
                 for k in REDUCE_OPS)


_DIST_OPS = _dist_ops()


def _name(opname, op):
    # a name in lower case goes through as it is (checked by the op itself)
    if type(op) is str and op in REDUCE_OPS:
        return op
    # dist.ReduceOp.X by identity: torch.compile folds `is` on them, while torch 2.11 cannot
    # pass one to a function assumed constant (_op_name)
    for value, name in _DIST_OPS:
        if op is value:
            return name
    return _op_name(opname, op)


def _process_group(name):
    try:
        from torch._C._distributed_c10d import _resolve_process_group
    except ImportError:  # torch without torch.distributed
        return None
    try:
        return _resolve_process_group(name)
    except RuntimeError:  # "Could not resolve the process group registered under the name ..."
        return None


def communicator(opname: str, group: str) -> _C.Communicator:
    """The live pyccl.Communicator that `group` (a str) names, else ValueError naming `opname`."""
    if not isinstance(group, str):
        raise TypeError(f"pyccl.ops.{opname}: group must be a str (a Communicator's name or a "
                        f"torch.distributed group name), got {type(group).__name__}")
    comm = _C._communicator(group)
    if comm is not None:
        return comm
    pg = _process_group(group)
    if pg is None:
        raise ValueError(f"pyccl.ops.{opname}: group {group!r} names no live pyccl Communicator and no "
                         "torch.distributed process group")
    comm = getattr(pg, "communicator", None)  # ProcessGroupPyccl's
    if comm is None:
        raise ValueError(f"pyccl.ops.{opname}: group {group!r} is a torch.distributed group on backend "
                         f"{_backend_name(pg)!r}, not \"pyccl\"")
    return comm


def _backend_name(pg):
    try:
        return pg.name()
    except Exception:  # noqa: BLE001 (only for the message)
        return type(pg).__name__


def group_name(group: "_Group") -> str:
    """The `group` argument of torch.ops.pyccl.* for `group`: a pyccl.Communicator (its .name),
    a torch.distributed ProcessGroup on backend "pyccl" (its group_name), or a name (itself).

    torch.compile traces it without a graph break: Communicator.name is a plain
    attribute, and a ProcessGroup's group_name is one torch's compiler knows.
    """
    return _group("group_name", group)


def _group(opname, group):
    if isinstance(group, str):
        return group
    if isinstance(group, _C.Communicator):
        return group.name
    if _ProcessGroup is not None and isinstance(group, _ProcessGroup):
        return group.group_name
    raise TypeError(f"pyccl.ops.{opname}: group must be a pyccl.Communicator, a torch.distributed "
                    f"ProcessGroup on backend \"pyccl\" or the name of one (str), got {type(group).__name__}")


def _size(opname, group):
    """The number of ranks of `group` (as _group accepts it)."""
    if isinstance(group, _C.Communicator):
        return group.size
    if _ProcessGroup is not None and isinstance(group, _ProcessGroup):
        # (not group.size(): torch 2.11's compiler cannot call it on a Python subclass; it
        # evaluates this function of the group's name while tracing)
        return _group_size_by_name(group.group_name)
    return communicator(opname, _group(opname, group)).size  # a name: eager code only


try:
    from torch.distributed import ProcessGroup as _ProcessGroup
    from torch.distributed.distributed_c10d import _get_group_size_by_name as _group_size_by_name
except ImportError:  # torch without torch.distributed
    _ProcessGroup = _group_size_by_name = None


def _dim0(opname, t):
    if t.dim() == 0:
        raise ValueError(f"pyccl.ops.{opname}: input must have at least one dimension (the ranks' parts "
                         "are along dim 0), got a 0-dim tensor")
    return t.shape[0]


def _parts(opname, t, size):
    n = _dim0(opname, t)
    if n % size:
        raise ValueError(f"pyccl.ops.{opname}: input's first dimension ({n}) is not a multiple of the "
                         f"number of ranks ({size})")
    return n // size


def _sized(opname, group, group_size):
    """The communicator `group` names, which must have `group_size` ranks."""
    comm = communicator(opname, group)
    if comm.size != group_size:
        raise ValueError(f"pyccl.ops.{opname}: group_size is {group_size} but group {group!r} has "
                         f"{comm.size} ranks")
    return comm


def _new(t, shape=None):
    """A contiguous tensor like t (the real and the fake implementations alike)."""
    if shape is None:
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return t.new_empty(shape)


# ---- the ops: real implementation, then fake (shapes, dtypes; checks that need no data) ----

@torch.library.custom_op("pyccl::all_reduce", mutates_args=())
def _all_reduce(input: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    redop = _redop("all_reduce", op)
    comm = communicator("all_reduce", group)
    out = _new(input)
    comm.all_reduce(input.contiguous(), redop, out=out)
    return out


@_all_reduce.register_fake
def _(input, group, op="sum"):
    _redop("all_reduce", op)
    communicator("all_reduce", group)
    return _new(input)


@torch.library.custom_op("pyccl::all_reduce_", mutates_args=("tensor",))
def _all_reduce_(tensor: torch.Tensor, group: str, op: str = "sum") -> None:
    redop = _redop("all_reduce_", op)
    communicator("all_reduce_", group).all_reduce(tensor, redop)


@_all_reduce_.register_fake
def _(tensor, group, op="sum"):
    _redop("all_reduce_", op)
    communicator("all_reduce_", group)


@torch.library.custom_op("pyccl::all_gather", mutates_args=())
def _all_gather(input: torch.Tensor, group: str, group_size: int) -> torch.Tensor:
    comm = _sized("all_gather", group, group_size)
    out = _new(input, (_dim0("all_gather", input) * group_size,) + tuple(input.shape[1:]))
    comm.all_gather(input.contiguous(), out)
    return out


@_all_gather.register_fake
def _(input, group, group_size):
    _sized("all_gather", group, group_size)
    return _new(input, (_dim0("all_gather", input) * group_size,) + tuple(input.shape[1:]))


@torch.library.custom_op("pyccl::reduce_scatter", mutates_args=())
def _reduce_scatter(input: torch.Tensor, group: str, group_size: int, op: str = "sum") -> torch.Tensor:
    redop = _redop("reduce_scatter", op)
    comm = _sized("reduce_scatter", group, group_size)
    out = _new(input, (_parts("reduce_scatter", input, group_size),) + tuple(input.shape[1:]))
    comm.reduce_scatter(input.contiguous(), out, redop)
    return out


@_reduce_scatter.register_fake
def _(input, group, group_size, op="sum"):
    _redop("reduce_scatter", op)
    _sized("reduce_scatter", group, group_size)
    return _new(input, (_parts("reduce_scatter", input, group_size),) + tuple(input.shape[1:]))


@torch.library.custom_op("pyccl::broadcast", mutates_args=())
def _broadcast(input: torch.Tensor, group: str, root: int) -> torch.Tensor:
    out = _new(input)
    communicator("broadcast", group).broadcast(input.contiguous(), root, out=out)
    return out


@_broadcast.register_fake
def _(input, group, root):
    communicator("broadcast", group)
    return _new(input)


@torch.library.custom_op("pyccl::broadcast_", mutates_args=("tensor",))
def _broadcast_(tensor: torch.Tensor, group: str, root: int) -> None:
    communicator("broadcast_", group).broadcast(tensor, root)


@_broadcast_.register_fake
def _(tensor, group, root):
    communicator("broadcast_", group)


@torch.library.custom_op("pyccl::all_to_all_single", mutates_args=())
def _all_to_all_single(input: torch.Tensor, group: str, group_size: int) -> torch.Tensor:
    comm = _sized("all_to_all_single", group, group_size)
    _parts("all_to_all_single", input, group_size)
    out = _new(input)
    comm.all_to_all_single(input.contiguous(), out)
    return out


@_all_to_all_single.register_fake
def _(input, group, group_size):
    _sized("all_to_all_single", group, group_size)
    _parts("all_to_all_single", input, group_size)
    return _new(input)


# ---- what users call (eager or compiled) ----

def all_reduce(tensor: torch.Tensor, group: "_Group", op: "_Op" = "sum") -> torch.Tensor:
    """A new tensor: the reduction of `tensor` over the ranks of `group`."""
    return torch.ops.pyccl.all_reduce(tensor, _group("all_reduce", group), _name("all_reduce", op))


def all_reduce_(tensor: torch.Tensor, group: "_Group", op: "_Op" = "sum") -> torch.Tensor:
    """Reduce `tensor` in place over the ranks of `group`; returns it."""
    torch.ops.pyccl.all_reduce_(tensor, _group("all_reduce_", group), _name("all_reduce_", op))
    return tensor


def all_gather(tensor: torch.Tensor, group: "_Group") -> torch.Tensor:
    """A new tensor: every rank's `tensor`, concatenated along dim 0 in rank order."""
    return torch.ops.pyccl.all_gather(tensor, _group("all_gather", group), _size("all_gather", group))


def reduce_scatter(tensor: torch.Tensor, group: "_Group", op: "_Op" = "sum") -> torch.Tensor:
    """A new tensor: this rank's part (dim 0 split in size equal parts) of the reduction of `tensor`."""
    return torch.ops.pyccl.reduce_scatter(tensor, _group("reduce_scatter", group),
                                          _size("reduce_scatter", group), _name("reduce_scatter", op))


def broadcast(tensor: torch.Tensor, group: "_Group", root: int) -> torch.Tensor:
    """A new tensor: rank `root`'s `tensor` (`tensor` itself is left as it is)."""
    return torch.ops.pyccl.broadcast(tensor, _group("broadcast", group), root)


def broadcast_(tensor: torch.Tensor, group: "_Group", root: int) -> torch.Tensor:
    """Overwrite `tensor` with rank `root`'s in place; returns it."""
    torch.ops.pyccl.broadcast_(tensor, _group("broadcast_", group), root)
    return tensor


def all_to_all_single(tensor: torch.Tensor, group: "_Group") -> torch.Tensor:
    """A new tensor whose part i (dim 0 split in size equal parts) is this rank's part of rank i's `tensor`."""
    return torch.ops.pyccl.all_to_all_single(tensor, _group("all_to_all_single", group),
                                             _size("all_to_all_single", group))


__all__ = ["REDUCE_OPS", "all_gather", "all_reduce", "all_reduce_", "all_to_all_single", "broadcast",
           "broadcast_", "communicator", "group_name", "reduce_scatter"]
