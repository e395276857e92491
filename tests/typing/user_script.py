"""A user's program that calls every public name of pyccl, for `mypy --strict`.

tests/test_stubs_cpu.py type-checks it (it is never run): pyccl's annotations and its `_C`
stub must let a strictly typed program use the whole API without an error or an ignore, and
`assert_type` pins what each call gives back.
"""
from __future__ import annotations

import datetime
from typing import Any, assert_type

import torch
import torch.distributed as dist
# torch.distributed's Store and the options its backend creators get, where torch's types name them
from torch._C._distributed_c10d import Store, _DistributedBackendOptions

import pyccl
import pyccl.distributed
import pyccl.nccl
import pyccl.ops


def constants() -> list[int]:
    assert_type(pyccl.__version__, str)
    assert_type(pyccl.NCCL_UNIQUE_ID_BYTES, int)
    return [pyccl.SUM, pyccl.PROD, pyccl.MAX, pyccl.MIN, pyccl.AVG,
            pyccl.nccl.SUM, pyccl.nccl.PROD, pyccl.nccl.MAX, pyccl.nccl.MIN, pyccl.nccl.AVG]


def bootstrap(world: int, rank: int) -> list[pyccl.Communicator]:
    uid = pyccl.unique_id()
    assert_type(uid, bytes)
    comms = [
        pyccl.Communicator(world, uid, rank),
        pyccl.Communicator(world, uid, rank, "cuda:0", 30.0),
        pyccl.Communicator(world, uid, rank, device=torch.device("cuda", 0),
                           timeout=datetime.timedelta(seconds=30)),
        pyccl.Communicator(world, uid, rank, timeout=30, blocking=True),
        pyccl.init_rank(world, uid, rank),
        pyccl.init_rank(world, uid, rank, device=0, timeout=datetime.timedelta(minutes=1)),
        pyccl.init_rank(world, uid, rank, timeout=None),
        pyccl.init_from_env(),
        pyccl.init_from_env(timeout=datetime.timedelta(seconds=120), device="cuda:1"),
        pyccl.init_from_env(timeout=None, device=torch.device("cuda", 1)),
        pyccl.init_from_mpi(),
        pyccl.init_from_mpi(device=0, timeout=datetime.timedelta(seconds=5)),
    ]
    comms += pyccl.init_ranks(world, uid, range(2), [0, "cuda:1"])
    assert_type(pyccl.place_rank(rank, world), int)
    return comms


def collectives(comm: pyccl.Communicator, x: torch.Tensor, parts: list[torch.Tensor],
                stream: torch.cuda.Stream) -> None:
    assert_type(comm.rank, int)
    assert_type(comm.size, int)
    assert_type(comm.device, int)
    assert_type(comm.name, str)
    assert_type(comm.handle, int)
    assert_type(comm.timeout, float | None)
    assert_type(comm.blocking, bool)
    assert_type(comm.destroyed, bool)
    assert_type(comm.all_reduce_info, dict[str, Any])
    comm.all_reduce(x)
    comm.all_reduce(x, pyccl.AVG, out=parts[0], stream=stream, algo="nccl")
    comm.all_reduce(x, op=pyccl.premul_sum(0.5))
    comm.all_reduce(x, op="max")
    comm.all_reduce_coalesced(parts, pyccl.SUM, algo=None)
    comm.broadcast(x, 0, out=parts[0], stream=None)
    comm.reduce(x, 0, pyccl.MIN, out=parts[0])
    comm.all_gather(x, parts)
    comm.all_gather(x, parts[0])
    comm.reduce_scatter(parts, x, pyccl.SUM)
    comm.send(x, 1, stream=stream)
    comm.recv(x, 0)
    comm.all_to_all(parts, parts)
    comm.all_to_all_single(x, parts[0], [1, 2], [2, 1])
    comm.gather(x, parts, 0)
    comm.gather(x, None, 0)
    comm.scatter(parts, x, 0)
    comm.scatter(None, x, 0)
    comm.barrier()
    with pyccl.group():
        comm.send(x, 1)
        comm.recv(parts[0], 1)
    comm.wait()
    comm.wait(timeout=2.5)
    comm.wait(timeout=datetime.timedelta(seconds=2))


def lifecycle(comm: pyccl.Communicator, x: torch.Tensor) -> pyccl.Communicator | None:
    half = comm.split(comm.rank % 2)
    assert_type(half, pyccl.Communicator | None)
    half = comm.split(0, key=comm.rank)
    smaller = comm.shrink([1])
    assert_type(smaller, pyccl.Communicator)
    failure = comm.get_async_error()
    assert_type(failure, pyccl.NcclError | None)
    with pyccl.Communicator(2, pyccl.unique_id(), 0) as scoped:
        assert_type(scoped, pyccl.Communicator)
    comm.abort()
    comm.destroy()
    return half


def memory(comm: pyccl.Communicator) -> int:
    buf = pyccl.empty(1024)
    buf = pyccl.empty((4, 256), dtype=torch.bfloat16, device="cuda:0")
    buf = pyccl.empty([8], torch.float16, torch.device("cuda", 0))
    assert_type(buf, torch.Tensor)
    with torch.cuda.use_mem_pool(pyccl.mem_pool()):
        pass
    reg = comm.register(buf)
    assert_type(reg, pyccl.Registration)
    with comm.register_window(buf) as win:
        assert_type(win.window, bool)
        assert_type(win.communicator, pyccl.Communicator)
    reg.close()
    assert_type(reg.closed, bool)
    assert_type(reg.tensor, Any)
    return reg.handle + reg.nbytes + reg.data_ptr


def premul(scale: float) -> float:
    op = pyccl.premul_sum(scale)
    op = pyccl.premul_sum(2)
    assert_type(op.premul_scalar, float)
    return op.premul_scalar


def errors(comm: pyccl.Communicator, x: torch.Tensor) -> str:
    try:
        comm.all_reduce(x)
    except pyccl.NcclTimeoutError as e:
        assert_type(e.timeout, float)
        return e.error_string
    except pyccl.NcclError as e:
        assert_type(e.code, int)
        assert_type(e.last_error, str)
        return e.error_string
    except pyccl.CudaError as e:
        assert_type(e.code, int)
        return e.error_string
    return ""


def torch_cuda_nccl_dropin(xs: list[torch.Tensor], ys: list[torch.Tensor],
                           streams: list[torch.cuda.Stream | None]) -> None:
    nccl = pyccl.nccl
    assert_type(nccl.is_available(xs), bool)
    assert_type(nccl.version(), tuple[int, int, int] | tuple[int, int, int, str])
    comm = nccl.init_rank(2, nccl.unique_id(), 0)
    assert_type(comm, pyccl.Communicator)
    nccl.all_reduce(xs)
    nccl.all_reduce(xs, ys, nccl.MAX, streams, [comm])
    nccl.reduce(xs, ys[0], root=0, op=nccl.SUM)
    nccl.reduce(xs, outputs=ys)
    nccl.broadcast(xs, 0, streams=None, comms=None)
    nccl.all_gather(xs, ys)
    nccl.reduce_scatter(xs, ys, op=nccl.AVG, comms=[comm])


def backend(group: dist.ProcessGroup | None, store: Store, opts: _DistributedBackendOptions,
            x: torch.Tensor) -> str:
    assert_type(pyccl.distributed.BACKEND_NAME, str)
    pg = pyccl.distributed.shrink_group([3])
    pg = pyccl.distributed.shrink_group({1, 2}, group=group)
    assert_type(pg, pyccl.distributed.ProcessGroupPyccl)
    assert_type(pg.communicator, pyccl.Communicator)
    op = pyccl.distributed.reduce_op("all_reduce", dist.ReduceOp.SUM)
    assert_type(op, int | pyccl.premul_sum)
    uid, key = pyccl.distributed.exchange_unique_id(store, 0, 2, "g")
    assert_type(uid, bytes)
    assert_type(key, str | None)
    pyccl.distributed.free_compiled_cuda_graphs()
    made = pyccl.distributed.create_process_group(opts)  # what torch calls for backend "pyccl"
    assert_type(made, pyccl.distributed.ProcessGroupPyccl)
    pg.communicator.all_reduce(x)
    return pg.group_name


def compiled(comm: pyccl.Communicator, x: torch.Tensor) -> torch.Tensor:
    name = pyccl.ops.group_name(comm)
    assert_type(name, str)
    assert_type(pyccl.ops.communicator("compiled", name), pyccl.Communicator)
    y = pyccl.ops.all_reduce(x, name, "avg")
    pyccl.ops.all_reduce_(y, comm, "sum")
    pyccl.ops.all_gather(y, comm)
    pyccl.ops.reduce_scatter(y, comm)
    pyccl.ops.broadcast(y, comm, 0)
    pyccl.ops.broadcast_(y, comm, 0)
    assert_type(pyccl.ops.REDUCE_OPS, dict[str, int])
    return pyccl.ops.all_to_all_single(y, comm)
