"""Host µs of an NCCL call and of a pyccl.group() of one call, on a communicator without a
timeout, apart from any peer: one rank, one process, 8-byte all_reduce with algo="nccl", bursts of
2000, the median of 7 of each.  One GPU.  Run it once per build to compare two builds (alternate
them over a few rounds: single rounds differ by more than a µs).

  python tools/group_host_cost.py [LABEL]
"""
import os
import statistics as S
import sys
import time

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

import pyccl  # noqa: E402

torch.cuda.set_device(0)
u = pyccl.Communicator(1, pyccl.unique_id(), 0)
x = torch.arange(2, dtype=torch.float32, device="cuda:0")


def burst(grouped, n=2000):
    torch.cuda.synchronize()
    time.sleep(0.02)
    t0 = time.perf_counter()
    for _ in range(n):
        if grouped:
            with pyccl.group():
                u.all_reduce(x, algo="nccl")
        else:
            u.all_reduce(x, algo="nccl")
    return (time.perf_counter() - t0) / n * 1e6


burst(False, 300)
burst(True, 300)
plain = [burst(False) for _ in range(7)]
group = [burst(True) for _ in range(7)]
label = sys.argv[1] if len(sys.argv) > 1 else "this build"
print(f"{label} plain {S.median(plain):.2f} group {S.median(group):.2f}  (min {min(plain):.2f} / {min(group):.2f})")
u.destroy()
