"""Per-rank scenarios of pyccl's own all-reduce kernels (run in spawned processes).

Each returns what the parent asserts on as well; the bitwise checks happen here, in the rank.
"""
import os
import time

import torch

import pyccl
from _data import MAX, MIN, OP_NAMES, SUM, rank_values, reduce_ref, same_bits, to_dtype

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32]
OPS = [SUM, MAX, MIN]
# element counts: 16-byte multiples and not (tails of 1..15 bytes), one-block
# and many-block sizes, up to 4 MiB of float32
COUNTS = [1, 3, 7, 8, 9, 1023, 4097, 65536 + 5, (1 << 20) + 3]
ALGOS = ["oneshot", "twoshot"]


def _check(got, want, *what):
    torch.cuda.synchronize()
    assert same_bits(got, want), (what, got.flatten()[:8], want.flatten()[:8])


def exact(comm):
    """Integer-valued data: own kernels bitwise equal to the reference and to NCCL,
    in and out of place, aligned and at an odd offset, every dtype/op/size."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    checks = 0
    for dtype in DTYPES:
        for op in OPS:
            for count in COUNTS:
                vals = [rank_values(k, count, dtype, op, W) for k in range(W)]
                ref = reduce_ref(vals, op, dtype)
                mine = to_dtype(vals[r], dtype).to(dev)
                nccl = mine.clone()
                comm.all_reduce(nccl, op, algo="nccl")
                _check(nccl, ref, "nccl", dtype, OP_NAMES[op], count)
                for algo in ALGOS:
                    t = mine.clone()
                    comm.all_reduce(t, op, algo=algo)
                    _check(t, nccl, algo, "in place", dtype, OP_NAMES[op], count)
                    out = torch.full_like(mine, 3)
                    comm.all_reduce(mine, op, out=out, algo=algo)
                    _check(out, ref, algo, "out of place", dtype, OP_NAMES[op], count)
                    _check(mine, to_dtype(vals[r], dtype), "input kept")
                    # a view one element in: not 16-byte aligned (in and out)
                    big = torch.empty(count + 1, dtype=dtype, device=dev)
                    big[1:] = mine
                    view = big[1:]
                    comm.all_reduce(view, op, algo=algo)
                    _check(view, ref, algo, "odd offset", dtype, OP_NAMES[op], count)
                    checks += 3
                # auto picks by size; still exact
                t = mine.clone()
                comm.all_reduce(t, op)
                _check(t, ref, "auto", dtype, OP_NAMES[op], count)
    return checks, comm.all_reduce_info


def rank_order_sum(vals, dtype, reverse=False, acc16=False):
    """What the own kernels promise, on the CPU: float32 accumulation in rank order
    0..W-1 and one rounding to `dtype` at the end (IEEE adds, so bit for bit).
    reverse / acc16: the faults (another order; 16-bit types summed in 16 bits)."""
    order = list(reversed(vals)) if reverse else list(vals)
    acc = order[0].to(dtype).float()
    for v in order[1:]:
        acc = acc + v.to(dtype).float()
        if acc16:
            acc = acc.to(dtype).float()
    return acc.to(dtype)


def random_data(comm):
    """Random normal data, bit for bit against the promised sum (rank_order_sum), and every
    rank holds the same bits (fixed accumulation order).  At 2 ranks that is the correctly
    rounded a+b: it catches a wrong element, a skipped tail, a wrong rounding (_rz for _rn),
    any precision lost in between; it cannot see the rank order nor 16-bit accumulation
    (a+b rounded once either way): order_and_accumulation does, at 3+ ranks."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    out = {}
    for dtype, rtol in tol.items():
        for algo in ALGOS:
            for count in (1000, 12345, 300001):
                g = [torch.Generator().manual_seed(1000 * k + count) for k in range(W)]
                vals = [torch.randn(count, generator=g[k], dtype=torch.float64) for k in range(W)]
                want = torch.stack([v.to(dtype).to(torch.float64) for v in vals]).sum(0)
                t = vals[r].to(dtype).to(dev)
                comm.all_reduce(t, algo=algo)
                got = t.to(torch.float64).cpu()
                err = ((got - want).abs() / (want.abs() + 1)).max().item()
                assert err <= rtol, (dtype, algo, count, err)
                exact = rank_order_sum(vals, dtype)
                wrong = (t.cpu().view(torch.int16 if dtype.itemsize == 2 else torch.int32)
                         != exact.view(torch.int16 if dtype.itemsize == 2 else torch.int32))
                assert not wrong.any(), (dtype, algo, count, "not the rank-order float32 sum at",
                                         wrong.nonzero().flatten()[:5].tolist())
                # all ranks' results, bit for bit
                allr = torch.empty(W * count, dtype=dtype, device=dev)
                comm.all_gather(t, allr)
                torch.cuda.synchronize()
                rows = allr.view(W, count).view(torch.uint8 if dtype.itemsize == 1 else torch.int16
                                                 if dtype.itemsize == 2 else torch.int32)
                assert all(torch.equal(rows[0], rows[k]) for k in range(W)), (dtype, algo, count)
                out[(str(dtype), algo, count)] = err
    return out


def _order_data(W, count, dtype):
    """Per-rank data whose sum tells the rank order and the accumulator apart (3+ ranks).
    float32: rank 0 holds s, the others s*2^-24: in rank order every add ties back to s;
    from the other end the small ones add up first and survive.  16-bit types: rank 0
    holds 256s (bf16) / 2048s (fp16), the others s: float32 keeps (W-1)s, a 16-bit
    running sum rounds each +s away (ties to even).  s varies over 2^-4..2^3."""
    s = torch.pow(2.0, (torch.arange(count) % 8 - 4).double())
    big, small = {torch.float32: (s, s * 2.0 ** -24), torch.bfloat16: (256 * s, s),
                  torch.float16: (2048 * s, s)}[dtype]
    return [big if k == 0 else small for k in range(W)]


def order_and_accumulation(comm):
    """3+ ranks: one-shot (LL and not) and two-shot sums are bitwise the rank-order
    float32 sum, which the data makes differ from the reversed order and from 16-bit
    accumulation; every rank holds the same bits."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    assert W >= 3
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for count in (1003, 200003):  # below and above the LL limit (256 KiB) in every dtype, tails
            vals = _order_data(W, count, dtype)
            want = rank_order_sum(vals, dtype)
            if dtype == torch.float32:
                assert not same_bits(want, rank_order_sum(vals, dtype, reverse=True))
            else:
                assert not same_bits(want, rank_order_sum(vals, dtype, acc16=True))
            for algo in ALGOS:
                t = vals[r].to(dtype).to(dev)
                comm.all_reduce(t, algo=algo)
                _check(t, want, "rank order / float32 accumulation", dtype, algo, count)
                allr = torch.empty(W * count, dtype=dtype, device=dev)
                comm.all_gather(t, allr)
                rows = allr.view(W, count)
                _check(rows, want.view(1, count).expand(W, count), "same bits on every rank", dtype, algo)
                checks += 1
    return checks


SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s at 2 GHz


def two_streams(comm):
    """Own-kernel calls on two streams, no user sync between: the second must wait for the
    first (ar.c's order event).  Rank 0's first call is held ~0.1 s behind a sleep on
    its stream, so without that wait its second call would run first and meet the peers'
    first call (the epoch is read on the GPU): both results would mix x with y."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    comm.all_reduce(torch.ones(16, device=dev), algo="oneshot")  # set-up
    torch.cuda.synchronize()
    checks = 0
    for count in (1000, 100003):  # LL one-shot and the copy-in one
        x = torch.arange(count, dtype=torch.float32, device=dev) + r
        y = torch.arange(count, dtype=torch.float32, device=dev) * -3 - 7 * r
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        a.wait_stream(torch.cuda.current_stream())
        b.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(a):
            if r == 0:
                torch.cuda._sleep(SLEEP_CYCLES)
            comm.all_reduce(x, algo="oneshot")
        with torch.cuda.stream(b):
            comm.all_reduce(y, algo="oneshot")
        torch.cuda.synchronize()
        base = torch.arange(count, dtype=torch.float32)
        _check(x, sum(base + q for q in range(W)), "first call (stream a)", count)
        _check(y, sum(base * -3 - 7 * q for q in range(W)), "second call (stream b)", count)
        checks += 1
    return checks


def many_calls(comm, n=10000):
    """n back-to-back calls (no sync in between) with the epoch counters set just below
    2^32, so they wrap around in the middle; every result checked at the end."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    warm = torch.ones(16, device=dev)
    comm.all_reduce(warm, algo="oneshot")  # sets up
    torch.cuda.synchronize()
    comm.barrier()
    torch.cuda.synchronize()
    start = 0xFFFFFFFF - n // 2
    comm._all_reduce_epoch(start)
    comm.barrier()
    torch.cuda.synchronize()
    count = 37  # 148 bytes: whole vectors and a tail
    i = torch.arange(n, dtype=torch.int32, device=dev).view(n, 1)
    j = torch.arange(count, dtype=torch.int32, device=dev).view(1, count)
    x = (i * 3 + j * 5 + r * 11) % 1000  # rank, call and position all matter
    out = torch.full_like(x, -1)
    for k in range(n):
        comm.all_reduce(x[k], out=out[k], algo="oneshot" if k % 3 else "twoshot")
    torch.cuda.synchronize()
    want = sum((i * 3 + j * 5 + q * 11) % 1000 for q in range(W))
    bad = (out != want).any(1).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)} wrong calls, first {bad[:5]}"
    end = comm._all_reduce_epoch()
    assert end == (start + n) % (1 << 32), (start, end)
    return start, end


def graphs(comm, replays=50):
    """Capture one-shot and two-shot calls in a CUDA graph, replay with new inputs
    each time; results right every time."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    a = torch.zeros(1000, dtype=torch.float32, device=dev)
    b = torch.zeros(70001, dtype=torch.bfloat16, device=dev)
    ao = torch.empty_like(a)
    # eager first: sets up peer memory (not possible during capture)
    comm.all_reduce(a.clone(), algo="oneshot")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch asks before capture
        comm.all_reduce(a, out=ao, algo="oneshot")
        comm.all_reduce(b, algo="twoshot")
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(a, out=ao, algo="oneshot")
        comm.all_reduce(b, algo="twoshot")
        comm.all_reduce(ao, op=pyccl.MAX, algo="oneshot")
    for k in range(replays):
        va = torch.arange(1000, dtype=torch.float32) * (k + 1) + r
        vb = (torch.arange(70001) % 50 + k + r).to(torch.bfloat16)
        a.copy_(va)
        b.copy_(vb)
        g.replay()
        torch.cuda.synchronize()
        wa = sum(torch.arange(1000, dtype=torch.float32) * (k + 1) + q for q in range(W))
        wb = sum((torch.arange(70001) % 50 + k + q).to(torch.float64) for q in range(W)).to(torch.bfloat16)
        assert torch.equal(ao.cpu(), wa), k   # max over equal values is the sum itself
        assert torch.equal(b.cpu(), wb), k
    return replays


def chained(comm, replays=3):
    """Back-to-back own-kernel calls, each reading what the one before it wrote (in place,
    int32 SUM: every call multiplies by the world size, wrapping like NCCL), on the LL,
    one-shot and two-shot kernels: first L calls in a row on one tensor, then the three
    interleaved.  With programmatic dependent launch a kernel is scheduled while the one
    before it still runs; a read before that one finished gives an old value.  Eager, then
    captured in a CUDA graph and replayed.  Returns (all_reduce_info, checks)."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    L = max(2, 12 // (W.bit_length() - 1))  # W^(2L) <= 2^24: wraps only a little
    sizes = {"ll": 1000, "oneshot": 100003, "twoshot": 100003}
    algos = {"ll": "oneshot", "oneshot": "oneshot", "twoshot": "twoshot"}
    init = {k: (torch.arange(n, dtype=torch.int64) * 7 + r * 13 + 1) % 127 + 1
            for k, n in sizes.items()}
    plan = [k for k in sizes for _ in range(L)] + [k for _ in range(L) for k in sizes]
    ts = {k: v.to(torch.int32).to(dev) for k, v in init.items()}
    comm.all_reduce(ts["ll"].clone(), algo="oneshot")  # set-up, eagerly

    def run():
        for k in plan:
            comm.all_reduce(ts[k], algo=algos[k])

    def expect(k):
        first = sum((torch.arange(sizes[k], dtype=torch.int64) * 7 + q * 13 + 1) % 127 + 1
                    for q in range(W))
        v = (first * W ** (plan.count(k) - 1)) & 0xFFFFFFFF
        return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)

    def check(what):
        torch.cuda.synchronize()
        for k in sizes:
            assert torch.equal(ts[k].cpu(), expect(k)), (what, k, ts[k][:4], expect(k)[:4])

    def reset():
        for k in sizes:
            ts[k].copy_(init[k])

    run()
    check("eager")
    reset()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch asks before capture
        run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for k in range(replays):
        reset()
        g.replay()
        check(f"replay {k}")
    return comm.all_reduce_info, 1 + replays


def off_on_one_rank(comm, settings=None, count=100):
    """Settings on the last rank only (PYCCL_DISABLE_OWN_KERNELS, or thresholds that
    would make the ranks pick different kernels): all ranks agree to use NCCL, forced
    algos raise the same way everywhere, results stay right.  The first call has
    `count` float32 elements."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    if r == W - 1:
        os.environ.update(settings or {"PYCCL_DISABLE_OWN_KERNELS": "1"})
    t = torch.arange(count, dtype=torch.float32, device=dev) + r
    comm.all_reduce(t)  # auto: the set-up happens here, collectively
    _check(t, sum(torch.arange(count, dtype=torch.float32) + q for q in range(W)), "auto off")
    info = comm.all_reduce_info
    assert info["state"] == "off", info
    msg = None
    try:
        comm.all_reduce(t, algo="oneshot")
    except RuntimeError as e:
        msg = str(e)
    assert msg is not None and msg.startswith(f"all_reduce: algo='oneshot' is unavailable on rank {r}: "), msg
    return info["reason"], msg, info


def first_call_nccl_sized(comm):
    """Run with PYCCL_AR_BUFFER_MB=1: the first call (2 MiB) is NCCL's, yet it sets the
    own kernels up, with every rank; a small call after it runs on them."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    big = torch.arange(1 << 19, dtype=torch.float32, device=dev) % 1000 + r
    comm.all_reduce(big)
    _check(big, sum(torch.arange(1 << 19, dtype=torch.float32) % 1000 + q for q in range(W)), "big")
    info = comm.all_reduce_info
    before = comm._all_reduce_epoch()
    small = torch.arange(1000, dtype=torch.int32, device=dev) * (r + 1)
    comm.all_reduce(small)
    _check(small, torch.arange(1000, dtype=torch.int32) * sum(range(1, W + 1)), "small")
    return info, before, comm._all_reduce_epoch()


def chunked(comm, replays=3):
    """Run with PYCCL_AR_BUFFER_MB=1: calls above the buffer run in chunks of it, one kernel
    each.  Integer-valued data, every dtype and op, one-shot and two-shot, in and out of place
    and one element in (not 16-byte aligned): bitwise equal to the reference and to NCCL, and
    the epoch moves by the number of chunks; then the same calls in a CUDA graph, replayed with
    new data."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    half = comm.all_reduce_info["buffer_bytes"]
    comm.all_reduce(torch.ones(4, device=dev), algo="oneshot")  # sets the kernels up
    kernels = 0
    for dtype in DTYPES:
        for op in OPS:
            count = (3 * half + 20) // torch.empty(0, dtype=dtype).element_size()
            vals = [rank_values(k, count, dtype, op, W) for k in range(W)]
            ref = reduce_ref(vals, op, dtype)
            mine = to_dtype(vals[r], dtype).to(dev)
            nccl = mine.clone()
            comm.all_reduce(nccl, op, algo="nccl")
            _check(nccl, ref, "nccl", dtype, OP_NAMES[op])
            for algo in ALGOS:
                before = comm._all_reduce_epoch()
                t = mine.clone()
                comm.all_reduce(t, op, algo=algo)
                torch.cuda.synchronize()
                assert comm._all_reduce_epoch() == (before + 4) % (1 << 32), (algo, before)
                _check(t, nccl, algo, "chunked in place", dtype, OP_NAMES[op])
                out = torch.full_like(mine, 3)
                comm.all_reduce(mine, op, out=out, algo=algo)
                _check(out, ref, algo, "chunked out of place", dtype, OP_NAMES[op])
                _check(mine, to_dtype(vals[r], dtype), "input kept")
                big = torch.empty(count + 1, dtype=dtype, device=dev)
                big[1:] = mine
                comm.all_reduce(big[1:], op, algo=algo)
                _check(big[1:], ref, algo, "chunked odd offset", dtype, OP_NAMES[op])
                kernels += 12
    n = (2 * half + 4) // 4  # three chunks of float32
    a = torch.zeros(n, dtype=torch.float32, device=dev)
    b = torch.zeros(n, dtype=torch.int32, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(a, algo="oneshot")
        comm.all_reduce(b, algo="twoshot")
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(a, algo="oneshot")
        comm.all_reduce(b, algo="twoshot")
    for k in range(replays):
        a.copy_(torch.arange(n, dtype=torch.float32) % 100003 + k + r)
        b.copy_(torch.arange(n, dtype=torch.int32) * (k + 1) + r)
        before = comm._all_reduce_epoch()
        g.replay()
        torch.cuda.synchronize()
        assert comm._all_reduce_epoch() == (before + 6) % (1 << 32), (k, before)
        _check(a, sum(torch.arange(n, dtype=torch.float32) % 100003 + k + q for q in range(W)), "graph f32", k)
        _check(b, sum(torch.arange(n, dtype=torch.int32) * (k + 1) + q for q in range(W)), "graph i32", k)
    return kernels, half


def gather_scatter(comm, replays=3):
    """algo='oneshot' all_gather and reduce_scatter on pyccl's kernels, bitwise equal to NCCL's
    and to the reference: integer-valued data, every dtype and op reduce_scatter's kernels take,
    any dtype for all_gather; parts of 16-byte multiples and not, out of place, in place (the
    input as this rank's part of the output, or the output as this rank's part of the input) and
    one element in; a part larger than a launch stages (run with PYCCL_AR_BUFFER_MB=1: chunks,
    the epoch moves by them); then both in a CUDA graph replayed with new data."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    half = comm.all_reduce_info["buffer_bytes"]
    comm.all_reduce(torch.ones(4, device=dev), algo="oneshot")  # sets the kernels up
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16):
        size = torch.empty(0, dtype=dtype).element_size()
        for count in (1, 3, 1023, 4096, half // size + 3):
            x = ((torch.arange(count, dtype=torch.int64) * 7 + r * 1000 + 1) % 120).to(dtype).to(dev)
            want = torch.empty(W * count, dtype=dtype, device=dev)
            comm.all_gather(x, want, algo="nccl")
            parts = [((torch.arange(count, dtype=torch.int64) * 7 + q * 1000 + 1) % 120).to(dtype)
                     for q in range(W)]
            _check(want, torch.cat(parts), "all_gather nccl", dtype, count)
            got = torch.full_like(want, 3)
            before = comm._all_reduce_epoch()
            comm.all_gather(x, got, algo="oneshot")
            torch.cuda.synchronize()
            chunks = -(-count * size // half)
            assert comm._all_reduce_epoch() == (before + chunks) % (1 << 32), (dtype, count)
            _check(got, want, "all_gather", dtype, count)
            inplace = torch.zeros_like(want)
            inplace[r * count:(r + 1) * count] = x
            comm.all_gather(inplace[r * count:(r + 1) * count], inplace, algo="oneshot")
            _check(inplace, want, "all_gather in place", dtype, count)
            big = torch.zeros(W * count + 1, dtype=dtype, device=dev)
            comm.all_gather(x, big[1:], algo="oneshot")
            _check(big[1:], want, "all_gather one element in", dtype, count)
            checks += 3
    for dtype in DTYPES:
        size = torch.empty(0, dtype=dtype).element_size()
        for op in OPS:
            for count in (1, 3, 1023, 4096, half // size // W + 3):
                vals = [rank_values(k, W * count, dtype, op, W) for k in range(W)]
                ref = reduce_ref(vals, op, dtype)[r * count:(r + 1) * count]
                mine = to_dtype(vals[r], dtype).to(dev)
                nccl = torch.empty(count, dtype=dtype, device=dev)
                comm.reduce_scatter(mine, nccl, op, algo="nccl")
                _check(nccl, ref, "reduce_scatter nccl", dtype, OP_NAMES[op], count)
                got = torch.full_like(nccl, 3)
                before = comm._all_reduce_epoch()
                comm.reduce_scatter(mine, got, op, algo="oneshot")
                torch.cuda.synchronize()
                chunks = -(-W * count * size // half)
                assert comm._all_reduce_epoch() == (before + chunks) % (1 << 32), (dtype, count)
                _check(got, nccl, "reduce_scatter", dtype, OP_NAMES[op], count)
                _check(mine, to_dtype(vals[r], dtype), "input kept")
                inplace = mine.clone()
                comm.reduce_scatter(inplace, inplace[r * count:(r + 1) * count], op, algo="oneshot")
                _check(inplace[r * count:(r + 1) * count], ref, "reduce_scatter in place", dtype,
                       OP_NAMES[op], count)
                odd = torch.empty(W * count + 1, dtype=dtype, device=dev)
                odd[1:] = mine
                out = torch.empty(count + 1, dtype=dtype, device=dev)
                comm.reduce_scatter(odd[1:], out[1:], op, algo="oneshot")
                _check(out[1:], ref, "reduce_scatter one element in", dtype, OP_NAMES[op], count)
                checks += 3
    n = 1000
    a = torch.zeros(n, dtype=torch.float32, device=dev)
    ga = torch.zeros(W * n, dtype=torch.float32, device=dev)
    b = torch.zeros(W * n, dtype=torch.int32, device=dev)
    rb = torch.zeros(n, dtype=torch.int32, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_gather(a, ga, algo="oneshot")
        comm.reduce_scatter(b, rb, algo="oneshot")
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_gather(a, ga, algo="oneshot")
        comm.reduce_scatter(b, rb, algo="oneshot")
    for k in range(replays):
        a.copy_(torch.arange(n, dtype=torch.float32) * (k + 1) + r)
        b.copy_(torch.arange(W * n, dtype=torch.int32) * (k + 2) + r)
        g.replay()
        torch.cuda.synchronize()
        _check(ga, torch.cat([torch.arange(n, dtype=torch.float32) * (k + 1) + q for q in range(W)]),
               "graph all_gather", k)
        _check(rb, sum(torch.arange(W * n, dtype=torch.int32)[r * n:(r + 1) * n] * (k + 2) + q
                       for q in range(W)), "graph reduce_scatter", k)
    return checks


def errors(comm):
    """Argument errors of algo=, each followed by a working call."""
    dev = f"cuda:{comm.device}"
    t = torch.arange(10, dtype=torch.float32, device=dev)
    cases = [
        (dict(algo="fast"), ValueError,
         "all_reduce: algo must be 'auto', 'nccl', 'oneshot' or 'twoshot', got 'fast'"),
        (dict(algo=1), TypeError,
         "all_reduce: algo must be a str ('auto', 'nccl', 'oneshot' or 'twoshot'), got int"),
        (dict(tensor=t.double(), algo="oneshot"), ValueError,
         "all_reduce: algo='oneshot' supports float32, float16, bfloat16 and int32 with SUM, MAX "
         "or MIN; got torch.float64 with op=SUM"),
        (dict(op=pyccl.PROD, algo="twoshot"), ValueError,
         "all_reduce: algo='twoshot' supports float32, float16, bfloat16 and int32 with SUM, MAX "
         "or MIN; got torch.float32 with op=PROD"),
        (dict(op=pyccl.premul_sum(2.0), algo="oneshot"), ValueError,
         "all_reduce: algo='oneshot' supports SUM, MAX and MIN, not premul_sum"),
    ]
    seen = []
    for kw, exc, msg in cases:
        kw = dict(kw)
        tensor = kw.pop("tensor", t)
        try:
            comm.all_reduce(tensor, **kw)
        except exc as e:
            assert str(e) == msg, (str(e), msg)
            seen.append(type(e).__name__)
        else:
            raise AssertionError(f"no error for {kw}")
        u = t.clone()
        comm.all_reduce(u, algo="oneshot")
        _check(u, t.cpu() * comm.size, "after", msg)
    with pyccl.group():
        try:
            comm.all_reduce(t.clone(), algo="oneshot")
        except RuntimeError as e:
            assert str(e) == "all_reduce: algo='oneshot' cannot run inside pyccl.group()", str(e)
            seen.append("group")
        u = t.clone()
        comm.all_reduce(u)  # auto inside a group: NCCL's, grouped
    _check(u, t.cpu() * comm.size, "auto in group")
    return seen


def skewed(comm, calls=4):
    """Run with PYCCL_AR_DEBUG_SKEW_NS: block b of the one-shot and two-shot kernels
    starts b * skew late (the LL kernel has no copy-in step and no skew), so a block that
    uses vectors another block copies in, without a barrier between them, reads the
    stale data of two calls back (different here: each call rolls the values) instead of
    winning the race by luck.  Sizes whose two-shot slices do not start on a multiple of
    the grid's stride (64 x 512 vectors) at 2 ranks, in every dtype below (the two-shot
    bug this guards against hit exactly those), with tails; in and out of place."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    checks = 0
    for dtype in (torch.float32, torch.int32, torch.bfloat16):
        for count in (4097, 65536 + 5, 300001, 1000003):
            base = [rank_values(k, count, dtype, SUM, W) for k in range(W)]
            for algo in ALGOS:
                for c in range(calls):
                    vals = [torch.roll(v, 7 * c + 1) for v in base]
                    ref = reduce_ref(vals, SUM, dtype)
                    mine = to_dtype(vals[r], dtype).to(dev)
                    if c % 2:
                        out = torch.full_like(mine, 3)
                        comm.all_reduce(mine, out=out, algo=algo)
                        _check(out, ref, "skewed", algo, "out of place", dtype, count, c)
                    else:
                        comm.all_reduce(mine, algo=algo)
                        _check(mine, ref, "skewed", algo, "in place", dtype, count, c)
                    checks += 1
    return checks, comm.all_reduce_info


def destroy_collective(comm):
    """After the own kernels ran, destroy() (collective) frees them; a fresh communicator
    made afterwards sets up again and works."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    t = torch.arange(64, dtype=torch.int32, device=dev) + r
    comm.all_reduce(t, algo="oneshot")
    _check(t, sum(torch.arange(64, dtype=torch.int32) + q for q in range(W)), "before destroy")
    info = comm.all_reduce_info
    # the region README promises to free: two halves of the buffer plus the LL areas
    region = 2 * info["buffer_bytes"] + 2 * W * 2 * info["ll_max"]
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info(comm.device)[0]
    comm.destroy()
    after = torch.cuda.mem_get_info(comm.device)[0]
    return before, after, region


def ten_communicators(comm):
    """Ten communicators, every other one with a timeout, set the own kernels up, run them
    and are destroyed on every rank: the device's free memory before and after (one warm-up
    communicator first: NCCL and the kernels' module take memory once per process)."""
    W, r, d = comm.size, comm.rank, comm.device
    dev = f"cuda:{d}"
    base = torch.arange(1000, dtype=torch.int32)

    def new_comm(timeout):
        uid = torch.tensor(list(pyccl.unique_id()) if r == 0 else [0] * 128, dtype=torch.uint8,
                           device=dev)
        comm.broadcast(uid, 0)
        return pyccl.Communicator(W, bytes(uid.cpu().tolist()), r, device=d, timeout=timeout)

    def use_and_destroy(c, i):
        t = base.to(dev) + r + i
        c.all_reduce(t, algo="oneshot")
        _check(t, sum(base + q + i for q in range(W)), "ten communicators", i)
        assert c.all_reduce_info["state"] == "ready", c.all_reduce_info
        c.destroy()

    # Measured only once every rank has destroyed: on distinct GPUs a peer imports NCCL's
    # buffers of this GPU, and they come back when that peer's destroy() released them.
    use_and_destroy(new_comm(None), -1)
    comm.barrier()
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info(d)[0]
    for i in range(10):
        use_and_destroy(new_comm(5.0 if i % 2 else None), i)
    comm.barrier()
    torch.cuda.synchronize()
    return before, torch.cuda.mem_get_info(d)[0]


def coalesced(comm):
    """all_reduce_coalesced of many small tensors of odd sizes (and shapes), three dtypes,
    own kernels and NCCL, bitwise; errors name the argument."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    sizes = [1, 3, 17, 100, 1000, 4097, 2, 555] * 6
    cases = [(dtype, algo, SUM) for dtype in (torch.float32, torch.bfloat16, torch.int32)
             for algo in (None, "nccl", "twoshot")]
    cases += [(dtype, algo, op) for dtype in (torch.float32, torch.bfloat16)  # own kernels' MAX/MIN
              for algo in ("oneshot", "twoshot") for op in (MAX, MIN)]
    for dtype, algo, op in cases:
        vals = [[rank_values(k + 3 * i, n, dtype, op, W) for i, n in enumerate(sizes)]
                for k in range(W)]
        ts = [to_dtype(v, dtype).to(dev) for v in vals[r]]
        ts[5] = ts[5].view(17, 241)  # any shape, contiguous
        if op == SUM:
            comm.all_reduce_coalesced(ts, algo=algo)
        else:
            comm.all_reduce_coalesced(ts, op, algo=algo)
        for i, t in enumerate(ts):
            want = reduce_ref([vals[k][i] for k in range(W)], op, dtype)
            _check(t.flatten(), want, "coalesced", dtype, algo, OP_NAMES[op], i)
    t = torch.ones(4, device=dev)
    msgs = []
    for bad, exc in (([t, t.double()], TypeError), (t, TypeError), ([t, 5], TypeError)):
        try:
            comm.all_reduce_coalesced(bad)
        except exc as e:
            msgs.append(str(e))
    comm.all_reduce_coalesced([])  # nothing to do
    return msgs


def own_give_up(comm, flag):
    """Run with PYCCL_AR_TIMEOUT=3 on a communicator without a timeout: rank 0 calls a
    one-shot all_reduce its peer never joins; its kernel gives up (README: after
    PYCCL_AR_TIMEOUT seconds) instead of spinning forever.  Rank 1 waits for `flag`."""
    r, dev = comm.rank, f"cuda:{comm.device}"
    t = torch.ones(64, device=dev)
    comm.all_reduce(t, algo="oneshot")  # set-up, every rank
    torch.cuda.synchronize()
    comm.barrier()
    torch.cuda.synchronize()
    if r != 0:
        t0 = time.monotonic()
        while not os.path.exists(flag) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        return None, None
    t0 = time.monotonic()
    err = None
    try:
        comm.all_reduce(t, algo="oneshot")
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        err = f"{type(e).__name__}: {e}"
    dt = time.monotonic() - t0
    open(flag, "w").write("done")
    return dt, err


def recreated_late_first_call(comm, rounds=3):
    """New communicators one after another, each's first own-kernel call (its set-up: the
    exchange, the probe) made with one rank late, a different one each round: exact, and the
    kernels ready on every rank."""
    W, r, d = comm.size, comm.rank, comm.device
    dev = f"cuda:{d}"
    for k in range(rounds):
        uid = torch.tensor(list(pyccl.unique_id()) if r == 0 else [0] * 128, dtype=torch.uint8,
                           device=dev)
        comm.broadcast(uid, 0)
        c = pyccl.Communicator(W, bytes(uid.cpu().tolist()), r, device=d)
        if r == k % W:
            time.sleep(1.0)
        t = torch.arange(4099, dtype=torch.int32, device=dev) * (r + 1) + k
        c.all_reduce(t, algo="oneshot")
        _check(t, sum(torch.arange(4099, dtype=torch.int32) * (q + 1) + k for q in range(W)),
               "re-created, late rank", k)
        assert c.all_reduce_info["state"] == "ready", c.all_reduce_info
        c.destroy()
    return rounds


def _timed_comm(comm):
    """A new communicator of comm's ranks with timeout=60, its unique id sent over comm."""
    r = comm.rank
    uid = torch.tensor(list(pyccl.unique_id()) if r == 0 else [0] * 128, dtype=torch.uint8,
                       device=f"cuda:{comm.device}")
    comm.broadcast(uid, 0)
    return pyccl.Communicator(comm.size, bytes(uid.cpu().tolist()), r, device=comm.device, timeout=60)


def aborted_communicators_memory(comm, n=4):
    """n communicators with a timeout, each sets the own kernels up and runs them; every other
    one is aborted instead of destroyed.  -> (free bytes before, after, the region's bytes,
    how many were aborted).  abort() keeps each rank's exported region (a peer may still map
    it), so that much device memory stays per aborted communicator and rank."""
    W, r, d = comm.size, comm.rank, comm.device
    dev = f"cuda:{d}"

    def use(c, i):
        t = torch.arange(1000, dtype=torch.int32, device=dev) + r + i
        c.all_reduce(t, algo="oneshot")
        _check(t, sum(torch.arange(1000, dtype=torch.int32) + q + i for q in range(W)), "aborted", i)
        torch.cuda.synchronize()

    warm = _timed_comm(comm)  # NCCL's and the kernels' per-process memory, once
    use(warm, -1)
    info = warm.all_reduce_info
    region = 2 * info["buffer_bytes"] + 2 * W * 2 * info["ll_max"]
    warm.destroy()
    comm.barrier()
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info(d)[0]
    aborted = 0
    for i in range(n):
        c = _timed_comm(comm)
        use(c, i)
        comm.barrier()  # every rank done with c's kernels before anyone aborts
        torch.cuda.synchronize()
        if i % 2:
            c.abort()
            aborted += 1
        c.destroy()
    comm.barrier()
    torch.cuda.synchronize()
    return before, torch.cuda.mem_get_info(d)[0], region, aborted


def recovery_cycles(comm, n=100):
    """n cycles of what a program that recovers does: a communicator with a timeout, an
    own-kernel all_reduce of random-looking integer data checked bitwise against NCCL's on the
    same communicator, then abort() (odd cycles) or destroy() (even ones).  -> (free bytes
    before, after, the region's bytes, all_reduce_info['parked'] at the end, cycles).  Every
    byte comes back: a region a peer may still map is parked until the peer closed its
    mapping (the release handshake), so at most the last aborted one is left."""
    W, r, d = comm.size, comm.rank, comm.device
    dev = f"cuda:{d}"

    def use(c, i):
        g = torch.Generator().manual_seed(1000 * i + r)
        x = torch.randint(-1000, 1000, (4099,), generator=g, dtype=torch.int32).to(dev)
        own, ref = x.clone(), x.clone()
        c.all_reduce(own, algo="oneshot" if i % 3 else "twoshot")
        c.all_reduce(ref, algo="nccl")
        _check(own, ref, "recovery cycle", i)
        assert c.all_reduce_info["state"] == "ready", c.all_reduce_info

    warm = _timed_comm(comm)  # NCCL's and the kernels' per-process memory, once
    use(warm, -1)
    info = warm.all_reduce_info
    region = 2 * info["buffer_bytes"] + 2 * W * 2 * info["ll_max"]
    warm.destroy()
    comm.barrier()
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info(d)[0]
    for i in range(n):
        c = _timed_comm(comm)
        use(c, i)
        comm.barrier()  # every rank done with c's kernels before anyone lets go of it
        if i % 2:
            c.abort()
        c.destroy()
    comm.barrier()
    torch.cuda.synchronize()
    parked = comm.all_reduce_info["parked"]
    return before, torch.cuda.mem_get_info(d)[0], region, parked, n
