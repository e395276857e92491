"""What a timeout adds to the host's time of an NCCL call, apart from any peer: one rank, one
process, three communicators (no timeout; timeout=600 on a blocking handle; on a non-blocking
one), 8-byte all_reduce with algo="nccl", bursts of 2000 calls (200 on the non-blocking handle)
alternating between them, 15 rounds, on the default stream and on a side stream; then each step a
timed call adds, timed in C (pyccl._C._watch_costs).  One GPU.

  python tools/timeout_host_cost.py
"""
import os
import statistics as S
import time

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

import pyccl  # noqa: E402

torch.cuda.set_device(0)
u = pyccl.Communicator(1, pyccl.unique_id(), 0)
t = pyccl.Communicator(1, pyccl.unique_id(), 0, timeout=600, blocking=True)
tn = pyccl.Communicator(1, pyccl.unique_id(), 0, timeout=600)
x = torch.arange(2, dtype=torch.float32, device="cuda:0")
s = torch.cuda.Stream()


def burst(c, n=2000):
    torch.cuda.synchronize()
    time.sleep(0.02)
    t0 = time.perf_counter()
    for _ in range(n):
        c.all_reduce(x, algo="nccl")
    return (time.perf_counter() - t0) / n * 1e6


for stream_name, stream in (("default stream", torch.cuda.current_stream()), ("side stream", s)):
    res = {"untimed": [], "timed blocking": [], "timed non-blocking": []}
    with torch.cuda.stream(stream):
        for c in (u, t, tn):
            burst(c, 500)
        for r in range(15):
            res["untimed"].append(burst(u))
            res["timed blocking"].append(burst(t))
            res["untimed"].append(burst(u))
            res["timed non-blocking"].append(burst(tn, 200))
    d = [b - a for a, b in zip(res["untimed"][::2], res["timed blocking"])]
    print(f"{stream_name}: 1 rank, 8-byte all_reduce algo=nccl, host us per call, "
          "median of 15-30 bursts of 2000")
    for k, v in res.items():
        print(f"  {k:20s} median {S.median(v):7.2f}  min {min(v):7.2f}  max {max(v):7.2f}")
    print(f"  timed blocking - untimed, paired rounds: median {S.median(d):.2f}  "
          f"({' '.join(f'{v:.2f}' for v in d)})")
print("watch costs (us, C):", {k: round(v, 3) for k, v in pyccl._C._watch_costs(0, 0, 2000).items()})
for c in (u, t, tn):
    c.destroy()
