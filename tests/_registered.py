"""Per-rank scenarios of registered memory (run in spawned processes by test_registered_gpu.py).

Each checks its own results (bitwise for integer-valued data) and returns what the parent
asserts on as well.  all_reduce is called with algo="nccl": at 2+ ranks "auto" would take
pyccl's own kernels for float32 up to 16 MiB, and these tests are about NCCL's kernels on
registered memory.
"""
import torch

import pyccl
from _data import SUM, rank_values, reduce_ref, same_bits, to_dtype

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.float64]
COUNTS = [1, 7, 1023, (1 << 20) + 3]


def sizes_differ(comm):
    """Windows of different sizes: every rank raises the same ValueError, nothing is registered."""
    r, w = comm.rank, comm.size
    t = pyccl.empty(1024 * (r + 1), dtype=torch.float32)
    want = ("register_window: every rank must register the same number of bytes; "
            + ", ".join(f"rank {k}: {4096 * (k + 1)}" for k in range(w)))
    try:
        comm.register_window(t)
    except ValueError as e:
        assert str(e) == want, str(e)
    else:
        raise AssertionError("register_window of different sizes did not raise")
    # the communicator is fine afterwards: a window of one size on every rank
    same = pyccl.empty(1024, dtype=torch.float32)
    same.fill_(r + 1)
    with comm.register_window(same) as win:
        assert not win.closed and win.window
        comm.all_reduce(same, algo="nccl")
        torch.cuda.synchronize()
        assert same_bits(same, torch.full((1024,), w * (w + 1) / 2, dtype=torch.float32))
    return want


def windows_match_plain_memory(comm):
    """all_reduce on windows (in place, and out of place window to window) bitwise equal to NCCL on
    memory from torch's caching allocator: integer-valued data, every dtype, odd sizes."""
    r, w, dev = comm.rank, comm.size, f"cuda:{comm.device}"
    checks = 0
    for dtype in DTYPES:
        for count in COUNTS:
            vals = [rank_values(k, count, dtype, SUM, w) for k in range(w)]
            ref = reduce_ref(vals, SUM, dtype)
            mine = to_dtype(vals[r], dtype).to(dev)
            plain = mine.clone()
            comm.all_reduce(plain, algo="nccl")
            a, b = pyccl.empty(count, dtype=dtype), pyccl.empty(count, dtype=dtype)
            wa, wb = comm.register_window(a), comm.register_window(b)
            a.copy_(mine)
            comm.all_reduce(a, algo="nccl")
            b.fill_(3)
            a2 = pyccl.empty(count, dtype=dtype)
            with comm.register_window(a2):
                a2.copy_(mine)
                comm.all_reduce(a2, out=b, algo="nccl")  # window to window
                torch.cuda.synchronize()
                assert same_bits(a2, mine), ("input kept", dtype, count)
            torch.cuda.synchronize()
            assert same_bits(plain, ref), ("plain", dtype, count)
            assert same_bits(a, plain), ("in place", dtype, count)
            assert same_bits(b, plain), ("out of place", dtype, count)
            wa.close()
            wb.close()
            checks += 3
    return checks


def random_data(comm):
    """Random float32 data on windows against a float64 reference (tolerance for a sum of
    `size` float32 values of magnitude <= 1, rounded at each of size-1 additions)."""
    r, w = comm.rank, comm.size
    worst = 0.0
    for count in (1, 7, 1023, (1 << 20) + 3):
        g = torch.Generator().manual_seed(1234 + count)
        allv = [torch.rand(count, generator=g, dtype=torch.float64) * 2 - 1 for _ in range(w)]
        ref = torch.stack(allv).sum(0)
        t = pyccl.empty(count, dtype=torch.float32)
        with comm.register_window(t):
            t.copy_(allv[r])
            comm.all_reduce(t, algo="nccl")
            torch.cuda.synchronize()
            err = (t.double().cpu() - ref).abs().max().item()
        tol = w * 2 ** -23 * w + 1e-7
        assert err <= tol, (count, err, tol)
        worst = max(worst, err)
    return worst


def many_calls(comm, n=10_000):
    """10,000 all_reduces on one window, the input rewritten before each; every 97th result
    (and the last) checked bitwise on the host."""
    r, w = comm.rank, comm.size
    count = 4099
    t = pyccl.empty(count, dtype=torch.int32)
    base = torch.arange(count, dtype=torch.int32, device=t.device)
    checked = 0
    with comm.register_window(t):
        for i in range(n):
            t.copy_(base + (i % 1000) * (r + 1))   # rewritten between calls
            comm.all_reduce(t, algo="nccl")
            if i % 97 == 0 or i == n - 1:
                want = base * w + (i % 1000) * (w * (w + 1) // 2)
                torch.cuda.synchronize()
                assert same_bits(t, want), (i, t[:4], want[:4])
                checked += 1
    return checked
