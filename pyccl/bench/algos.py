"""The all_reduce measurements of pyccl's own kernels, run inside one benchmark process per rank.

algo_sweep (--algos): all_reduce float32 sum in place, for each size and algo, eager (CUDA events
around `iters` back-to-back calls, / iters), CUDA graph (the same calls captured in one graph and
replayed, / iters) and host (CPU time of the eager loop per call: the calls only enqueue, so
where host is close to eager the loop is host-bound), with the launch floor beside it (an empty
kernel with the own kernels' parameter block launched as they are, from C); --variants repeats the
own-kernel columns on a sub-communicator set up under other environment settings; then many small
tensors, a call per tensor against one all_reduce_coalesced. host_breakdown (--host-breakdown):
where the host time of an eager call goes, from a Python call of a no-op up to the 8-byte
all_reduce, with the raw launch floors through ctypes, and what a timeout adds (the same calls on
communicators with timeout=, blocking and non-blocking, and each CUDA runtime call and host step a
timed call adds, timed in C: host time only). Each message to the parent carries one rank's loops of one measurement; the parent takes
the median over loops of the maximum over ranks.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .drivers import _PycclComm
    from .runner import _Reporter

OWN = ("oneshot", "twoshot")
ALGOS = ("auto", "nccl") + OWN
# launches per loop of the launch floor (--algos)
FLOOR_CALLS = 2000
# many small gradients for the coalesced comparison: 100 float32 tensors of 256..32K elements
GRADS = [(1 << (8 + k % 8)) + k for k in range(100)]


def algo_iters(cfg: Mapping[str, Any], size: int) -> int:
    """Calls per loop: -n up to 1 MiB, a tenth of it (at least 5) above, as the sweep always did."""
    return cfg["iters"] if size <= (1 << 20) else max(5, cfg["iters"] // 10)


def _time(comm, fn, iters, graph, repeats, host=None):
    """us per call on this rank for each of `repeats` loops; with a list `host`, also the host
    time per call of each loop (the calls only enqueue work: iters is far below the launch
    queue's depth)."""
    import torch
    dev = comm.device
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    run()  # warm-up
    out = []
    for _ in range(repeats):
        comm.barrier()
        torch.cuda.synchronize(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h = time.perf_counter()
        run()
        h = time.perf_counter() - h
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0 / iters)
        if host is not None:
            host.append(h * 1e6 / iters)
    return out


def _with_env(name, value, make):
    """make() with os.environ[name] = value (read at a communicator's set-up), then restored."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return make()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _set_up(comm, dev):
    import torch
    comm.all_reduce(torch.ones(4, device=dev), algo="oneshot")  # set up the own kernels


def algo_sweep(drv: _PycclComm, cfg: Mapping[str, Any], out: _Reporter) -> None:
    import torch
    comm, rank, n = drv.comm, drv.rank, drv.nranks
    dev = f"cuda:{comm.device}"
    own = n >= 2  # one rank: the own kernels refuse (NCCL's copy is all there is to do)
    variants = [(None, comm)]
    if own:
        _set_up(comm, dev)  # default grid
        for v in cfg["variants"]:
            name, _, val = v.partition("=")

            def make():
                sub = comm.split(0)
                _set_up(sub, dev)
                return sub
            variants.append((v, _with_env(name, val, make)))
    out.put(("algo_info", rank, comm.all_reduce_info))
    reps = cfg["repeats"]
    import pyccl
    if own and pyccl._C._ar_built():
        # the floor of an own-kernel call's host time, measured beside it: an empty kernel with
        # the same parameter block, launched as the own kernels are (PDL or not), from C
        s, pdl = torch.cuda.current_stream().cuda_stream, comm.all_reduce_info["pdl"]
        floors = []
        for _ in range(reps):
            torch.cuda.synchronize()
            floors.append(pyccl._C._ar_launch_floor(comm.device, s, FLOOR_CALLS, pdl))
        torch.cuda.synchronize()
        out.put(("algo", rank, (0, "empty kernel", None, "launch floor"), floors))
    for size in cfg["sizes"]:
        x = torch.randn(max(1, size // 4), device=dev)
        for variant, c in variants:
            algos = cfg["algos"] if variant is None else [a for a in cfg["algos"] if a in OWN]
            for algo in algos:
                if algo in OWN and not own:
                    continue  # above the buffer the own kernels run in chunks of it: measured too
                # auto is the default: called as users call it, without algo=
                fn = (lambda: c.all_reduce(x)) if algo == "auto" else (lambda: c.all_reduce(x, algo=algo))
                iters = algo_iters(cfg, size)
                for graph in (False, True):
                    host = None if graph else []
                    t = _time(c, fn, iters, graph, reps, host)
                    out.put(("algo", rank, (size, algo, variant, "graph" if graph else "eager"), t))
                    if host is not None:
                        out.put(("algo", rank, (size, algo, variant, "host"), host))
    grads = [torch.randn(k, device=dev) for k in GRADS]
    nb = sum(GRADS) * 4
    for algo in ("auto", "nccl"):
        def loop():
            for g_ in grads:
                comm.all_reduce(g_, algo=algo)
        out.put(("algo", rank, (nb, algo, None, "per-tensor loop"), _time(comm, loop, 5, False, reps)))
        t = _time(comm, lambda: comm.all_reduce_coalesced(grads, algo=algo), 5, False, reps)
        out.put(("algo", rank, (nb, algo, None, "coalesced"), t))
    for _, c in variants[1:]:
        c.destroy()


# ---- --host-breakdown -------------------------------------------------------------------------

PTX = b"""
.version 7.8
.target sm_80
.address_size 64
.visible .entry pyccl_empty() { ret; }
.visible .entry pyccl_p144(.param .align 8 .b8 p[144]) { ret; }
"""


def _driver():
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    vp, u = ctypes.c_void_p, ctypes.c_uint
    cu.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
    cu.cuLaunchKernel.restype = ctypes.c_int
    cu.cuCtxGetDevice.argtypes = [vp]
    cu.cuCtxGetDevice.restype = ctypes.c_int
    mod = vp()
    rc = cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX))
    if rc != 0:
        raise RuntimeError(f"--host-breakdown: cuModuleLoadData of the empty kernels failed ({rc})")
    fns = {}
    for name in ("pyccl_empty", "pyccl_p144"):
        f = vp()
        rc = cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode())
        if rc != 0:
            raise RuntimeError(f"--host-breakdown: cuModuleGetFunction({name}) failed ({rc})")
        fns[name] = f
    return cu, fns


# --host-breakdown's host figure: a burst of at most this many calls after a sync, short enough
# that the launch queue never fills (a longer loop of kernels slower than their launches runs at
# the GPU's pace, and its host time is the GPU's)
HOST_BURST = 200


def _time_host(fn, calls, repeats, sync):
    """-> (host us per call of a burst of min(calls, HOST_BURST) after a sync, GPU us per call of
    a loop of `calls`), one figure per repeat each."""
    import torch
    host, gpu = [], []
    burst = min(calls, HOST_BURST)
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for _ in range(burst):
            fn()
        host.append((time.perf_counter() - t) * 1e6 / burst)
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e3 / calls)
    return host, gpu


def host_breakdown(drv: _PycclComm, cfg: Mapping[str, Any], out: _Reporter) -> None:
    import ctypes

    import torch

    import pyccl
    comm, rank, n = drv.comm, drv.rank, drv.nranks
    dev = f"cuda:{comm.device}"
    own = n >= 2
    x = torch.arange(2, dtype=torch.float32, device=dev) + rank
    empty = torch.empty(0, device=dev)
    comm.all_reduce(x)  # set-up of the own kernels
    nopdl = None
    if own:
        def make():
            sub = comm.split(0)
            sub.all_reduce(x)
            return sub
        nopdl = _with_env("PYCCL_AR_PDL", "0", make)
    out.put(("algo_info", rank, [comm.all_reduce_info] + ([nopdl.all_reduce_info] if own else [])))
    cu, fns = _driver()
    param = (ctypes.c_char * 144)()
    pargs = (ctypes.c_void_p * 1)(ctypes.cast(param, ctypes.c_void_p))
    dv = ctypes.c_int()
    side = torch.cuda.Stream()
    lib = ctypes.CDLL(pyccl._C._library_paths()[0])
    raw = lib.ncclAllReduce
    raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                    ctypes.c_void_p, ctypes.c_void_p]
    ptr, handle = x.data_ptr(), comm.handle

    def noop():
        pass

    def launch(name, args=None):
        f = fns[name]
        s = torch.cuda.current_stream().cuda_stream
        return lambda: cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, None)

    def raw_nccl():
        s = torch.cuda.current_stream().cuda_stream
        return lambda: raw(ptr, ptr, 2, 7, 0, handle, s)  # 2 x ncclFloat32 (7), ncclSum (0)

    cases = [
        ("python call of a no-op", noop),
        ("ctypes cuCtxGetDevice", lambda: cu.cuCtxGetDevice(ctypes.byref(dv))),
        ("ctypes cuLaunchKernel, empty kernel", launch("pyccl_empty")),
        ("ctypes cuLaunchKernel, 144-byte param", launch("pyccl_p144", pargs)),
        ("comm.all_reduce(empty tensor)", lambda: comm.all_reduce(empty)),
    ]
    if own:
        cases += [
            ("comm.all_reduce(8 B): own kernel, PDL", lambda: comm.all_reduce(x)),
            ("comm.all_reduce(8 B): own kernel, no PDL", lambda: nopdl.all_reduce(x)),
            ("comm.all_reduce(8 B, algo='oneshot')", lambda: comm.all_reduce(x, algo="oneshot")),
        ]
    cases += [
        ("comm.all_reduce(8 B, algo='nccl')", lambda: comm.all_reduce(x, algo="nccl")),
        ("raw ncclAllReduce via ctypes (8 B)", raw_nccl()),
    ]
    # What a timeout adds: the same calls on communicators with timeout= (a blocking handle, the
    # "pyccl" backend's kind, and the default non-blocking one); what such a call does beyond an
    # untimed one is timed in C below (no ctypes in the figure).
    timed = {blocking: _timed_comm(comm, rank, n, blocking) for blocking in (True, False)}
    for blocking, name in ((True, "timed, blocking"), (False, "timed, non-blocking")):
        tc = timed[blocking]
        tc.all_reduce(x)  # its own kernels' set-up
        if own:
            cases.append((f"{name}: comm.all_reduce(8 B): own kernel", lambda tc=tc: tc.all_reduce(x)))
        cases.append((f"{name}: comm.all_reduce(8 B, algo='nccl')",
                      lambda tc=tc: tc.all_reduce(x, algo="nccl")))

    def sync():
        comm.barrier()
        torch.cuda.synchronize()

    calls, reps = cfg["host_iters"], cfg["repeats"]
    for name, fn in cases:
        fn()
        out.put(("breakdown", rank, name, *_time_host(fn, calls, reps, sync)))
    # each of what a call with a timeout does beyond one without (the device looked up, the
    # capture looked at, the event recorded; the watchdog's query; clock, lock, GIL), `calls`
    # times back to back in C: host time only (no GPU figure: nan)
    s = torch.cuda.current_stream().cuda_stream
    per: dict[str, list[float]] = {}
    for _ in range(reps):
        sync()
        for key, us in pyccl._C._watch_costs(comm.device, s, calls).items():
            per.setdefault(key, []).append(us)
    for key, host in per.items():
        out.put(("breakdown", rank, f"in C: {key}", host, [math.nan] * reps))
    # a side stream: the whole loop inside one `with` (the stream switch is not per call)
    with torch.cuda.stream(side):
        side_cases = [("on a side stream: empty kernel launch", launch("pyccl_empty"))]
        if own:
            side_cases.insert(0, ("on a side stream: own kernel, PDL", lambda: comm.all_reduce(x)))
        for name, fn in side_cases:
            fn()
            out.put(("breakdown", rank, name, *_time_host(fn, calls, reps, sync)))
    if nopdl is not None:
        nopdl.destroy()
    for tc in timed.values():
        tc.destroy()
    torch.cuda.synchronize()


def _timed_comm(comm: Any, rank: int, n: int, blocking: bool) -> Any:
    """A communicator of the same ranks and device with timeout=600 (the backend's default) on a
    blocking or a non-blocking NCCL handle: its unique id broadcast over comm."""
    import torch

    import pyccl
    dev = f"cuda:{comm.device}"
    uid = (torch.tensor(list(pyccl.unique_id()), dtype=torch.uint8, device=dev) if rank == 0
           else torch.zeros(128, dtype=torch.uint8, device=dev))
    comm.broadcast(uid, 0)
    return pyccl.Communicator(n, bytes(uid.tolist()), rank, device=comm.device, timeout=600,
                              blocking=blocking)
