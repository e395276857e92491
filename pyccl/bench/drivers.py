"""How each benchmarked system runs one call, seen from inside one benchmark process.

A driver knows its process's devices and ranks, builds a zero-argument callable for a
(collective, placement, op, root) on given buffers -- or None where the system has no such call
(the report then reads N/A) -- and provides sync, a cross-process barrier, timing events and a
device description. pyccl, torch.distributed and torch.cuda.nccl are imported in the
constructors, so this module loads without a GPU or pyccl's extension.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import sizes

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier
    from types import ModuleType

    import torch

    import pyccl

DIST_PYCCL = "torch.distributed:pyccl"  # torch.distributed on pyccl's backend
PER_RANK = ("pyccl", "torch.distributed", DIST_PYCCL)
SINGLE = ("pyccl.nccl", "torch.cuda.nccl")
SYSTEMS = PER_RANK + SINGLE
# Not offered on the command line: torch.distributed's gloo backend on CPU tensors, timed by the
# wall clock, so the CPU tests can drive the whole multi-process pipeline without a GPU; and
# the one-process, tensor-per-device shape of SINGLE on CPU tensors, for the same reason.
CPU_SYSTEM = "gloo-cpu"
# --registered: NCCL's all_reduce (algo="nccl") on pyccl.empty buffers registered as symmetric
# windows (Communicator.register_window), pyccl's per-rank API otherwise
SYMM_SYSTEM = "nccl-symm"
CPU_LISTS_SYSTEM = "lists-cpu"
ONE_PROCESS = SINGLE + (CPU_LISTS_SYSTEM,)  # one process drives every rank


def make_driver(system: str, rank: int | None, nranks: int, rendezvous: bytes | int | None,
                barrier: Barrier | None, timeout: float) -> _Driver:
    """rank is None for the one process of a SINGLE system; rendezvous is the pyccl unique id
    or the loopback port of torch.distributed's TCP store."""
    if system == "pyccl":
        return _PycclComm(rank, nranks, rendezvous, barrier, timeout)
    if system == "torch.distributed":
        return _TorchDist(rank, nranks, rendezvous, barrier, timeout)
    if system == DIST_PYCCL:
        return _TorchDistPyccl(rank, nranks, rendezvous, barrier, timeout)
    if system == SYMM_SYSTEM:
        return _PycclSymm(rank, nranks, rendezvous, barrier, timeout)
    if system == CPU_SYSTEM:
        return _GlooCPU(rank, nranks, rendezvous, barrier, timeout)
    if system in SINGLE:
        return _Lists(system, nranks, timeout)
    if system == CPU_LISTS_SYSTEM:
        return _ListsCPU(nranks, timeout)
    raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")


class _Driver:
    can_graph: bool = True
    uses_cuda: bool = True
    devices: list[int]
    ranks: list[int]
    nranks: int
    timeout: float

    def __init__(self, devices: list[int], nranks: int, barrier: Barrier | None, timeout: float,
                 ranks: Sequence[int] | None = None) -> None:
        if self.uses_cuda:  # before any communicator: "current device" means this rank's GPU
            import torch
            torch.cuda.set_device(devices[0])
        self.devices, self.ranks, self.nranks = devices, list(devices if ranks is None else ranks), nranks
        self._barrier, self.timeout = barrier, timeout

    def sync(self) -> None:
        import torch
        for d in self.devices:
            torch.cuda.synchronize(d)

    def barrier(self) -> None:
        if self._barrier is not None:
            self._barrier.wait(self.timeout)

    def streams(self) -> Sequence[torch.cuda.Stream | None]:
        import torch
        return [torch.cuda.current_stream(d) for d in self.devices]

    def event(self) -> torch.cuda.Event:
        import torch
        return torch.cuda.Event(enable_timing=True)

    def place(self, dev: int) -> torch.device:
        import torch
        return torch.device("cuda", dev)

    def describe(self, rank: int, dev: int) -> str:
        import torch
        p = torch.cuda.get_device_properties(dev)
        return "#  Rank %2d Group %2d Pid %6d on %10s device %2d [0x%02x] %s" % (
            rank, 0, os.getpid(), socket.gethostname(), dev, getattr(p, "pci_bus_id", 0), p.name)

    def close(self) -> None:
        pass


class _PycclComm(_Driver):
    """pyccl's per-rank API: one Communicator per process."""
    comm: pyccl.Communicator
    pyccl: ModuleType  # the module, for its constants and pyccl.group
    rank: int

    def __init__(self, rank: int, nranks: int, uid: bytes, barrier: Barrier | None, timeout: float) -> None:
        import pyccl
        dev = pyccl.place_rank(rank, nranks)  # ranks beyond the GPU count share them
        super().__init__([dev], nranks, barrier, timeout, ranks=[rank])
        self.pyccl, self.rank = pyccl, rank
        self.comm = pyccl.Communicator(nranks, uid, rank, device=dev)
        self.ops: dict[str, int] = {name: getattr(pyccl, name.upper()) for name in sizes.OPS}

    def build(self, coll: str, placement: str, op: str, root: int,
              bufs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object] | None:
        (inp, out), = bufs
        c, o, ip = self.comm, self.ops.get(op), placement == "in-place"
        # --algo: auto (pyccl's choice), nccl, oneshot or twoshot; the forced own kernels read
        # N/A where they do not apply (dtype, op; all_gather and reduce_scatter have one-shot
        # only; above their buffer they run in chunks of it)
        algo = os.environ.get("PYCCL_BENCH_ALGO", "auto")
        if algo in ("oneshot", "twoshot") and coll in ("all_reduce", "all_gather", "reduce_scatter"):
            kinds = (self.pyccl.SUM, self.pyccl.MAX, self.pyccl.MIN)
            ok_dtype = str(inp.dtype) in ("torch.float32", "torch.float16", "torch.bfloat16",
                                          "torch.int32")
            if coll == "all_gather":
                if algo == "twoshot":
                    return None
            elif not (ok_dtype and o in kinds) or (coll == "reduce_scatter" and algo == "twoshot"):
                return None
        if coll == "all_reduce":
            if ip:
                return lambda: c.all_reduce(inp, o, algo=algo)
            return lambda: c.all_reduce(inp, o, out=out, algo=algo)
        if coll == "broadcast":
            return (lambda: c.broadcast(inp, root)) if ip else (lambda: c.broadcast(inp, root, out=out))
        if coll == "reduce":
            return (lambda: c.reduce(inp, root, o)) if ip else (lambda: c.reduce(inp, root, o, out=out))
        if coll in ("all_gather", "reduce_scatter"):
            # auto and nccl are NCCL's; oneshot pyccl's kernel
            kw = {"algo": algo} if algo == "oneshot" else {}
            if coll == "all_gather":
                return lambda: c.all_gather(inp, out, **kw)
            return lambda: c.reduce_scatter(inp, out, o, **kw)
        if coll == "sendrecv":
            if ip:  # one buffer sent and received in one group: NCCL orders neither, a race
                return None
            nxt, prv = (self.rank + 1) % self.nranks, (self.rank - 1) % self.nranks
            group = self.pyccl.group

            def sendrecv():
                with group():
                    c.send(inp, nxt)
                    c.recv(out, prv)
            return sendrecv
        if coll == "alltoall":
            return None if ip else (lambda: c.all_to_all(inp, out))  # nccl-tests has no in-place
        raise ValueError(coll)

    def close(self) -> None:
        self.comm.destroy()


class _PycclSymm(_PycclComm):
    """NCCL's all_reduce on symmetric windows: every buffer from pyccl.empty (ncclMemAlloc),
    registered with register_window on every rank (the same sizes everywhere, as the sweep
    allocates the same capacity on every rank); other collectives read N/A.  Needs NCCL >= 2.27;
    on an older one every entry reads N/A."""

    def __init__(self, rank, nranks, uid, barrier, timeout):
        super().__init__(rank, nranks, uid, barrier, timeout)
        self.ok = self.pyccl.nccl.version() >= (2, 27, 0)
        self.windows = []

    def buffers(self, cap, dtype, dev):
        """(send, recv) of cap elements: windows where this NCCL has them."""
        import torch
        if not self.ok:
            return (torch.empty(cap, dtype=dtype, device=self.place(dev)),
                    torch.empty(cap, dtype=dtype, device=self.place(dev)))
        pair = (self.pyccl.empty(cap, dtype=dtype, device=dev), self.pyccl.empty(cap, dtype=dtype, device=dev))
        self.windows += [self.comm.register_window(t) for t in pair]  # collective, same order everywhere
        return pair

    def release(self):
        self.sync()
        while self.windows:
            self.windows.pop().close()   # newest first, on every rank alike

    def build(self, coll, placement, op, root, bufs):
        if coll != "all_reduce" or not self.ok:
            return None
        (inp, out), = bufs
        c, o = self.comm, self.ops.get(op)
        if placement == "in-place":
            return lambda: c.all_reduce(inp, o, algo="nccl")
        return lambda: c.all_reduce(inp, o, out=out, algo="nccl")

    def close(self):
        self.release()
        super().close()


class _TorchDist(_Driver):
    """torch.distributed with the nccl backend; its collectives are in-place where it has no
    out-of-place form, and those placements read N/A."""

    backend = "nccl"

    def __init__(self, rank, nranks, port, barrier, timeout):
        import datetime
        import torch.distributed as dist

        if self.uses_cuda:
            import pyccl
            dev = pyccl.place_rank(rank, nranks)  # ranks beyond the GPU count share them
        else:
            dev = rank  # gloo on the CPU: a "device" per rank, for the tables
        super().__init__([dev], nranks, barrier, timeout, ranks=[rank])
        extra = {"device_id": self.place(dev)} if self.backend == "nccl" else {}
        # twice the benchmark's no-progress timeout: a silent peer is reported (with its
        # stacks) and killed by the parent's watchdog, not by this rank's own timeout first
        dist.init_process_group(self.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nranks, timeout=datetime.timedelta(seconds=2 * timeout),
                                **extra)
        self.dist, self.rank = dist, rank
        ro = dist.ReduceOp
        self.ops = {"sum": ro.SUM, "prod": ro.PRODUCT, "max": ro.MAX, "min": ro.MIN,
                    "avg": ro.AVG}

    def build(self, coll, placement, op, root, bufs):
        (inp, out), = bufs
        d, o, ip = self.dist, self.ops.get(op), placement == "in-place"
        if coll == "all_reduce":
            return (lambda: d.all_reduce(inp, op=o)) if ip else None
        if coll == "broadcast":
            return (lambda: d.broadcast(inp, src=root)) if ip else None
        if coll == "reduce":
            return (lambda: d.reduce(inp, dst=root, op=o)) if ip else None
        if coll == "all_gather":
            return lambda: d.all_gather_into_tensor(out, inp)
        if coll == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(out, inp, op=o)
        if coll == "sendrecv":
            if self.nranks == 1 or ip:  # see _PycclComm: in-place sendrecv is a race
                return None
            p2p = [d.P2POp(d.isend, inp, (self.rank + 1) % self.nranks),
                   d.P2POp(d.irecv, out, (self.rank - 1) % self.nranks)]

            def sendrecv():
                for work in d.batch_isend_irecv(p2p):
                    work.wait()
            return sendrecv
        if coll == "alltoall":
            return None if ip else (lambda: d.all_to_all_single(out, inp))
        raise ValueError(coll)

    def close(self):
        self.dist.destroy_process_group()


class _TorchDistPyccl(_TorchDist):
    """torch.distributed with pyccl's backend: what a DDP/FSDP user of pyccl gets per dist.* call."""

    backend = "pyccl"

    def __init__(self, rank, nranks, port, barrier, timeout):
        import pyccl  # noqa: F401  (registers the backend)
        super().__init__(rank, nranks, port, barrier, timeout)


class _WallEvent:
    """Stand-in for a CUDA event on CPU: the host clock at record()."""

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _OnCPU:
    """What the CPU stand-ins share: tensors on the CPU, wall-clock timed, nothing to sync."""
    can_graph, uses_cuda = False, False

    def sync(self):
        pass

    def event(self):
        return _WallEvent()

    def place(self, dev):
        return "cpu"

    def describe(self, rank, dev):
        where = "cpu" if dev is None else "cpu:%d" % dev
        return "#  Rank %2d Group %2d Pid %6d on %10s device %s" % (
            rank, 0, os.getpid(), socket.gethostname(), where)


class _GlooCPU(_OnCPU, _TorchDist):
    backend = "gloo"

    def streams(self):
        return [None]

    def describe(self, rank, dev):
        return _OnCPU.describe(self, rank, None)


class _Lists(_Driver):
    """torch.cuda.nccl's API (pyccl.nccl or torch.cuda.nccl): one process, a tensor per GPU."""
    can_graph = False  # one capture per device would be needed; torch.cuda.graph does one

    def __init__(self, system, nranks, timeout):
        if system == "pyccl.nccl":
            from pyccl import nccl as mod
        else:
            import torch.cuda.nccl as mod
        super().__init__(list(range(nranks)), nranks, None, timeout)
        self.mod = mod

    def build(self, coll, placement, op, root, bufs):
        m, ip = self.mod, placement == "in-place"
        ins, outs = [b[0] for b in bufs], [b[1] for b in bufs]
        o = sizes.OPS.index(op) if op in sizes.OPS else 0
        if coll == "all_reduce":
            return (lambda: m.all_reduce(ins, op=o)) if ip else (lambda: m.all_reduce(ins, outs, op=o))
        if coll == "broadcast":
            return (lambda: m.broadcast(ins, root=root)) if ip else None
        if coll == "reduce":
            if ip:
                return lambda: m.reduce(ins, root=root, op=o)
            return lambda: m.reduce(ins, output=outs[root], root=root, op=o)
        if coll == "all_gather":
            return lambda: m.all_gather(ins, outs)
        if coll == "reduce_scatter":
            return lambda: m.reduce_scatter(ins, outs, op=o)
        return None  # no sendrecv or alltoall in this API


class _ListsCPU(_OnCPU, _Driver):
    """_Lists' shape without a GPU: one process, one CPU tensor per "device", the collectives
    computed here with torch ops (placements N/A where _Lists has them N/A), wall-clock timed.
    Lets the CPU tests run the one-process path of the runner (rank None, one process reporting
    for every rank)."""

    def __init__(self, nranks, timeout):
        super().__init__(list(range(nranks)), nranks, None, timeout)

    def streams(self):
        return [None] * len(self.devices)

    def _reduce(self, tensors, op):
        import torch
        st = torch.stack(tensors)
        if op in ("sum", "avg"):
            r = st.sum(0)
        elif op == "prod":
            r = st.prod(0)
        elif op == "max":
            r = st.amax(0)
        else:
            r = st.amin(0)
        if op == "avg":
            r = r / self.nranks if r.is_floating_point() else torch.div(
                r, self.nranks, rounding_mode="floor")
        return r.to(tensors[0].dtype)

    def build(self, coll, placement, op, root, bufs):
        import torch
        ins, outs, ip = [b[0] for b in bufs], [b[1] for b in bufs], placement == "in-place"

        def all_reduce():
            r = self._reduce(ins, op)
            for o in outs:
                o.copy_(r)

        def broadcast():
            src = ins[root].clone()
            for t in ins:
                t.copy_(src)

        def reduce():
            (ins if ip else outs)[root].copy_(self._reduce(ins, op))

        def all_gather():
            whole = torch.cat([t.clone() for t in ins])
            for o in outs:
                o.copy_(whole)

        def reduce_scatter():
            r, n = self._reduce(ins, op), outs[0].numel()
            for k, o in enumerate(outs):
                o.copy_(r[k * n:(k + 1) * n])

        calls = {"all_reduce": all_reduce, "broadcast": broadcast if ip else None,
                 "reduce": reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}
        return calls.get(coll)
