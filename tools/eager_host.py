"""Where the host time of an eager all_reduce goes, on each of N ranks (one process per GPU).

    python tools/eager_host.py [-g NGPUS] [-n CALLS]

Host CPU microseconds per call (perf_counter around `calls` back-to-back calls, median of 5
loops) for: a Python call of a no-op (the loop's own cost); comm.all_reduce of an empty tensor
(pyccl's argument parsing, tensor reading and stream lookup: nothing is enqueued); the 8-byte
all_reduce with pyccl's own kernel, with and without programmatic dependent launch, on the
current and on a side stream; the same through NCCL (algo='nccl'); and, as the floor, a raw
cuLaunchKernel of an empty kernel and of one with pyccl's 144-byte parameter block, through
ctypes (a ctypes call of cuCtxGetDevice gives ctypes' own share).  The GPU time per call of
the same loops (CUDA events) is printed next to it: where host and GPU time agree, the loop is
host-bound.  The largest figure over ranks is printed.
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch

from _spawn import run_ranks

PTX = b"""
.version 7.8
.target sm_80
.address_size 64
.visible .entry pyccl_empty() { ret; }
.visible .entry pyccl_p144(.param .align 8 .b8 p[144]) { ret; }
"""


def _driver():
    cu = ctypes.CDLL("libcuda.so.1")
    vp, u = ctypes.c_void_p, ctypes.c_uint
    cu.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
    cu.cuLaunchKernel.restype = ctypes.c_int
    cu.cuCtxGetDevice.argtypes = [vp]
    cu.cuCtxGetDevice.restype = ctypes.c_int
    mod = vp()
    assert cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)) == 0, "cuModuleLoadData"
    fns = {}
    for name in ("pyccl_empty", "pyccl_p144"):
        f = vp()
        assert cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()) == 0, name
        fns[name] = f
    return cu, fns


def _time(fn, calls, sync):
    host, gpu = [], []
    for _ in range(5):
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        t = time.perf_counter() - t
        b.record()
        b.synchronize()
        host.append(t * 1e6 / calls)
        gpu.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(host), statistics.median(gpu)


def _rank(rank, world, uid, calls):
    import pyccl
    torch.cuda.set_device(rank)
    dev = f"cuda:{rank}"
    comm = pyccl.Communicator(world, uid, rank)
    x = torch.arange(2, dtype=torch.float32, device=dev) + rank
    empty = torch.empty(0, device=dev)
    comm.all_reduce(x)  # set-up of the own kernels
    os.environ["PYCCL_AR_PDL"] = "0"  # read at the sub-communicator's set-up
    nopdl = comm.split(0)
    nopdl.all_reduce(x)
    del os.environ["PYCCL_AR_PDL"]
    cu, fns = _driver()
    param = (ctypes.c_char * 144)()
    pargs = (ctypes.c_void_p * 1)(ctypes.cast(param, ctypes.c_void_p))
    dv = ctypes.c_int()
    side = torch.cuda.Stream()

    def noop():
        pass

    def launch(name, args=None):
        f = fns[name]
        s = torch.cuda.current_stream().cuda_stream
        return lambda: cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, None)

    def on_side(fn):
        def run():
            with torch.cuda.stream(side):
                fn()
        return run

    cases = [
        ("python call of a no-op", noop),
        ("ctypes cuCtxGetDevice", lambda: cu.cuCtxGetDevice(ctypes.byref(dv))),
        ("ctypes cuLaunchKernel, empty kernel", launch("pyccl_empty")),
        ("ctypes cuLaunchKernel, 144-byte param", launch("pyccl_p144", pargs)),
        ("comm.all_reduce(empty tensor)", lambda: comm.all_reduce(empty)),
        ("comm.all_reduce(8 B): own kernel, PDL", lambda: comm.all_reduce(x)),
        ("comm.all_reduce(8 B): own kernel, no PDL", lambda: nopdl.all_reduce(x)),
        ("comm.all_reduce(8 B, algo='oneshot')", lambda: comm.all_reduce(x, algo="oneshot")),
        ("comm.all_reduce(8 B, algo='nccl')", lambda: comm.all_reduce(x, algo="nccl")),
    ]

    def sync():
        comm.barrier()
        torch.cuda.synchronize()

    res = {}
    for name, fn in cases:
        fn()
        res[name] = _time(fn, calls, sync)
    # a side stream: the whole loop inside one `with` (the stream switch is not per call)
    with torch.cuda.stream(side):
        for name, fn in (("on a side stream: own kernel, PDL", lambda: comm.all_reduce(x)),
                         ("on a side stream: empty kernel launch", launch("pyccl_empty"))):
            fn()
            res[name] = _time(fn, calls, sync)
    res["_info"] = (comm.all_reduce_info, nopdl.all_reduce_info)
    nopdl.destroy()
    comm.destroy()
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-g", "--ngpus", type=int, default=torch.cuda.device_count())
    p.add_argument("-n", "--calls", type=int, default=400)
    args = p.parse_args()
    if args.ngpus < 2:
        sys.exit("eager_host: needs 2 GPUs or more")
    import pyccl
    uid = pyccl.unique_id()
    got = run_ranks("eager_host", _rank, args.ngpus, uid, args.calls, timeout=300)
    info = got[0].pop("_info")
    for r in got:
        got[r].pop("_info", None)
    print(f"# eager host cost per call, {args.ngpus} ranks, {args.calls} calls a loop, median of 5, "
          f"max over ranks; torch {torch.__version__}, pyccl own kernels: {info[0]}")
    print(f"# command: python tools/eager_host.py -g {args.ngpus} -n {args.calls}")
    print(f"{'':45} {'host us':>8} {'gpu us':>8}")
    for name in got[0]:
        h = max(got[r][name][0] for r in got)
        g = max(got[r][name][1] for r in got)
        print(f"{name:45} {h:8.2f} {g:8.2f}")


if __name__ == "__main__":
    main()
