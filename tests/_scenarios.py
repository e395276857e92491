"""Per-rank scenarios of the Communicator API, run in spawned processes.

Every rank can compute every other rank's data (rank_values is a function of
rank and index), so each rank checks its own results bitwise.
"""
import os
import threading
import time

import torch

import pyccl
from _data import AVG, MAX, MIN, OP_NAMES, PROD, SUM, rank_values, reduce_ref, same_bits, to_dtype

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2]
OPS = [SUM, PROD, MAX, MIN, AVG]
COUNTS = [1, 7, 1023, (1 << 20) + 3]


# torch.cuda._sleep cycles queued ahead of work another stream must wait for: about 0.1 s
# at 2 GHz, long past any launch latency, so a missing wait shows as a wrong result.
SLEEP_CYCLES = 200_000_000


def _t(values, dtype, dev):
    return to_dtype(values, dtype).to(dev)


def _check(got, want, *what):
    torch.cuda.synchronize()
    assert same_bits(got, want), what


def every_method(comm, counts=COUNTS):
    """All methods x dtypes x ops x in/out of place x sizes."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    ops = [op for op in OPS if op != AVG or (W & (W - 1)) == 0]
    n_checks = 0
    for dtype in DTYPES:
        for count in counts:
            for op in ops:
                vals = [rank_values(k, count, dtype, op, W) for k in range(W)]
                ref = reduce_ref(vals, op, dtype)
                mine = _t(vals[r], dtype, dev)
                t = mine.clone()
                comm.all_reduce(t, op=op)
                _check(t, ref, "all_reduce", dtype, count, OP_NAMES[op])
                out = torch.full_like(mine, 3)
                comm.all_reduce(mine, op, out=out)
                _check(out, ref, "all_reduce out", dtype, count, OP_NAMES[op])
                _check(mine, to_dtype(vals[r], dtype), "all_reduce input kept")
                for root in range(W):
                    t = mine.clone()
                    comm.reduce(t, root, op=op)
                    _check(t, ref if r == root else mine, "reduce", dtype, count, root)
                    out = torch.full_like(mine, 3)
                    comm.reduce(mine, root, op, out=out)
                    if r == root:
                        _check(out, ref, "reduce out", dtype, count, root)
                # reduce_scatter: tensor input and list input
                big_vals = [rank_values(k, W * count, dtype, op, W) for k in range(W)]
                full = reduce_ref(big_vals, op, dtype)
                want = full[r * count:(r + 1) * count]
                big = _t(big_vals[r], dtype, dev)
                out = torch.full((count,), 3, dtype=dtype, device=dev)
                comm.reduce_scatter(big, out, op=op)
                _check(out, want, "reduce_scatter", dtype, count, OP_NAMES[op])
                out = torch.full((count,), 3, dtype=dtype, device=dev)
                comm.reduce_scatter(list(big.chunk(W)), out, op)
                _check(out, want, "reduce_scatter list", dtype, count, OP_NAMES[op])
                n_checks += 6 + 2 * W
            vals = [rank_values(k, count, torch.int8, SUM, W) for k in range(W)]
            mine = _t(vals[r], dtype, dev)
            for root in range(W):
                t = mine.clone()
                comm.broadcast(t, root)
                _check(t, to_dtype(vals[root], dtype), "broadcast", dtype, count, root)
                out = torch.full_like(mine, 3)
                comm.broadcast(mine, root, out=out)
                _check(out, to_dtype(vals[root], dtype), "broadcast out", dtype, count, root)
            cat = torch.cat([to_dtype(v, dtype) for v in vals])
            out = torch.zeros(W * count, dtype=dtype, device=dev)
            comm.all_gather(mine, out)
            _check(out, cat, "all_gather", dtype, count)
            outs = [torch.zeros(count, dtype=dtype, device=dev) for _ in range(W)]
            comm.all_gather(mine, outs)
            _check(torch.cat([o.cpu() for o in outs]), cat, "all_gather list", dtype, count)
            # in place: the input is this rank's slot of the output
            out = torch.zeros(W * count, dtype=dtype, device=dev)
            out[r * count:(r + 1) * count].copy_(mine)
            comm.all_gather(out[r * count:(r + 1) * count], out)
            _check(out, cat, "all_gather in place", dtype, count)
            n_checks += 2 * W + 3
    return n_checks


def p2p_and_friends(comm):
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    count = 1027
    vals = [rank_values(k, W * count, torch.float32, SUM, W) for k in range(W)]
    mine = vals[r].float().to(dev)
    # send/recv ring under group()
    got = torch.zeros(W * count, device=dev)
    with pyccl.group():
        comm.send(mine, (r + 1) % W)
        comm.recv(got, (r - 1) % W)
    _check(got, vals[(r - 1) % W].float(), "ring")
    # all_to_all: chunk j of rank i lands as chunk i of rank j
    want = torch.cat([vals[k][r * count:(r + 1) * count] for k in range(W)]).float()
    out = torch.zeros(W * count, device=dev)
    comm.all_to_all(mine, out)
    _check(out, want, "all_to_all")
    outs = [torch.zeros(count, device=dev) for _ in range(W)]
    comm.all_to_all(list(mine.chunk(W)), outs)
    _check(torch.cat([o.cpu() for o in outs]), want, "all_to_all lists")
    # all_to_all_single with uneven splits, 2-D rows of 3 elements
    rows_to = [k + 1 + r for k in range(W)]           # rows this rank sends to k
    rows_from = [r + 1 + k for k in range(W)]         # rows rank k sends here
    src = torch.arange(sum(rows_to) * 3, dtype=torch.float32).reshape(-1, 3) + 1000 * r
    dst_dev = torch.zeros(sum(rows_from), 3, device=dev)
    comm.all_to_all_single(src.to(dev), dst_dev, input_splits=rows_to, output_splits=rows_from)
    expect = []
    for k in range(W):
        k_to = [j + 1 + k for j in range(W)]
        k_src = torch.arange(sum(k_to) * 3, dtype=torch.float32).reshape(-1, 3) + 1000 * k
        start = sum(k_to[:r])
        expect.append(k_src[start:start + k_to[r]])
    _check(dst_dev, torch.cat(expect), "all_to_all_single")
    # gather / scatter at every root
    small = vals[r][:count].float().to(dev)
    for root in range(W):
        outs = [torch.zeros(count, device=dev) for _ in range(W)] if r == root else None
        comm.gather(small, outs, root)
        if r == root:
            _check(torch.cat([o.cpu() for o in outs]), torch.cat([v[:count] for v in vals]).float(), "gather", root)
        whole = torch.zeros(W * count, device=dev) if r == root else None
        comm.gather(small, whole, root)
        if r == root:
            _check(whole, torch.cat([v[:count] for v in vals]).float(), "gather whole", root)
        recv = torch.zeros(count, device=dev)
        src = vals[root].float().to(dev) if r == root else None
        comm.scatter(src, recv, root)
        _check(recv, vals[root][r * count:(r + 1) * count].float(), "scatter", root)
    comm.barrier()
    # premul_sum: sum of scalar * x, exact on integer data with scalar 2 / 0.5
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32):
        scalar = 2 if dtype == torch.int32 else 0.5
        vals8 = [rank_values(k, 77, dtype, SUM, 4 * W) for k in range(W)]
        t = _t(vals8[r], dtype, dev)
        comm.all_reduce(t, op=pyccl.premul_sum(scalar))
        want = to_dtype(sum(v * scalar for v in vals8), dtype)
        _check(t, want, "premul_sum", dtype)
    # split: one communicator per parity; all_reduce inside it
    sub = comm.split(r % 2)
    members = [k for k in range(W) if k % 2 == r % 2]
    assert (sub.size, sub.rank) == (len(members), members.index(r))
    t = torch.full((5,), float(r + 1), device=dev)
    sub.all_reduce(t)
    _check(t, torch.full((5,), float(sum(k + 1 for k in members))), "split")
    # rank 0 leaves (color -1: None); the others get a communicator of W-1 ranks that works
    part = comm.split(-1 if r == 0 else 0)
    if r == 0:
        assert part is None
    else:
        assert (part.size, part.rank) == (W - 1, r - 1)
        t = torch.full((5,), float(r + 1), device=dev)
        part.all_reduce(t)
        _check(t, torch.full((5,), float(sum(k + 1 for k in range(1, W)))), "split without rank 0")
        part.destroy()
    sub.destroy()
    # stream= and the current stream: the input is written on a side stream behind a
    # ~0.1 s sleep, so a call enqueued on any other stream reads it unwritten (zeros)
    want = torch.arange(4096, dtype=torch.float32) * sum(range(1, W + 1))
    for how in ("stream=", "current stream"):
        s = torch.cuda.Stream()
        t = torch.zeros(4096, device=dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
            t.copy_(torch.arange(4096, device=dev, dtype=torch.float32) * (r + 1))
            if how == "current stream":
                comm.all_reduce(t)
        if how == "stream=":
            comm.all_reduce(t, stream=s)
        s.synchronize()
        assert torch.equal(t.cpu(), want), (how, t[:4])
    # zero elements
    comm.all_reduce(torch.empty(0, device=dev))
    comm.all_gather(torch.empty(0, device=dev), torch.empty(0, device=dev))
    return "ok"


def cupy_arrays(comm):
    import cupy

    W, r = comm.size, comm.rank
    with cupy.cuda.Device(comm.device):
        a = cupy.arange(1000, dtype=cupy.float32) * (r + 1)
        comm.all_reduce(a)
        cupy.cuda.Device().synchronize()
        assert (a.get() == (cupy.arange(1000, dtype=cupy.float32) * sum(range(1, W + 1))).get()).all()
        g = cupy.zeros(W * 10, dtype=cupy.int64)
        comm.all_gather(cupy.full(10, r + 7, dtype=cupy.int64), g)
        cupy.cuda.Device().synchronize()
        assert g.get().tolist() == sum(([k + 7] * 10 for k in range(W)), [])
        # a torch tensor and a CuPy array in one call
        t = torch.zeros(1000, device=f"cuda:{comm.device}")
        comm.all_reduce(cupy.arange(1000, dtype=cupy.float32), out=t)
        torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32) * W)
    return "ok"


def destroyed_and_errors(comm):
    dev = f"cuda:{comm.device}"
    t = torch.ones(8, device=dev)
    try:
        comm.all_reduce(t, op=7)
    except ValueError as e:
        assert str(e).startswith("all_reduce: op=7 is not a reduction op"), e
    else:
        raise AssertionError("op=7 accepted")
    comm.all_reduce(t)
    comm.wait(timeout=60)   # no timeout of its own: events on its streams
    assert torch.equal(t.cpu(), torch.full((8,), float(comm.size)))
    comm.wait()
    comm.destroy()
    try:
        comm.all_reduce(t)
    except RuntimeError as e:
        assert "has been destroyed" in str(e), e
    else:
        raise AssertionError("destroyed communicator used")
    return "ok"


def from_env(rank, world):
    comm = pyccl.init_from_env(timeout=60)
    assert (comm.rank, comm.size) == (rank, world)
    t = torch.full((1 << 16,), float(rank + 1), device=f"cuda:{comm.device}")
    comm.all_reduce(t)
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.full((1 << 16,), float(world * (world + 1) // 2)))
    comm.destroy()
    return os.environ.get("NODE_RANK", "")


def timed_collectives(rank, world, uid):
    """A communicator with a timeout on healthy peers: the same results as
    without, through every path of the watchdog (first-call connection,
    back-pressure, group end, side streams, barrier, split, premul ops)."""
    comm = pyccl.Communicator(world, uid, rank, timeout=30)
    assert comm.timeout == 30.0 and comm.get_async_error() is None
    dev = f"cuda:{comm.device}"
    total = float(world * (world + 1) // 2)
    for count in COUNTS:
        t = torch.full((count,), float(rank + 1), device=dev)
        comm.all_reduce(t)
        comm.wait()
        assert torch.equal(t.cpu(), torch.full((count,), total)), count
    # far more calls than the 64 tracked at once, none waited for
    t = torch.full((4099,), float(rank + 1), device=dev)
    for _ in range(1000):
        comm.all_reduce(t, op=pyccl.MAX)
    comm.wait()
    assert torch.equal(t.cpu(), torch.full((4099,), float(world)))
    # a group: tracked from its end
    send = torch.full((1001,), float(rank), device=dev)
    recv = torch.full((1001,), -1.0, device=dev)
    with pyccl.group():
        comm.send(send, (rank + 1) % world)
        comm.recv(recv, (rank - 1) % world)
    comm.wait()
    assert torch.equal(recv.cpu(), torch.full((1001,), float((rank - 1) % world)))
    out = torch.zeros(world * 77, device=dev)
    comm.all_gather(torch.full((77,), float(rank), device=dev), out)
    comm.wait()
    assert torch.equal(out.cpu(), torch.arange(world).float().repeat_interleave(77))
    # a side stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.arange(4096, device=dev, dtype=torch.float32) * (rank + 1)
    comm.all_reduce(x, stream=s)
    comm.wait()
    assert torch.equal(x.cpu(), torch.arange(4096, dtype=torch.float32) * total)
    comm.all_reduce(x, op=pyccl.premul_sum(0.5), stream=s)
    comm.barrier()
    s.synchronize()
    assert torch.equal(x.cpu(), torch.arange(4096, dtype=torch.float32) * total * world * 0.5)
    # split: the child has the parent's timeout
    sub = comm.split(rank % 2)
    assert sub.timeout == 30.0 and sub.size == len(range(rank % 2, world, 2))
    y = torch.ones(5, device=dev)
    sub.all_reduce(y)
    sub.wait()
    assert torch.equal(y.cpu(), torch.full((5,), float(sub.size)))
    sub.destroy()
    assert comm.get_async_error() is None
    comm.destroy()
    assert comm.destroyed
    return "ok"


def timed_graph_capture(rank, world, uid):
    """A call captured into a CUDA graph is not tracked (and must not break
    the capture); replays compute; the communicator works on afterwards."""
    comm = pyccl.Communicator(world, uid, rank, timeout=30)
    dev = f"cuda:{comm.device}"
    x = torch.full((1024,), float(rank + 1), device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(20):          # warm up, with events queued when capture starts
            comm.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(x)
    total = float(world * (world + 1) // 2)
    for _ in range(3):
        x.fill_(rank + 1)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), torch.full((1024,), total))
    comm.wait()
    comm.all_reduce(x)
    comm.wait()
    assert torch.equal(x.cpu(), torch.full((1024,), total * world))
    comm.destroy()
    return "ok"


def more_dtypes_and_split_key(comm):
    """uint32/uint64 (and a 16-bit, an 8-bit, a 64-bit float type) through all_reduce, the
    send/recv ring, all_to_all_single, gather and scatter at three sizes, bitwise; then
    split(key=) reversing the ranks, checked through the order of an all_gather."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    dtypes = [getattr(torch, n) for n in ("uint32", "uint64") if hasattr(torch, n)]
    dtypes += [torch.bfloat16, torch.int8, torch.float64]
    checks = 0
    for dtype in dtypes:
        for count in (1, 1023, (1 << 16) + 3):
            vals = [rank_values(k, W * count, dtype, SUM, W) for k in range(W)]
            mine = _t(vals[r], dtype, dev)
            t = mine.clone()
            comm.all_reduce(t)
            _check(t, to_dtype(reduce_ref(vals, SUM, dtype), dtype), "all_reduce", dtype, count)
            got = torch.empty_like(mine)
            with pyccl.group():
                comm.send(mine, (r + 1) % W)
                comm.recv(got, (r - 1) % W)
            _check(got, to_dtype(vals[(r - 1) % W], dtype), "ring", dtype, count)
            out = torch.empty_like(mine)
            comm.all_to_all_single(mine, out)
            for k in range(W):  # chunk k of the output is rank k's chunk r
                _check(out[k * count:(k + 1) * count],
                       to_dtype(vals[k][r * count:(r + 1) * count], dtype), "all_to_all_single", dtype, count, k)
            root = count % W
            part = mine[:count].contiguous()
            outs = [torch.empty_like(part) for _ in range(W)] if r == root else None
            comm.gather(part, outs, root)
            if r == root:
                for k in range(W):
                    _check(outs[k], to_dtype(vals[k][:count], dtype), "gather", dtype, count, k)
            recv = torch.empty_like(part)
            ins = list(mine.chunk(W)) if r == root else None
            comm.scatter(ins, recv, root)
            _check(recv, to_dtype(vals[root][r * count:(r + 1) * count], dtype), "scatter", dtype, count)
            checks += 1
    rev = comm.split(0, key=W - 1 - r)
    assert (rev.rank, rev.size) == (W - 1 - r, W), (rev.rank, rev.size)
    x = torch.full((3,), float(r), device=dev)
    allx = torch.empty(3 * W, device=dev)
    rev.all_gather(x, allx)
    # slot j holds new rank j, which is old rank W-1-j
    _check(allx, torch.tensor([float(W - 1 - j) for j in range(W) for _ in range(3)]), "split key order")
    rev.destroy()
    return checks


def nccl_graph_capture(comm):
    """NCCL's path (algo="nccl", and all_gather, which is always NCCL's) captured in a CUDA
    graph: each replay reduces the inputs of that moment."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    x = torch.zeros(4099, device=dev)
    src = torch.zeros(33, device=dev)
    y = torch.zeros(W * 33, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch asks before capture
        comm.all_reduce(x, algo="nccl")
        comm.all_gather(src, y)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(x, algo="nccl")
        comm.all_gather(src, y)
    base = torch.arange(4099, dtype=torch.float32)
    for k in range(3):
        x.copy_(base * (k + 1) + r)
        src.fill_(10 * r + k)
        g.replay()
        _check(x, sum(base * (k + 1) + q for q in range(W)), "replay all_reduce", k)
        _check(y, torch.tensor([float(10 * q + k) for q in range(W) for _ in range(33)]), "replay all_gather", k)
    return 3


def abort_untimed_from_thread(comm, flag, algo="nccl"):
    """A communicator without a timeout: rank 0 waits on an all_reduce its peer never
    joins (NCCL's kernel, or with algo="oneshot" pyccl's own, which the abort's stop word
    ends); comm.abort() from another thread is the way out (docs: failures and timeouts)."""
    r, dev = comm.rank, f"cuda:{comm.device}"
    t = torch.ones(1 << 16, device=dev)
    comm.all_reduce(t, algo=algo)  # every rank: connected (and the own kernels set up)
    torch.cuda.synchronize()
    if r != 0:
        t0 = time.monotonic()
        while not os.path.exists(flag) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        return None
    assert comm.timeout is None
    comm.all_reduce(t, algo=algo)
    threading.Timer(1.0, comm.abort).start()
    t0 = time.monotonic()
    err = None
    try:
        comm.wait()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        err = f"{type(e).__name__}: {e}"
    dt = time.monotonic() - t0
    destroyed = comm.destroyed
    open(flag, "w").write("done")
    return dt, err, destroyed


def mixed_group_refused(comm, uid2):
    """One group cannot mix communicators with and without timeout: pyccl refuses the second
    kind's call with pyccl.NcclError on every rank (not a hang, not a crash), the group is closed."""
    r, dev = comm.rank, f"cuda:{comm.device}"
    timed = pyccl.Communicator(comm.size, uid2, r, timeout=30)
    x = torch.ones(8, device=dev)
    y = torch.ones(8, device=dev)
    err, where = None, "group start"
    try:
        with pyccl.group():
            where = "timed all_reduce"
            timed.all_reduce(x, algo="nccl")
            where = "untimed all_reduce"
            comm.all_reduce(y, algo="nccl")
            where = "group end"
        where = "synchronize"
        torch.cuda.synchronize()
        where = "none"
    except Exception as e:  # noqa: BLE001 - the parent names what it expected
        err = (type(e).__name__, getattr(e, "code", None), str(e), where)
    try:  # the group level is back at 0: ending another group is refused
        pyccl._C._nccl_group_end()
        closed = False
    except RuntimeError as e:
        closed = str(e) == "group end: no pyccl.group() is open on this thread"
    return err, closed
