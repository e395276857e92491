"""pyccl as a torch.distributed backend: `dist.init_process_group("pyccl")`.

Importing pyccl registers the backend name "pyccl" for CUDA tensors.  The
creator makes the NCCL unique id on rank 0, shares it through the store torch
gives it, and returns a `ProcessGroup` subclass (torch uses such an object as
the whole group; a Python subclass of the C++ `Backend` has no constructor on
torch 2.11).  Each operation enqueues the pyccl collective on the current
stream and returns a finished Work whose future is CUDA-aware: `wait()` makes
the waiting stream wait for the collective's stream, as NCCL's Work does.

What pyccl cannot do raises `RuntimeError("pyccl backend: <op> ... is not
supported")`: there is no fallback to another backend.  A bitwise ReduceOp
(BAND, BOR, BXOR), which NCCL cannot reduce with, is a ValueError, as with
torch's NCCL backend.
"""
from __future__ import annotations

import collections
import datetime
import inspect
import sys
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, overload

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp, _create_work_from_future

from . import _C, _api
from ._gpu import need_gpu

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from types import FrameType

    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
        Store,
        Work,
        _DistributedBackendOptions,
    )

_T = TypeVar("_T")

BACKEND_NAME = "pyccl"

_RedOp = ReduceOp.RedOpType
_PREMUL_SUM = _RedOp.PREMUL_SUM


def _unsupported(what: str) -> RuntimeError:
    return RuntimeError(f"pyccl backend: {what} is not supported")


def reduce_op(opname: str, op: ReduceOp | ReduceOp.RedOpType) -> int | _api.premul_sum:
    """pyccl's op for torch's `op` (a ReduceOp or a ReduceOp.RedOpType) in operation `opname`.

    PREMUL_SUM (whose factor only torch's ReduceOp holds) is made a pyccl.premul_sum here; every
    other op is read as the Communicator reads it (SUM, PRODUCT, MIN, MAX, AVG; the bitwise ops
    have no NCCL reduction: ValueError, as torch's NCCL backend).
    """
    try:
        return _C._reduce_op(f"pyccl backend: {opname}", op)
    except ValueError:
        # (isinstance(RedOpType, ReduceOp) is True through torch's metaclass: test the enum first)
        if (op if type(op) is _RedOp else op.op) != _PREMUL_SUM:
            raise
    # PREMUL_SUM: the factor is torch's
    # torch >= 2.12 exposes the factor (a float, or a tensor) as ReduceOp.factor
    factor = getattr(op, "factor", None)
    if factor is None:
        raise _unsupported(f"{opname} with ReduceOp.PREMUL_SUM on this torch "
                           f"({torch.__version__}: the factor is not readable from Python)")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or factor.device.type != "cpu":
            raise _unsupported(f"{opname} with ReduceOp.PREMUL_SUM whose factor is a tensor of "
                               f"{factor.numel()} elements on {factor.device} (only a number or a "
                               "1-element CPU tensor)")
        factor = factor.item()
    return _api.premul_sum(factor)


def _one(opname: str, tensors: Sequence[_T]) -> _T:
    if len(tensors) != 1:
        raise _unsupported(f"{opname} with {len(tensors)} tensors per process (one per process only)")
    return tensors[0]


def _no_root_tensor(opname: str, opts: BroadcastOptions | ReduceOptions) -> None:
    if opts.rootTensor != 0:
        raise _unsupported(f"{opname} with rootTensor={opts.rootTensor} (one tensor per process only)")


class ProcessGroupPyccl(dist.ProcessGroup):
    """One rank of a torch.distributed group backed by a pyccl.Communicator.

    Method names and argument shapes are torch's ProcessGroup's (lists of
    tensors plus an options object), so torch.distributed, DDP (from C++,
    through pybind's overrides) and DeviceMesh call them directly.  Where torch
    renamed a method across versions both names are here.
    """

    def __init__(self, comm: _C.Communicator, rank: int, size: int, group_name: str = "") -> None:
        super().__init__(rank, size)
        self._comm = comm
        self._group_name = group_name
        device = getattr(comm, "device", None)
        # A Future that knows the device records an event on its current stream at set_result
        # and makes the waiter's current stream wait on it (NCCL's Work semantics).
        # Without a device (the CPU tier's stand-in communicator) it is a plain finished Future.
        self._devices = [] if device is None else [torch.device("cuda", device)]
        self._device_id: int | None = None  # init_process_group(device_id=...)'s index, where one was given

    # ---- plumbing ----
    @property
    def communicator(self) -> _C.Communicator:
        """The pyccl.Communicator behind this group (for its own API: algo=, wait(), get_async_error())."""
        return self._comm

    def _work(self, value: object) -> Work:
        fut = torch._C.Future(self._devices)
        fut.set_result(value)
        return _create_work_from_future(fut)

    def name(self) -> str:
        """The backend's name, "pyccl"."""
        return BACKEND_NAME

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """The backend's name, "pyccl" (torch's spelling)."""
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        """The backend's name, "pyccl" (torch's spelling)."""
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        """The torch.distributed name of this group (the `group` argument of pyccl.ops)."""
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def _device_types(self) -> list[torch.device]:
        # Python code asks this for the device of object collectives and barrier tensors.
        return [torch.device("cuda")]

    # This group is its own backend: torch's Python code asks _get_backend(device) what it supports.
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        """False: this backend allocates no tensors for torch."""
        return False

    def _get_backend(self, device: torch.device) -> ProcessGroupPyccl:
        # init_process_group(device_id=cuda:i) asks this with that device right after creating
        # the group, whose communicator went on cuda:i (_bound_device); a communicator on
        # another device (device_id not found by the creator) is refused here.
        index, mine = getattr(device, "index", None), getattr(self._comm, "device", None)
        if index is not None and mine is not None and index != mine:
            raise ValueError(
                f"pyccl backend: device_id={device} but the communicator is on cuda:{self._comm.device} "
                f"(the current device when the group was made); call torch.cuda.set_device({index}) "
                "before init_process_group")
        return self

    def shutdown(self) -> None:
        """destroy_process_group() calls this: destroy the communicator (a failed one too: its
        kept handle and memory go).

        NCCL's destroy waits until every CUDA graph that captured work of the communicator
        is freed; torch.compile(mode="reduce-overhead") keeps its graphs until told, so they
        are freed first (they are recorded again on their next call)."""
        if not self._comm.destroyed:
            free_compiled_cuda_graphs()
        self._comm.destroy()  # a no-op once destroyed

    def abort(self) -> None:
        """dist.abort / torch's abort path: abort the communicator (Communicator.abort)."""
        self._comm.abort()

    def __repr__(self) -> str:
        return f"ProcessGroupPyccl(rank={self.rank()}, size={self.size()}, group_name={self._group_name!r})"

    # ---- collectives ----
    def allreduce(
        self,
        tensors: list[torch.Tensor] | torch.Tensor,
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """dist.all_reduce: Communicator.all_reduce of the one tensor, in place."""
        # the hot path (dist.all_reduce, DDP's buckets): keep it to a few attribute reads
        if type(tensors) is not list and isinstance(tensors, torch.Tensor):  # pg.allreduce(tensor, op)
            tensors = [tensors]
        if len(tensors) != 1:
            _one("allreduce", tensors)
        if opts is None:
            self._comm.all_reduce(tensors[0])
        else:
            self._comm.all_reduce(tensors[0], reduce_op("allreduce", opts.reduceOp
                                                        if type(opts) is AllreduceOptions else opts))
        return self._work(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None) -> Work:
        """dist.all_reduce_coalesced: one all_reduce_coalesced (one dtype) or one NCCL group."""
        op = _C.SUM if opts is None else reduce_op("allreduce_coalesced", opts.reduceOp)
        if len({t.dtype for t in tensors}) <= 1:
            self._comm.all_reduce_coalesced(tensors, op)  # one pack, one all_reduce, one unpack
        else:  # torch allows mixed dtypes here: one NCCL group of per-tensor all_reduces
            with _api.group():
                for t in tensors:
                    self._comm.all_reduce(t, op)
        return self._work(tensors)

    @overload
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None) -> Work: ...
    @overload
    def broadcast(self, tensors: torch.Tensor, opts: int) -> Work: ...

    def broadcast(self, tensors: Any, opts: Any = None) -> Work:
        """dist.broadcast: Communicator.broadcast of the one tensor from opts.rootRank."""
        if isinstance(tensors, torch.Tensor):  # pg.broadcast(tensor, root) overload
            root, tensors = opts, [tensors]
        else:
            root = 0 if opts is None else opts.rootRank
            if opts is not None:
                _no_root_tensor("broadcast", opts)
        self._comm.broadcast(_one("broadcast", tensors), root)
        return self._work(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> Work:
        """dist.reduce: Communicator.reduce of the one tensor into opts.rootRank."""
        _no_root_tensor("reduce", opts)
        self._comm.reduce(_one("reduce", tensors), opts.rootRank, reduce_op("reduce", opts.reduceOp))
        return self._work(tensors)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """dist.all_gather: the one input into the list of `size` outputs."""
        self._comm.all_gather(_one("allgather", input_tensors), _one("allgather", output_lists))
        return self._work(output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None) -> Work:
        """dist.all_gather_into_tensor: `input` from every rank into `output` (output first, as torch)."""
        self._comm.all_gather(input, output)
        return self._work([output])

    all_gather_single = _allgather_base  # torch >= 2.12's name

    def _in_one_group(
        self, opname: str, outputs: Sequence[Any], inputs: Sequence[Any], what: str,
        call: Callable[[Any, Any], None],
    ) -> Work:
        """call(input, output) for each pair, as one NCCL group; outputs and inputs pair up."""
        if len(outputs) != len(inputs):
            raise ValueError(f"pyccl backend: {opname}: {len(outputs)} {what} for {len(inputs)} inputs")
        with _api.group():
            for out, inp in zip(outputs, inputs):
                call(inp, out)
        return self._work(outputs)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """all_gather of each input into its output list, as one NCCL group."""
        return self._in_one_group("allgather_coalesced", output_lists, input_tensors, "output lists",
                                  self._comm.all_gather)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None
    ) -> Work:
        """all_gather_into_tensor of each pair, as one NCCL group."""
        return self._in_one_group("allgather_into_tensor_coalesced", outputs, inputs, "outputs",
                                  self._comm.all_gather)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """dist.reduce_scatter: the list of `size` inputs reduced, part `rank` into the output."""
        op = _C.SUM if opts is None else reduce_op("reduce_scatter", opts.reduceOp)
        self._comm.reduce_scatter(_one("reduce_scatter", input_lists), _one("reduce_scatter", output_tensors), op)
        return self._work(output_tensors)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> Work:
        """dist.reduce_scatter_tensor: `input` reduced, part `rank` into `output` (output first)."""
        op = _C.SUM if opts is None else reduce_op("reduce_scatter_tensor", opts.reduceOp)
        self._comm.reduce_scatter(input, output, op)
        return self._work([output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions | None = None
    ) -> Work:
        """reduce_scatter_tensor of each pair, as one NCCL group."""
        if len(outputs) != len(inputs):  # (before the op: the length is the first thing said wrong)
            raise ValueError(f"pyccl backend: reduce_scatter_tensor_coalesced: {len(outputs)} outputs for "
                             f"{len(inputs)} inputs")
        op = _C.SUM if opts is None else reduce_op("reduce_scatter_tensor_coalesced", opts.reduceOp)
        return self._in_one_group("reduce_scatter_tensor_coalesced", outputs, inputs, "outputs",
                                  lambda inp, out: self._comm.reduce_scatter(inp, out, op))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
        input_split_sizes: list[int], opts: AllToAllOptions | None = None,
    ) -> Work:
        """dist.all_to_all_single (output first, as torch); empty split lists mean equal parts."""
        # torch passes [] for "equal splits"
        self._comm.all_to_all_single(input, output, input_split_sizes or None, output_split_sizes or None)
        return self._work([output])

    all_to_all_single = alltoall_base

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        """dist.all_to_all: input_tensors[j] to rank j, output_tensors[i] from rank i."""
        sizes = {t.numel() for t in input_tensors} | {t.numel() for t in output_tensors}
        if len(sizes) <= 1:  # equal chunks: NCCL's all_to_all through the Communicator
            self._comm.all_to_all(input_tensors, output_tensors)
        else:
            # torch allows a size per peer (the sizes must match the peers'): one NCCL group
            # of a send and a receive per rank, as NCCL builds all_to_all itself
            if len(input_tensors) != self.size() or len(output_tensors) != self.size():
                raise ValueError(f"pyccl backend: alltoall: {len(input_tensors)} inputs and "
                                 f"{len(output_tensors)} outputs, expected {self.size()} each "
                                 "(one per rank)")
            with _api.group():
                for peer, (inp, out) in enumerate(zip(input_tensors, output_tensors)):
                    self._comm.send(inp, peer)
                    self._comm.recv(out, peer)
        return self._work(output_tensors)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        """dist.send / isend: the one tensor to rank `dst` (NCCL has no tags: order matches)."""
        # NCCL has no tags (ProcessGroupNCCL ignores them too): messages match in call order.
        self._comm.send(_one("send", tensors), dst)
        return self._work(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        """dist.recv / irecv: into the one tensor from rank `src`."""
        self._comm.recv(_one("recv", tensors), src)
        return self._work(tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> NoReturn:
        """Not supported (NCCL needs the source): raises RuntimeError."""
        raise _unsupported("recv_anysource")

    def gather(
        self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: GatherOptions
    ) -> Work:
        """dist.gather: every rank's tensor into the root's output list."""
        outputs = _one("gather", output_lists) if output_lists else None
        self._comm.gather(_one("gather", input_tensors), outputs, opts.rootRank)
        return self._work(output_lists)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> Work:
        """dist.scatter: the root's input list, part r to rank r."""
        inputs = _one("scatter", input_lists) if input_lists else None
        self._comm.scatter(inputs, _one("scatter", output_tensors), opts.rootRank)
        return self._work(output_tensors)

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        """dist.barrier: Communicator.barrier (blocks the host until every rank arrived)."""
        self._comm.barrier()
        return self._work([])

    def monitored_barrier(self, *args: object, **kwargs: object) -> NoReturn:
        """Not supported: raises RuntimeError."""
        raise _unsupported("monitored_barrier")

    def split_group(self, *args: object, **kwargs: object) -> NoReturn:
        """Not supported (use dist.new_group or dist.new_subgroups): raises RuntimeError."""
        raise _unsupported("split_group (use dist.new_group or dist.new_subgroups)")

    def merge_remote_group(self, *args: object, **kwargs: object) -> NoReturn:
        """Not supported: raises RuntimeError."""
        raise _unsupported("merge_remote_group")

    def _start_coalescing(self, *args: object, **kwargs: object) -> NoReturn:
        raise _unsupported("_start_coalescing (torch's NCCL-style coalescing manager)")

    def _end_coalescing(self, *args: object, **kwargs: object) -> NoReturn:
        raise _unsupported("_end_coalescing (torch's NCCL-style coalescing manager)")


def free_compiled_cuda_graphs() -> None:
    """Free the CUDA graphs torch.compile(mode="reduce-overhead") recorded in this process, if any."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is not None:
        trees.reset_cudagraph_trees()


# ---- creation ----

# creations per group name in this process: every member creates the groups of one name in
# the same order, so (name, count) names the same creation on every rank, also when a store
# outlives a destroy_process_group() (torchrun's agent store) and group names repeat.
_generation: "collections.Counter[str]" = collections.Counter()


def _unique_id() -> bytes:
    return _C._nccl_unique_id()


def exchange_unique_id(store: Store, rank: int, size: int, group_name: str) -> tuple[bytes, str | None]:
    """The unique id of this creation of group `group_name`: made on rank 0, read from `store` elsewhere."""
    gen = _generation[group_name]
    _generation[group_name] += 1
    key = f"pyccl/unique_id/{group_name}/{gen}"
    if size == 1:
        return _unique_id(), None
    if rank == 0:
        uid = _unique_id()
        store.set(key, uid)
        return uid, key
    return bytes(store.get(key)), None


def _new_communicator(
    size: int, uid: bytes, rank: int, timeout: float | None, device: int | None = None
) -> _C.Communicator:
    need_gpu("pyccl backend")  # pyccl.CudaError in pyccl's words, not torch's internals
    # device None: the current device, as the Communicator reads it.  Blocking, as torch's
    # "nccl" backend: the group's timeout watches the GPU work of every call (an event each),
    # and the unique id's exchange through the store, bounded by torch's timeout, has already
    # found every rank; a non-blocking handle would cost NCCL's thread per launch on each call.
    return _C.Communicator(size, uid, rank, device, timeout, blocking=True if timeout else None)


def _cuda_index(dev: Any) -> int | None:  # Any: whatever device_id= was given
    """The CUDA device index `dev` (a torch.device or an index, as device_id= takes) names, else None."""
    if isinstance(dev, int) and not isinstance(dev, bool) and dev >= 0:
        return dev
    if getattr(dev, "type", None) == "cuda" and dev.index is not None:
        return dev.index
    return None


# torch's own init_process_group (under its logging decorators), taken when pyccl is imported:
# a wrapper put around it later does not hide its frame
_INIT_CODE = getattr(inspect.unwrap(dist.distributed_c10d.init_process_group), "__code__", None)


def _init_call_device() -> int | None:
    """device_id= of the torch.distributed.init_process_group call that is making this group,
    read from that call's frame: torch up to 2.13 does not hand it to the creator.  None where
    no such call is running (new_group, a creator called directly) or it gave none."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _INIT_CODE:
            return _cuda_index(frame.f_locals.get("device_id"))
        frame = frame.f_back
    return None


def _bound_device(opts: _DistributedBackendOptions) -> int | None:
    """The CUDA device index of init_process_group(device_id=...): where torch tells the creator
    (the group it made, opts.process_group, holds it as bound_device_id), else from that call's
    arguments; a group made later (new_group, DeviceMesh) goes where the default group's went.
    None: the communicator goes on the current device."""
    groups = [getattr(opts, "process_group", None)]
    if dist.is_initialized():
        groups.append(dist.distributed_c10d._get_default_group())
    for pg in groups:
        if isinstance(pg, ProcessGroupPyccl):
            if pg._device_id is not None:
                return pg._device_id
            continue
        index = _cuda_index(getattr(pg, "bound_device_id", None))
        if index is not None:
            return index
    return _init_call_device()


def _seconds(timeout: float | datetime.timedelta | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def create_process_group(opts: _DistributedBackendOptions, pg_options: object = None) -> ProcessGroupPyccl:
    """The creator torch calls (extended API): a ProcessGroupPyccl of this rank."""
    if pg_options is not None:
        raise _unsupported(f"init_process_group/new_group with pg_options={pg_options!r} "
                           "(the group's timeout= is the communicator's timeout)")
    rank, size, name = opts.group_rank, opts.group_size, opts.group_id
    uid, key = exchange_unique_id(opts.store, rank, size, name)
    device_id = _bound_device(opts)
    comm = _new_communicator(size, uid, rank, _seconds(opts.timeout), device_id)
    if key is not None:
        # NCCL's init returned, so every rank has read the id: the key is not needed any more
        try:
            opts.store.delete_key(key)
        except Exception:  # noqa: BLE001 (a store without delete_key: the key just stays)
            pass
    pg = ProcessGroupPyccl(comm, rank, size, name)
    # Kept for the groups made from this one.  Not torch's bound_device_id: with that set,
    # DeviceMesh makes its subgroups with split_group, which needs NCCL's C++ backend.
    pg._device_id = device_id
    return pg


# torch.distributed's own shrink_group (torch >= 2.10) registers the new group through these; it
# builds the group from a C++ backend, which a Python group such as ProcessGroupPyccl is not.
_SHRINK_PARTS = ("_prepare_shrink_target_group", "_validate_and_process_excluded_ranks",
                 "_extract_group_metadata", "_cleanup_original_group", "_update_default_pg",
                 "_destroy_all_other_groups", "get_process_group_ranks", "_world",
                 "_register_process_group")


def _register_in_world(
    c10d: Any, pg: ProcessGroupPyccl, backend_name: str, store: Store, group_name: str,
    backend_config: object, rank_mapping: dict[int, int],
) -> None:
    """torch's _register_pg_in_world (torch >= 2.12), or the same steps where it is missing."""
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is not None:
        register(pg=pg, backend_name=backend_name, store=store, group_name=group_name,
                 backend_config=backend_config, rank_mapping=rank_mapping)
        return
    world = c10d._world
    world.pg_map[pg] = (backend_name, store)
    world.pg_names[pg] = group_name
    world.pg_backend_config[pg] = backend_config
    c10d._register_process_group(group_name, pg)
    world.pg_group_ranks[pg] = rank_mapping
    tag = f"ptd:{group_name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag


def shrink_group(
    ranks_to_exclude: Iterable[int], group: dist.ProcessGroup | None = None
) -> ProcessGroupPyccl:
    """torch.distributed.shrink_group for "pyccl" groups: a new group of the ranks not in
    `ranks_to_exclude` (ranks of `group`, default: the default group), renumbered in their
    order, over ``Communicator.shrink``.  Every remaining rank calls it, an excluded one does
    not; it also works after a peer died, on a group made with a timeout (its communicator
    failed and kept its handle).  The old group is destroyed; when it is the default group,
    the new one becomes the default and every other group is destroyed (as torch does).
    torch's own ``dist.shrink_group`` handles NCCL's C++ backend only."""
    c10d = dist.distributed_c10d
    missing = [n for n in _SHRINK_PARTS if not hasattr(c10d, n)]
    if missing:
        raise RuntimeError(f"pyccl.distributed.shrink_group: torch {torch.__version__} lacks "
                           f"{', '.join(missing)} (torch.distributed's shrink_group machinery)")
    info = c10d._prepare_shrink_target_group(group)
    pg = info["process_group"]
    if not isinstance(pg, ProcessGroupPyccl):
        raise TypeError(f"pyccl.distributed.shrink_group: the group's backend is not "
                        f"\"{BACKEND_NAME}\" ({type(pg).__name__}); use torch.distributed.shrink_group")
    excluded = c10d._validate_and_process_excluded_ranks(list(ranks_to_exclude), info)
    comm = pg.communicator.shrink(sorted(excluded))
    try:
        is_default = info["is_default_group"]
        if is_default:
            c10d._destroy_all_other_groups(exclude_group=pg)
        meta = c10d._extract_group_metadata(pg)
        remaining = [g for i, g in enumerate(c10d.get_process_group_ranks(pg)) if i not in excluded]
        c10d._cleanup_original_group(pg, is_default)  # destroys the old communicator
        new_pg = ProcessGroupPyccl(comm, comm.rank, comm.size, meta["new_group_name"])
        new_pg._device_id = pg._device_id
        if is_default:
            c10d._update_default_pg(new_pg)
        _register_in_world(c10d, new_pg, meta["backend_name"], meta["store"], meta["new_group_name"],
                           meta["backend_config"], {g: i for i, g in enumerate(remaining)})
    except BaseException:
        comm.destroy()
        raise
    return new_pg


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # extended_api=True: the creator gets the group's name (group_id) with the store, rank, size
    # and timeout, so the group has its name from the start and the store key is per group.
    # devices as a list: a string would be iterated character by character (torch <= 2.13).
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cuda"])
    # torch 2.15's init_process_group attaches its flight recorder to a group unless its backend
    # records itself or the group has no device types.  Ours is a Python ProcessGroup with device
    # types (_device_types) but no C++ backend, where the recorder reads the group's name, so
    # init_process_group would raise "ProcessGroup name not set": the recorder leaves it alone.
    self_recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(self_recording, set):
        self_recording.add(BACKEND_NAME)


if dist.is_available():
    _register()
