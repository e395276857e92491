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


if __name__ == "__main__":
    main()
