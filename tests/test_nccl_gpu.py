"""GPU tier of pyccl.nccl (the torch.cuda.nccl drop-in).

One process drives every visible GPU (the comms=None clique), plus spawned
processes with one GPU each (comms from init_rank).  Results are checked
bitwise against a float64 reference on integer-valued data, and against
torch.cuda.nccl wherever torch is correct.
"""
import os
import multiprocessing as mp
import threading

import pytest
import torch

from conftest import gpu_count, needs_gpus, needs_ranks
from _data import AVG, MAX, MIN, OP_NAMES, PROD, SUM, dtype_name, rank_values, reduce_ref, same_bits, to_dtype

pyccl = pytest.importorskip("pyccl")
from pyccl import nccl  # noqa: E402

W = gpu_count()
# one process driving every GPU (the list form torch.cuda.nccl has) needs distinct GPUs
needs_distinct = needs_gpus(2, "one process drives several GPUs, as torch.cuda.nccl's list form does")
RANKS = max(2, min(W, 8))  # one process per rank: ranks share GPUs where they outnumber them
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2]
OPS = [SUM, PROD, MAX, MIN, AVG]
COUNTS = [1, 7, 1023, (1 << 20) + 3]
IS_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def _ops_for(dtype):
    # AVG over a world size that is not a power of two is not exact.
    return [op for op in OPS if op != AVG or (W & (W - 1)) == 0]


def _dev_tensor(values, dtype, dev):
    return to_dtype(values, dtype).to(f"cuda:{dev}")


def _sync():
    for d in range(W):
        torch.cuda.synchronize(d)


@needs_gpus(1)
def test_version_matches_torch():
    assert nccl.version() == torch.cuda.nccl.version()
    # The very same file torch loaded (one NCCL per process).
    nccl_path = pyccl._C._library_paths()[0]
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert nccl_path in maps
    assert maps.count("libnccl.so") == maps.count(nccl_path)


@needs_distinct
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_all_reduce(dtype):
    for op in _ops_for(dtype):
        for count in COUNTS:
            vals = [rank_values(r, count, dtype, op, W) for r in range(W)]
            ref = reduce_ref(vals, op, dtype)
            for inplace in (True, False):
                ins = [_dev_tensor(v, dtype, r) for r, v in enumerate(vals)]
                outs = None if inplace else [torch.full_like(t, 3) for t in ins]
                nccl.all_reduce(ins, outs, op=op)
                _sync()
                got = ins if inplace else outs
                for r in range(W):
                    assert same_bits(got[r], ref), (OP_NAMES[op], count, inplace, r)
                if not inplace:  # inputs untouched
                    assert all(same_bits(ins[r], to_dtype(vals[r], dtype)) for r in range(W))


@needs_distinct
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_reduce(dtype):
    for op in _ops_for(dtype):
        for count in COUNTS:
            for root in (0, W - 1):
                vals = [rank_values(r, count, dtype, op, W) for r in range(W)]
                ref = reduce_ref(vals, op, dtype)
                for inplace in (True, False):
                    ins = [_dev_tensor(v, dtype, r) for r, v in enumerate(vals)]
                    out = None if inplace else torch.full_like(ins[root], 3)
                    nccl.reduce(ins, out, root=root, op=op)
                    _sync()
                    assert same_bits(ins[root] if inplace else out, ref), (OP_NAMES[op], count, root, inplace)
                    for r in range(W):
                        if r != root or not inplace:
                            assert same_bits(ins[r], to_dtype(vals[r], dtype))


@needs_distinct
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool, torch.complex64, torch.int16], ids=dtype_name)
def test_broadcast_honours_root(dtype):
    for count in COUNTS:
        for root in range(W):
            vals = [rank_values(r, count, torch.int8, SUM, W) for r in range(W)]
            ins = [to_dtype(v, dtype).to(f"cuda:{r}") for r, v in enumerate(vals)]
            expect = ins[root].cpu()
            nccl.broadcast(ins, root=root)
            _sync()
            for r in range(W):
                assert same_bits(ins[r], expect), (count, root, r)


@needs_distinct
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool, torch.complex64], ids=dtype_name)
def test_all_gather(dtype):
    for count in COUNTS:
        vals = [rank_values(r, count, torch.int8, SUM, W) for r in range(W)]
        expect = torch.cat([to_dtype(v, dtype) for v in vals])
        for inplace in (True, False):
            if inplace:
                outs = [torch.zeros(W * count, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
                ins = [outs[r][r * count:(r + 1) * count] for r in range(W)]
                for r in range(W):
                    ins[r].copy_(to_dtype(vals[r], dtype))
            else:
                ins = [to_dtype(v, dtype).to(f"cuda:{r}") for r, v in enumerate(vals)]
                outs = [torch.zeros(W * count, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
            nccl.all_gather(ins, outs)
            _sync()
            for r in range(W):
                assert same_bits(outs[r], expect), (count, inplace, r)


@needs_distinct
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_reduce_scatter(dtype):
    for op in _ops_for(dtype):
        for count in COUNTS:
            vals = [rank_values(r, W * count, dtype, op, W) for r in range(W)]
            full = reduce_ref(vals, op, dtype)
            for inplace in (True, False):
                ins = [_dev_tensor(v, dtype, r) for r, v in enumerate(vals)]
                if inplace:
                    outs = [ins[r][r * count:(r + 1) * count] for r in range(W)]
                else:
                    outs = [torch.full((count,), 3, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
                nccl.reduce_scatter(ins, outs, op=op)
                _sync()
                for r in range(W):
                    assert same_bits(outs[r], full[r * count:(r + 1) * count]), (OP_NAMES[op], count, inplace, r)


@needs_distinct
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in IS_FP8], ids=dtype_name)
def test_same_as_torch(dtype):
    """Where torch.cuda.nccl is right, pyccl gives the very same bytes."""
    count = 1023
    for op in (SUM, MAX, PROD):
        vals = [rank_values(r, count, dtype, op, W) for r in range(W)]
        a = [_dev_tensor(v, dtype, r) for r, v in enumerate(vals)]
        b = [t.clone() for t in a]
        nccl.all_reduce(a, op=op)
        torch.cuda.nccl.all_reduce(b, op=op)
        _sync()
        assert all(same_bits(x, y) for x, y in zip(a, b))
        a = [_dev_tensor(v, dtype, r) for r, v in enumerate(vals)]
        b = [t.clone() for t in a]
        oa, ob = torch.empty_like(a[0]), torch.empty_like(b[0])
        nccl.reduce(a, oa, root=0, op=op)
        torch.cuda.nccl.reduce(b, ob, root=0, op=op)
        _sync()
        assert same_bits(oa, ob)
    ins = [_dev_tensor(rank_values(r, count, dtype, SUM, W), dtype, r) for r in range(W)]
    oa = [torch.empty(W * count, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
    ob = [torch.empty(W * count, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
    nccl.all_gather(ins, oa)
    torch.cuda.nccl.all_gather(ins, ob)
    ra = [torch.empty(count // W, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
    rb = [torch.empty(count // W, dtype=dtype, device=f"cuda:{r}") for r in range(W)]
    ins2 = [t[: (count // W) * W].contiguous() for t in ins]
    nccl.reduce_scatter(ins2, ra)
    torch.cuda.nccl.reduce_scatter(ins2, rb)
    _sync()
    assert all(same_bits(x, y) for x, y in zip(oa, ob))
    assert all(same_bits(x, y) for x, y in zip(ra, rb))


@needs_distinct
def test_random_float32_against_float64_reference():
    g = torch.Generator().manual_seed(1234)
    count = 100_003
    vals = [torch.randn(count, generator=g, dtype=torch.float64) for _ in range(W)]
    ins = [v.float().to(f"cuda:{r}") for r, v in enumerate(vals)]
    nccl.all_reduce(ins)
    _sync()
    ref = torch.stack([v.float().double() for v in vals]).sum(0)
    for r in range(W):
        err = (ins[r].cpu().double() - ref).norm() / ref.norm()
        assert err < 1e-6, err


@needs_distinct
def test_fp8_is_reduced_natively_not_as_bytes():
    # torch sends fp8 as uint8, so 1.5 + 1.5 gave 256.0 there.
    ins = [torch.full((5,), 1.5, device=f"cuda:{r}").to(torch.float8_e4m3fn) for r in range(W)]
    nccl.all_reduce(ins)
    _sync()
    assert torch.equal(ins[0].float().cpu(), torch.full((5,), 1.5 * W))


@needs_distinct
def test_bool_reduction_is_refused_but_moves():
    ins = [torch.tensor([True, False, r % 2 == 1], device=f"cuda:{r}") for r in range(W)]
    with pytest.raises(RuntimeError, match=r"^all_reduce: cannot reduce torch.bool tensors"):
        nccl.all_reduce(ins)
    with pytest.raises(RuntimeError, match=r"^Unconvertible NCCL type ComplexFloat$"):
        nccl.all_reduce([torch.ones(2, dtype=torch.complex64, device=f"cuda:{r}") for r in range(W)])
    nccl.broadcast(ins, root=W - 1)
    _sync()
    assert all(t.cpu().tolist() == [True, False, (W - 1) % 2 == 1] for t in ins)


@needs_distinct
def test_streams_argument():
    count = 4099
    streams = [torch.cuda.Stream(device=r) for r in range(W)]
    ins = []
    for r in range(W):
        with torch.cuda.device(r), torch.cuda.stream(streams[r]):
            t = torch.arange(count, device=f"cuda:{r}", dtype=torch.float32) * (r + 2)
            ins.append(t)
    nccl.all_reduce(ins, streams=streams)
    for s in streams:
        s.synchronize()
    ref = torch.arange(count, dtype=torch.float32) * sum(r + 2 for r in range(W))
    assert all(torch.equal(t.cpu(), ref) for t in ins)
    # A list with None entries means that device's current stream.
    ins2 = [torch.full((9,), float(r + 1), device=f"cuda:{r}") for r in range(W)]
    nccl.all_reduce(ins2, streams=[None] + streams[1:])
    _sync()
    assert all(torch.equal(t.cpu(), torch.full((9,), float(W * (W + 1) // 2))) for t in ins2)


@needs_distinct
def test_clique_threads():
    """Two threads calling at once on a fresh device order share one clique."""
    order = list(reversed(range(W)))
    errors, results = [], []

    def run(k):
        try:
            ins = [torch.full((1000,), float(k + d), device=f"cuda:{d}") for d in order]
            nccl.all_reduce(ins)
            for d in order:
                torch.cuda.synchronize(d)
            results.append((k, [t.cpu() for t in ins]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert len(results) == 4
    for k, outs in results:
        want = float(sum(k + d for d in order))
        assert all(torch.equal(o, torch.full((1000,), want)) for o in outs)


@needs_gpus(1)
def test_single_rank_comm_destroy_and_nccl_error():
    torch.cuda.set_device(0)
    comm = nccl.init_rank(1, nccl.unique_id(), 0)
    assert (comm.rank, comm.size, comm.device) == (0, 1, 0)
    t = torch.arange(10, dtype=torch.float32, device="cuda:0")
    # An op value NCCL rejects: an NcclError, and the process carries on.
    with pytest.raises(pyccl.NcclError) as ei:
        nccl.all_reduce([t], op=99, comms=[comm])
    assert ei.value.code == 4  # ncclInvalidArgument
    assert ei.value.error_string
    assert str(ei.value).startswith("all_reduce: NCCL error 4")
    nccl.all_reduce([t], op=SUM, comms=[comm])
    torch.cuda.synchronize(0)
    assert torch.equal(t.cpu(), torch.arange(10, dtype=torch.float32))
    comm.destroy()
    assert comm.destroyed
    with pytest.raises(RuntimeError, match=r"^all_reduce: the communicator \(rank 0 of 1\) has been destroyed$"):
        nccl.all_reduce([t], comms=[comm])
    comm.destroy()  # idempotent


@needs_gpus(1)
@pytest.mark.parametrize("n", [7, (1 << 20) + 3, (1 << 20) + 4])
def test_one_rank_reduce_scatter_avg_writes_every_element(n):
    """NCCL 2.28.9 leaves the tail of a one-rank ReduceScatter with AVG from 2^20 elements on
    unwritten (torch.cuda.nccl too); pyccl gives the average of one rank, itself, whole."""
    torch.cuda.set_device(0)
    x = ((torch.arange(n, device="cuda:0") * 7 + 5) % 101 + 2).float()
    out = torch.full_like(x, -3.0)
    nccl.reduce_scatter([x], [out], op=AVG)
    assert torch.equal(out, x)
    with pyccl.Communicator(1, pyccl.unique_id(), 0) as comm:
        for form in ("tensor", "list"):
            out = torch.full_like(x, -3.0)
            comm.reduce_scatter(x if form == "tensor" else [x], out, op=pyccl.AVG)
            assert torch.equal(out, x), form


@needs_gpus(1)
def test_zero_elements():
    """Zero elements move nothing (the memory around the empty view keeps its bits) and
    leave nothing half-done: a real call right after gives the exact sum."""
    n = min(W, 2)
    bufs = [torch.arange(1, 9, dtype=torch.float32, device=f"cuda:{d}") * (d + 1) for d in range(n)]
    empty = [b[4:4] for b in bufs]  # zero elements, pointing into the middle of bufs
    assert nccl.all_reduce(empty) is None
    assert nccl.broadcast(empty) is None
    for d in range(n):
        torch.cuda.synchronize(d)
        assert same_bits(bufs[d].cpu(), torch.arange(1, 9, dtype=torch.float32) * (d + 1))
    nccl.all_reduce(bufs)
    for d in range(n):
        torch.cuda.synchronize(d)
        assert same_bits(bufs[d].cpu(), torch.arange(1, 9, dtype=torch.float32) * sum(range(1, n + 1)))


# ---------- one process per GPU, comms from init_rank ----------

def _rank_worker(rank, world, uid, q):
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # W processes share the cores
        dev = f"cuda:{pyccl.place_rank(rank, world)}"
        comm = nccl.init_rank(world, uid, rank)
        res = {"rank": comm.rank, "size": comm.size}
        count = 1023
        x = rank_values(rank, count, torch.float32, SUM, world).float().to(dev)
        a = x.clone()
        nccl.all_reduce([a], comms=[comm])
        res["all_reduce"] = a
        b = x.clone()
        nccl.broadcast([b], root=world - 1, comms=[comm])
        res["broadcast"] = b
        c = x.clone()
        nccl.reduce([c], root=world - 1, op=MAX, comms=[comm])
        res["reduce"] = c
        g = torch.zeros(world * count, device=dev)
        nccl.all_gather([x], [g], comms=[comm])
        res["all_gather"] = g
        big = rank_values(rank, world * count, torch.float32, SUM, world).float().to(dev)
        s = torch.zeros(count, device=dev)
        nccl.reduce_scatter([big], [s], comms=[comm])
        res["reduce_scatter"] = s
        torch.cuda.synchronize()
        q.put((rank, {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in res.items()}))
        comm.destroy()
    except BaseException as e:  # report, never hang the parent
        q.put((rank, repr(e)))


def run_ranks(target, world, args=(), timeout=180):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = nccl.unique_id()
    procs = [ctx.Process(target=target, args=(r, world, uid, q) + tuple(args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, res = q.get(timeout=timeout)
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r, res in results.items():
        assert not isinstance(res, str), f"rank {r} failed: {res}"
    return results


@needs_ranks(2)
def test_multiprocess_init_rank_all_collectives():
    count, W = 1023, RANKS
    res = run_ranks(_rank_worker, W)
    vals = [rank_values(r, count, torch.float32, SUM, W) for r in range(W)]
    big = [rank_values(r, W * count, torch.float32, SUM, W) for r in range(W)]
    full = reduce_ref(big, SUM, torch.float32)
    for r in range(W):
        got = res[r]
        assert (got["rank"], got["size"]) == (r, W)
        assert same_bits(got["all_reduce"], reduce_ref(vals, SUM, torch.float32))
        assert same_bits(got["broadcast"], vals[W - 1].float())
        if r == W - 1:
            assert same_bits(got["reduce"], reduce_ref(vals, MAX, torch.float32))
        else:
            assert same_bits(got["reduce"], vals[r].float())
        assert same_bits(got["all_gather"], torch.cat(vals).float())
        assert same_bits(got["reduce_scatter"], full[r * count:(r + 1) * count])


@needs_gpus(1)
def test_error_texts_match_torch_cuda_nccl():
    """The drop-in fails the way torch.cuda.nccl does: same exception type, same text,
    asked of torch itself rather than copied into the test."""
    import torch.cuda.nccl as tn
    t = torch.arange(4, dtype=torch.float32, device="cuda:0")
    cases = {
        "not a sequence": lambda m: m.all_reduce(t),
        "not a tensor": lambda m: m.all_reduce([t, 5]),
        "empty": lambda m: m.all_reduce([]),
        "cpu tensor": lambda m: m.all_reduce([torch.ones(4)]),
        "outputs length": lambda m: m.all_reduce([t], [t, t]),
        "non-contiguous": lambda m: m.broadcast([torch.ones(4, 4, device="cuda:0").t()]),
    }
    for name, call in cases.items():
        got = want = None
        try:
            call(tn)
        except Exception as e:  # noqa: BLE001 - compared below
            want = (type(e), str(e))
        try:
            call(nccl)
        except Exception as e:  # noqa: BLE001
            got = (type(e), str(e))
        assert want is not None, f"{name}: torch.cuda.nccl accepted it"
        assert got is not None and issubclass(got[0], want[0]) and got[1] == want[1], (name, got, want)


@needs_distinct
def test_drop_in_from_several_threads():
    """comms=None calls from several threads at once are serialized (README): each
    thread's results are its own, exactly, and nothing hangs."""
    errors = []

    def work(k):
        try:
            for i in range(20):
                ts = [torch.full((1001,), float(100 * k + i + d), device=f"cuda:{d}") for d in range(2)]
                nccl.all_reduce(ts)
                for d in range(2):
                    torch.cuda.synchronize(d)
                want = torch.full((1001,), float(sum(100 * k + i + d for d in range(2))))
                assert all(same_bits(t.cpu(), want) for t in ts), (k, i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {e!r}")

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread is still inside pyccl after 120 s"
    assert not errors, errors
