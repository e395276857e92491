"""Short all-reduce timing for the device check: pyccl.nccl against torch.cuda.nccl.

One process drives every visible GPU (the drop-in's clique mode), float32
sum, in place.  Per size: CUDA events around `iters` back-to-back calls,
median of 5 loops, slowest GPU.  Host column: CPU microseconds per call on a
1-element tensor, with no synchronisation inside the loop.
"""
import statistics
import sys
import time

import torch

import pyccl.nccl as pnccl
import torch.cuda.nccl as tnccl


def time_loop(fn, tensors, iters):
    n = len(tensors)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for d in range(n):
        starts[d].record(torch.cuda.current_stream(d))
    for _ in range(iters):
        fn(tensors)
    for d in range(n):
        ends[d].record(torch.cuda.current_stream(d))
    for d in range(n):
        torch.cuda.synchronize(d)
    return max(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000.0 / iters  # us


def host_us(fn, tensors, calls=3000):
    for _ in range(200):
        fn(tensors)
    for d in range(len(tensors)):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(tensors)
    t1 = time.perf_counter()
    for d in range(len(tensors)):
        torch.cuda.synchronize(d)
    return (t1 - t0) * 1e6 / calls


def main():
    n = torch.cuda.device_count()
    if n < 1:
        sys.exit("quick_bench: no CUDA GPU found")
    systems = {"pyccl.nccl": pnccl.all_reduce, "torch.cuda.nccl": tnccl.all_reduce}
    print(f"# all_reduce float32 sum in place, 1 process x {n} GPUs, NCCL {pnccl.version()}, torch {torch.__version__}")
    print(f"{'bytes':>12} " + " ".join(f"{k + ' us':>18}" for k in systems) + f" {'ratio':>7} {'busbw GB/s':>11}")
    size = 8
    while size <= (256 << 20):
        count = size // 4
        tens = [torch.randint(-100, 100, (count,), device=f"cuda:{d}").float() for d in range(n)]
        iters = 50 if size < (16 << 20) else 10
        row = {}
        for name, fn in systems.items():
            fn(tens)  # warm-up (creates the clique)
            row[name] = statistics.median(time_loop(fn, tens, iters) for _ in range(5))
        busbw = size / (row["pyccl.nccl"] * 1e-6) * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0
        print(f"{size:>12} " + " ".join(f"{row[k]:>18.1f}" for k in systems)
              + f" {row['torch.cuda.nccl'] / row['pyccl.nccl']:>7.2f} {busbw:>11.1f}")
        size *= 8
    tens = [torch.ones(1, device=f"cuda:{d}") for d in range(n)]
    print("# host CPU us per call, 1 element: " + ", ".join(
        f"{k} {statistics.median(host_us(fn, tens) for _ in range(3)):.2f}" for k, fn in systems.items()))
    per_rank_host()


def per_rank_host():
    """CPU us per all_reduce call of the per-rank APIs, one rank (this process, GPU 0).

    comm.all_reduce on an empty tensor runs all of pyccl's Python+C path but
    enqueues nothing (count 0): that is pyccl's own cost.  On one element it
    adds NCCL's enqueue, which the raw ncclAllReduce row (through ctypes, so
    with ctypes' own call cost) shows alone.
    """
    import ctypes
    import socket

    import torch.distributed as dist

    import pyccl

    torch.cuda.set_device(0)
    comm = pyccl.Communicator(1, pyccl.unique_id(), 0)
    one = torch.ones(1, device="cuda:0")
    empty = torch.empty(0, device="cuda:0")
    lib = ctypes.CDLL(pyccl._C._library_paths()[0])
    stream = torch.cuda.current_stream(0).cuda_stream
    ptr, handle = one.data_ptr(), comm.handle
    raw = lib.ncclAllReduce
    raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                    ctypes.c_void_p, ctypes.c_void_p]
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    rows = {
        "pyccl comm.all_reduce(empty): pyccl's own path": lambda _: comm.all_reduce(empty),
        "pyccl comm.all_reduce(1 elem)": lambda _: comm.all_reduce(one),
        "raw ncclAllReduce via ctypes (1 elem)": lambda _: raw(ptr, ptr, 1, 7, 0, handle, stream),
        "torch.distributed.all_reduce (1 elem)": lambda _: dist.all_reduce(one),
    }
    print("# per-rank API, 1 rank on cuda:0, host CPU us per call (median of 3 x 3000 calls)")
    for name, fn in rows.items():
        print(f"{name:>48}: {statistics.median(host_us(fn, [one]) for _ in range(3)):6.2f}")
    dist.destroy_process_group()
    comm.destroy()


if __name__ == "__main__":
    main()
