"""Randomized stress: thousands of collectives of random kind, dtype, op and
size (0 and odd sizes included), every result checked bitwise.

Both ranks draw the same sequence from one seed (PYCCL_STRESS_SEED, or a
fixed default; printed, and named in every failure), so a failure replays.
Data comes from _data.rank_values, whose reductions are exact in every dtype,
so each result is compared bit for bit with a float64 reference.  Results are
checked in batches (one synchronize per batch).  Afterwards the run must have
left nothing behind: torch.cuda.memory_allocated back at its baseline, device memory outside
torch (mem_get_info less what torch reserves: pyccl's cudaMalloc, IPC, NCCL) flat, the
communicator's refcount unchanged, and the count of GC-tracked objects flat
(a leak per call would show up thousands of times over).

Two runs: the per-rank API in two spawned processes (one GPU each), and a
shorter one of the pyccl.nccl drop-in in this process over two GPUs.
"""
import gc
import hashlib
import os
import random
import sys
from typing import NamedTuple

import torch

from conftest import needs_gpus, needs_ranks
from _data import AVG, MAX, MIN, OP_NAMES, PROD, SUM, dtype_name, rank_values, reduce_ref, same_bits, to_dtype

DEFAULT_SEED = 20240611
N_OPS = 10_000          # per-rank API, two processes
N_OPS_NCCL = 400        # pyccl.nccl, one process over two GPUs
BATCH = 64              # steps between synchronizations
WARMUP = 200            # steps before the leak baselines are taken
KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "sendrecv", "all_to_all")
NCCL_KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                 torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2)
MOVE_DTYPES = REDUCE_DTYPES + (torch.bool, torch.int16, torch.complex64)   # moved as bytes
PREMUL = "premul_sum"
PREMUL_SCALAR = {torch.float16: 0.5, torch.bfloat16: 0.5, torch.float32: 0.5, torch.float64: 0.5, torch.int32: 2}


def seed():
    return int(os.environ.get("PYCCL_STRESS_SEED", DEFAULT_SEED))


class Step(NamedTuple):
    i: int
    kind: str
    dtype: torch.dtype
    op: object      # SUM..AVG, PREMUL, or None (data movement)
    count: int      # elements per rank chunk
    root: int
    form: str       # "out" (separate output), "inplace", or "list" (per-rank tensors)

    def __str__(self):
        op = "" if self.op is None else f" op={OP_NAMES.get(self.op, self.op)}"
        return (f"step {self.i}: {self.kind} {dtype_name(self.dtype)} count={self.count}{op} "
                f"root={self.root} form={self.form}")


def _count(rng):
    x = rng.random()
    if x < 0.05:
        return 0
    if x < 0.50:
        return rng.randrange(1, 18)
    if x < 0.92:
        return rng.randrange(18, 4100)
    return rng.randrange(4100, 70_000)


def plan(seed, n, world, kinds=KINDS):
    """The step sequence: a function of (seed, n, world, kinds) only."""
    rng = random.Random(seed)
    pow2 = world & (world - 1) == 0
    for i in range(n):
        kind = rng.choice(kinds)
        reducing = kind in REDUCING
        dtype = rng.choice(REDUCE_DTYPES if reducing else MOVE_DTYPES)
        op = None
        if reducing:
            ops = [SUM, PROD, MAX, MIN] + ([AVG] if pow2 else []) + ([PREMUL] if dtype in PREMUL_SCALAR else [])
            op = rng.choice(ops)
        forms = {"sendrecv": ("out",), "broadcast": ("out", "inplace"), "all_reduce": ("out", "inplace"),
                 "reduce": ("out", "inplace"), "all_to_all": ("out", "list")}.get(kind, ("out", "inplace", "list"))
        yield Step(i, kind, dtype, op, _count(rng), rng.randrange(world), rng.choice(forms))


def digest(steps):
    h = hashlib.sha256()
    for s in steps:
        h.update(str(s).encode())
    return h.hexdigest()


def values(step, world, n):
    """float64 data of every rank for this step (n elements each), and the op to pass."""
    k0 = world * step.i  # per-step offset: data differ between steps, and between ranks
    if step.op == PREMUL:
        vals = [rank_values(k0 + q, n, step.dtype, SUM, 4 * world) for q in range(world)]
    elif step.op is not None:
        vals = [rank_values(k0 + q, n, step.dtype, step.op, world) for q in range(world)]
    else:
        vals = [rank_values(k0 + q, n, torch.int8, SUM, world) for q in range(world)]
    return vals


def reference(step, vals):
    if step.op == PREMUL:
        return to_dtype(sum(v * PREMUL_SCALAR[step.dtype] for v in vals), step.dtype)
    return reduce_ref(vals, step.op, step.dtype)


def op_arg(step):
    import pyccl

    return pyccl.premul_sum(PREMUL_SCALAR[step.dtype]) if step.op == PREMUL else step.op


def run_step(comm, step, checks):
    """Enqueue one step on this rank; append (step, what, got, want) rows to check later."""
    import pyccl

    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    c, dt, form = step.count, step.dtype, step.form
    on = lambda v: to_dtype(v, dt).to(dev)  # noqa: E731
    if step.kind == "all_reduce":
        vals = values(step, W, c)
        want, mine = reference(step, vals), on(vals[r])
        if form == "inplace":
            comm.all_reduce(mine, op_arg(step))
            checks.append((step, "tensor", mine, want))
        else:
            out = torch.full_like(mine, 3)
            comm.all_reduce(mine, op_arg(step), out=out)
            checks += [(step, "out", out, want), (step, "input kept", mine, to_dtype(vals[r], dt))]
    elif step.kind == "reduce":
        vals = values(step, W, c)
        want, mine = reference(step, vals), on(vals[r])
        if form == "inplace":
            comm.reduce(mine, step.root, op_arg(step))
            checks.append((step, "tensor", mine, want if r == step.root else to_dtype(vals[r], dt)))
        else:
            out = torch.full_like(mine, 3)
            comm.reduce(mine, step.root, op_arg(step), out=out)
            checks.append((step, "input kept", mine, to_dtype(vals[r], dt)))
            if r == step.root:
                checks.append((step, "out", out, want))
    elif step.kind == "broadcast":
        vals = values(step, W, c)
        mine = on(vals[r])
        if form == "inplace":
            comm.broadcast(mine, step.root)
            checks.append((step, "tensor", mine, to_dtype(vals[step.root], dt)))
        else:
            out = torch.zeros_like(mine)
            comm.broadcast(mine, step.root, out=out)
            checks += [(step, "out", out, to_dtype(vals[step.root], dt)),
                       (step, "input kept", mine, to_dtype(vals[r], dt))]
    elif step.kind == "all_gather":
        vals = values(step, W, c)
        want = torch.cat([to_dtype(v, dt) for v in vals])
        if form == "inplace":
            out = torch.zeros(W * c, dtype=dt, device=dev)
            out[r * c:(r + 1) * c] = on(vals[r])
            comm.all_gather(out[r * c:(r + 1) * c], out)
            checks.append((step, "output", out, want))
        elif form == "list":
            outs = [torch.zeros(c, dtype=dt, device=dev) for _ in range(W)]
            comm.all_gather(on(vals[r]), outs)
            checks += [(step, f"output[{q}]", outs[q], to_dtype(vals[q], dt)) for q in range(W)]
        else:
            out = torch.zeros(W * c, dtype=dt, device=dev)
            comm.all_gather(on(vals[r]), out)
            checks.append((step, "output", out, want))
    elif step.kind == "reduce_scatter":
        vals = values(step, W, W * c)
        want = reference(step, vals)[r * c:(r + 1) * c]
        big = on(vals[r])
        if form == "inplace":
            comm.reduce_scatter(big, big[r * c:(r + 1) * c], op_arg(step))
            checks.append((step, "output", big[r * c:(r + 1) * c], want))
        else:
            out = torch.full((c,), 3, dtype=dt, device=dev)
            comm.reduce_scatter(list(big.chunk(W)) if form == "list" and c > 0 else big, out, op_arg(step))
            checks += [(step, "output", out, want), (step, "input kept", big, to_dtype(vals[r], dt))]
    elif step.kind == "sendrecv":
        vals = values(step, W, c)
        got = torch.zeros(c, dtype=dt, device=dev)
        with pyccl.group():
            comm.send(on(vals[r]), (r + 1) % W)
            comm.recv(got, (r - 1) % W)
        checks.append((step, "received", got, to_dtype(vals[(r - 1) % W], dt)))
    elif step.kind == "all_to_all":
        vals = values(step, W, W * c)
        want = torch.cat([to_dtype(vals[q][r * c:(r + 1) * c], dt) for q in range(W)])
        mine = on(vals[r])
        if form == "list" and c > 0:
            outs = [torch.zeros(c, dtype=dt, device=dev) for _ in range(W)]
            comm.all_to_all(list(mine.chunk(W)), outs)
            checks.append((step, "outputs", torch.cat([o.cpu() for o in outs]), want))
        else:
            out = torch.zeros(W * c, dtype=dt, device=dev)
            comm.all_to_all(mine, out)
            checks.append((step, "output", out, want))
    else:  # pragma: no cover
        raise ValueError(step.kind)


def verify(checks, failures, limit=20):
    for d in range(min(2, torch.cuda.device_count())):
        torch.cuda.synchronize(d)
    for step, what, got, want in checks:
        if not same_bits(got, want) and len(failures) < limit:
            failures.append(f"{step}: {what} differs")
    checks.clear()


def leak_probe(comm, devices):
    gc.collect()
    for d in devices:
        torch.cuda.synchronize(d)
    # Device memory outside torch's allocator (pyccl's own cudaMalloc, IPC mappings, NCCL):
    # what the driver says is used, less what torch's cache still reserves after emptying it.
    torch.cuda.empty_cache()
    outside = []
    for d in devices:
        free, total = torch.cuda.mem_get_info(d)
        outside.append(total - free - torch.cuda.memory_reserved(d))
    return {
        "memory_allocated": [torch.cuda.memory_allocated(d) for d in devices],
        "device_used_outside_torch": outside,
        "comm_refcount": sys.getrefcount(comm) if comm is not None else 0,
        "dtype_refcounts": [sys.getrefcount(d) for d in MOVE_DTYPES],
        "gc_objects": len(gc.get_objects()),
    }


def stress_rank(comm, n, seed):
    """One rank's run (spawned by _ranks.run_ranks).  Returns what the parent asserts."""
    steps = list(plan(seed, n, comm.size))
    failures, checks = [], []
    before = None
    for k, step in enumerate(steps):
        if k == WARMUP:
            verify(checks, failures)
            before = leak_probe(comm, [comm.device])
        run_step(comm, step, checks)
        if len(checks) >= BATCH:
            verify(checks, failures)
    verify(checks, failures)
    del step
    after = leak_probe(comm, [comm.device])
    return {"digest": digest(steps), "failures": failures, "before": before, "after": after,
            "kinds": sorted({s.kind for s in steps}), "zero_steps": sum(s.count == 0 for s in steps)}


def assert_no_leaks(before, after, where):
    assert after["memory_allocated"] == before["memory_allocated"], (where, before, after)
    # NCCL may still connect lazily for a kind first seen after the warm-up (tens of MiB at
    # most); one cudaMalloc (2 MiB granularity) leaked per call would be thousands of MiB.
    grew = [a - b for a, b in zip(after["device_used_outside_torch"], before["device_used_outside_torch"])]
    assert all(g <= 64 << 20 for g in grew), (where, "device memory outside torch grew by", grew)
    assert after["comm_refcount"] == before["comm_refcount"], (where, before, after)
    assert all(abs(a - b) < 100 for a, b in zip(after["dtype_refcounts"], before["dtype_refcounts"])), \
        (where, before["dtype_refcounts"], after["dtype_refcounts"])
    assert abs(after["gc_objects"] - before["gc_objects"]) < 1000, (where, before["gc_objects"], after["gc_objects"])


# ---------------------------------------------------------------- CPU tier: the plan itself

def test_plan_is_seeded_and_covers_everything():
    a = list(plan(seed(), N_OPS, 2))
    assert digest(a) == digest(plan(seed(), N_OPS, 2))
    assert digest(a) != digest(plan(seed() + 1, N_OPS, 2))
    assert {s.kind for s in a} == set(KINDS)
    assert {s.dtype for s in a if s.kind in REDUCING} == set(REDUCE_DTYPES)
    assert {s.dtype for s in a} == set(MOVE_DTYPES)
    assert {s.op for s in a if s.kind in REDUCING} == {SUM, PROD, MAX, MIN, AVG, PREMUL}
    assert {s.form for s in a} == {"out", "inplace", "list"}
    counts = [s.count for s in a]
    assert 0 in counts and any(c % 2 for c in counts) and max(counts) > 4100
    assert {s.root for s in a} == {0, 1}
    # The oracle is exact: every float64 reduction of the data is representable in
    # the dtype (integer AVG truncates by definition, so it is left out).
    checked = 0
    for s in a[:4000]:
        if s.kind in REDUCING and s.count and (s.dtype.is_floating_point or s.op != AVG):
            vals = values(s, 2, min(s.count, 257))
            if s.op == PREMUL:
                exact = sum(v * PREMUL_SCALAR[s.dtype] for v in vals)
            else:
                exact = reduce_ref(vals, s.op, torch.float64)
            assert torch.equal(to_dtype(exact, s.dtype).double(), exact), s
            assert exact.numel() < 8 or len(set(exact.tolist())) > 2, s  # never only zeros or ones
            checked += 1
    assert checked > 500


# ---------------------------------------------------------------- GPU tier

@needs_ranks(2)
def test_stress_per_rank_api_two_processes():
    from _ranks import run_ranks

    s = seed()
    print(f"pyccl stress: PYCCL_STRESS_SEED={s}, {N_OPS} collectives on 2 ranks")
    res = run_ranks(stress_rank, 2, N_OPS, s, timeout=420)
    assert res[0]["digest"] == res[1]["digest"], "ranks drew different sequences"
    assert res[0]["kinds"] == sorted(KINDS) and res[0]["zero_steps"] > 0
    for r in (0, 1):
        assert not res[r]["failures"], f"seed {s}, rank {r}:\n" + "\n".join(res[r]["failures"])
        assert_no_leaks(res[r]["before"], res[r]["after"], f"seed {s}, rank {r}")


def _nccl_step(step, checks):
    """One step of the drop-in over GPUs 0 and 1 (comms=None)."""
    from pyccl import nccl

    W, c, dt = 2, step.count, step.dtype
    on = lambda v, d: to_dtype(v, dt).to(f"cuda:{d}")  # noqa: E731
    if step.kind in ("all_reduce", "reduce"):
        vals = values(step, W, c)
        want = reference(step, vals)
        ins = [on(vals[d], d) for d in range(W)]
        if step.kind == "all_reduce":
            outs = None if step.form == "inplace" else [torch.full_like(t, 3) for t in ins]
            nccl.all_reduce(ins, outs, op=step.op)
            checks += [(step, f"device {d}", (ins if outs is None else outs)[d], want) for d in range(W)]
        else:
            out = None if step.form == "inplace" else torch.full_like(ins[step.root], 3)
            nccl.reduce(ins, out, root=step.root, op=step.op)
            checks.append((step, "root", ins[step.root] if out is None else out, want))
    elif step.kind == "broadcast":
        vals = values(step, W, c)
        ins = [on(vals[d], d) for d in range(W)]
        nccl.broadcast(ins, root=step.root)
        checks += [(step, f"device {d}", ins[d], to_dtype(vals[step.root], dt)) for d in range(W)]
    elif step.kind == "all_gather":
        vals = values(step, W, c)
        outs = [torch.zeros(W * c, dtype=dt, device=f"cuda:{d}") for d in range(W)]
        if step.form == "inplace":
            ins = [outs[d][d * c:(d + 1) * c] for d in range(W)]
            for d in range(W):
                ins[d].copy_(on(vals[d], d))
        else:
            ins = [on(vals[d], d) for d in range(W)]
        nccl.all_gather(ins, outs)
        want = torch.cat([to_dtype(v, dt) for v in vals])
        checks += [(step, f"device {d}", outs[d], want) for d in range(W)]
    else:  # reduce_scatter
        vals = values(step, W, W * c)
        full = reference(step, vals)
        ins = [on(vals[d], d) for d in range(W)]
        if step.form == "inplace":
            outs = [ins[d][d * c:(d + 1) * c] for d in range(W)]
        else:
            outs = [torch.full((c,), 3, dtype=dt, device=f"cuda:{d}") for d in range(W)]
        nccl.reduce_scatter(ins, outs, op=step.op)
        checks += [(step, f"device {d}", outs[d], full[d * c:(d + 1) * c]) for d in range(W)]


@needs_gpus(2, "one process drives two GPUs (the drop-in's list form)")
def test_stress_nccl_api_one_process_two_gpus():
    s = seed()
    print(f"pyccl stress (pyccl.nccl): PYCCL_STRESS_SEED={s}, {N_OPS_NCCL} collectives over 2 GPUs")
    # premul_sum is the per-rank API's; the drop-in takes torch's op ints
    steps = [st._replace(op=SUM) if st.op == PREMUL else st for st in plan(s, N_OPS_NCCL, 2, NCCL_KINDS)]
    failures, checks, before = [], [], None
    for k, step in enumerate(steps):
        if k == WARMUP // 4:
            verify(checks, failures)
            before = leak_probe(None, [0, 1])
        _nccl_step(step, checks)
        if len(checks) >= BATCH:
            verify(checks, failures)
    verify(checks, failures)
    del step
    after = leak_probe(None, [0, 1])
    assert not failures, f"seed {s}:\n" + "\n".join(failures)
    assert_no_leaks(before, after, f"seed {s}")
