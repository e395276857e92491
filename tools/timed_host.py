"""Host µs per 8-byte all_reduce on pyccl's own kernels, a communicator without timeout against
one with (timeout=600, blocking), with and without programmatic dependent launch; with --nccl
also algo="nccl".  N ranks, spawned here; more ranks than GPUs share them (pyccl.place_rank).

  python tools/timed_host.py [RANKS] [CALLS] [--nccl]

Per case, after 300 warm-up calls: "burst host", the median of 5 bursts of 200 calls each begun
after a barrier, a synchronize and 30 ms (the watchdog's look) -- the host's time alone, as the
GPU starts idle; then "loop", CALLS calls timed on the host and with CUDA events around them,
median of 3 (where the two agree, the GPU sets the pace).  Each rank writes its lines to
$OUT/timed-host-rank<R>.txt; rank 0's are printed.  To compare two builds in one run, swap their
pyccl/_C*.so between rounds of this command (the figures of two rounds apart are not comparable:
a machine drifts).
"""
import os
import sys
import time

import torch
import torch.multiprocessing as mp


def run(rank, n, path, calls, out, nccl):
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    import pyccl
    dev = rank if torch.cuda.device_count() >= n else pyccl.place_rank(rank, n)
    torch.cuda.set_device(dev)
    if rank == 0:
        data = b"".join(pyccl.unique_id() for _ in range(4))
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.rename(path + ".tmp", path)
    else:
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path, "rb") as f:
            data = f.read()
    u = pyccl.Communicator(n, data[:128], rank, device=dev)
    t = pyccl.Communicator(n, data[128:256], rank, device=dev, timeout=600, blocking=True)
    x = torch.arange(2, dtype=torch.float32, device=f"cuda:{dev}")
    # the same two without programmatic dependent launch (read at each one's set-up)
    u0 = pyccl.Communicator(n, data[256:384], rank, device=dev)
    t0 = pyccl.Communicator(n, data[384:], rank, device=dev, timeout=600, blocking=True)
    os.environ["PYCCL_AR_PDL"] = "0"
    u0.all_reduce(x)
    t0.all_reduce(x)
    del os.environ["PYCCL_AR_PDL"]
    assert u0.all_reduce_info["pdl"] is False and t0.all_reduce_info["pdl"] is False
    cases = [("untimed own", lambda: u.all_reduce(x)), ("timed own", lambda: t.all_reduce(x)),
             ("untimed own, no PDL", lambda: u0.all_reduce(x)),
             ("timed own, no PDL", lambda: t0.all_reduce(x))]
    if nccl:
        cases += [("untimed nccl", lambda: u.all_reduce(x, algo="nccl")),
                  ("timed nccl", lambda: t.all_reduce(x, algo="nccl"))]
    lines = []
    for name, fn in cases:
        for _ in range(300):
            fn()
        burst, host, gpu = [], [], []
        for _ in range(5):
            u.barrier()
            torch.cuda.synchronize()
            time.sleep(0.03)
            start = time.perf_counter()
            for _ in range(200):
                fn()
            burst.append((time.perf_counter() - start) / 200 * 1e6)
        for _ in range(3):
            u.barrier()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host.append((time.perf_counter() - start) / calls * 1e6)
            b.record()
            b.synchronize()
            gpu.append(a.elapsed_time(b) * 1e3 / calls)
        lines.append(f"rank {rank} {name:19s} burst host {sorted(burst)[2]:6.2f} | loop of {calls}: "
                     f"host {sorted(host)[1]:6.2f} gpu {sorted(gpu)[1]:6.2f}  (us per call, median)")
    u.barrier()
    torch.cuda.synchronize()
    with open(os.path.join(out, f"timed-host-rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    for c in (t0, u0, t, u):
        c.destroy()


def main():
    args = [a for a in sys.argv[1:] if a != "--nccl"]
    n = int(args[0]) if args else torch.cuda.device_count()
    calls = int(args[1]) if len(args) > 1 else 5000
    out = os.environ.get("OUT", ".")
    path = f"/tmp/pyccl-timed-host-{os.getpid()}"
    try:
        mp.spawn(run, args=(n, path, calls, out, "--nccl" in sys.argv[1:]), nprocs=n)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    with open(os.path.join(out, "timed-host-rank0.txt")) as f:
        print(f.read(), end="")


if __name__ == "__main__":
    main()
