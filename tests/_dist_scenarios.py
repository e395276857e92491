"""Per-rank scenarios of the torch.distributed backend's GPU tier (tests/test_distributed_gpu.py).

Each runs in its own spawned process (tests/_ranks.py), builds its groups through
dist.init_process_group, checks its own results bitwise and returns a count or a
measurement.  Data are exactly representable integers, never zeros or ones only.
"""
import copy
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceCoalescedOptions, _make_nccl_premul_sum

import pyccl  # noqa: F401  (registers the backend)
import pyccl.distributed as pd

SIZES = (1, 7, 1023, (1 << 20) + 3)
DTYPES = (torch.int32, torch.float32, torch.bfloat16)
HAS_FACTOR = hasattr(_make_nccl_premul_sum(1.0), "factor")


def _data(n, dtype, rank, small=False):
    """Rank-dependent integers; small=True keeps products of a few ranks exact in every dtype."""
    i = torch.arange(n, device="cuda", dtype=torch.int64)
    v = (i % 3 + 1 + rank % 2) if small else (i * 7 + 13 * rank + 5) % 101 + 2
    return v.to(dtype)


def _check(what, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    # bitwise, also for floats
    assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got,
                       want.view(torch.uint8) if want.dtype != torch.bool else want), f"{what}: results differ"


def _init(rank, world, store, timeout=60.0):
    dist.init_process_group("pyccl", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    pg = dist.group.WORLD
    assert isinstance(pg, pd.ProcessGroupPyccl), type(pg)
    assert pg.communicator.device == torch.cuda.current_device()
    assert pg.communicator.timeout == timeout
    return pg


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 4)).cuda()


def _step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


# ---------------------------------------------------------------------------------------------
# one GPU: a world-size-1 group, every op against what it means at one rank

def one_rank_every_op(rank, world):
    pg = _init(rank, world, dist.HashStore())
    checked = 0
    for n in SIZES:
        for dtype in DTYPES:
            x = _data(n, dtype, 0)
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
            if dtype.is_floating_point:
                ops.append(dist.ReduceOp.AVG)
            for op in ops:
                y = x.clone()
                dist.all_reduce(y, op=op)
                _check(f"all_reduce {op} {dtype} {n}", y, x)
                y = x.clone()
                dist.reduce(y, dst=0, op=op)
                _check(f"reduce {op} {dtype} {n}", y, x)
                out = torch.full_like(x, -3)
                dist.reduce_scatter_tensor(out, x, op=op)
                _check(f"reduce_scatter_tensor {op} {dtype} {n}", out, x)
                checked += 3
            if dtype.is_floating_point and HAS_FACTOR:
                y = x.clone()
                dist.all_reduce(y, op=_make_nccl_premul_sum(2.0))
                _check(f"all_reduce premul_sum {dtype} {n}", y, x * 2)
            y = x.clone()
            dist.broadcast(y, src=0)
            _check("broadcast", y, x)
            outs = [torch.full_like(x, -3)]
            dist.all_gather(outs, x)
            _check("all_gather", outs[0], x)
            out = torch.full_like(x, -3)
            dist.all_gather_into_tensor(out, x)
            _check("all_gather_into_tensor", out, x)
            out = torch.full_like(x, -3)
            dist.reduce_scatter(out, [x])
            _check("reduce_scatter", out, x)
            out = torch.full_like(x, -3)
            dist.all_to_all_single(out, x)
            _check("all_to_all_single", out, x)
            out = torch.full_like(x, -3)
            dist.all_to_all_single(out, x, output_split_sizes=[n], input_split_sizes=[n])
            _check("all_to_all_single splits", out, x)
            outs = [torch.full_like(x, -3)]
            dist.all_to_all(outs, [x])
            _check("all_to_all", outs[0], x)
            outs = [torch.full_like(x, -3)]
            dist.gather(x, outs, dst=0)
            _check("gather", outs[0], x)
            out = torch.full_like(x, -3)
            dist.scatter(out, [x], src=0)
            _check("scatter", out, x)
            checked += 10
    dist.barrier()
    a, b = _data(5, torch.float32, 0), _data(9, torch.int32, 0)
    a0, b0 = a.clone(), b.clone()
    pg.allreduce_coalesced([a, b], AllreduceCoalescedOptions()).wait()
    _check("allreduce_coalesced a", a, a0)
    _check("allreduce_coalesced b", b, b0)
    checked += _async_works_cross_stream()
    checked += _ddp_one_step_matches_plain()
    dist.destroy_process_group()
    assert pg.communicator.destroyed
    return checked


def _async_works_cross_stream():
    """async_op=True on a side stream held back by a long kernel: wait() and get_future().wait()
    on the main stream must order the main stream after it (a host-side no-op would read -3)."""
    x = _data(1 << 16, torch.float32, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    checked = 0
    for how in ("wait", "future"):
        out = torch.full_like(x, -3)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the collective
            w = dist.all_gather_into_tensor(out, x, async_op=True)
        if how == "wait":
            w.wait()
        else:
            value = w.get_future().wait()
            assert value[0] is out
        got = out.clone()  # on the main stream
        _check(f"async all_gather on a side stream, then {how}()", got, x)
        checked += 1
    torch.cuda.synchronize()
    return checked


def _ddp_one_step_matches_plain():
    plain = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain), device_ids=[torch.cuda.current_device()])
    x = torch.arange(64 * 32, device="cuda", dtype=torch.float32).reshape(64, 32) % 17 / 4
    y = torch.arange(64 * 4, device="cuda", dtype=torch.float32).reshape(64, 4) % 5
    _step(plain, torch.optim.SGD(plain.parameters(), lr=0.01), x, y)
    _step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), x, y)
    for (name, p), q in zip(plain.named_parameters(), ddp.module.parameters()):
        _check(f"DDP one step, {name}", q.detach(), p.detach())
    return 1


# ---------------------------------------------------------------------------------------------
# two GPUs: every op on "pyccl" against the same op on "nccl" (oracle), same processes

def vs_nccl_every_op(rank, world, store_path):
    pg = _init(rank, world, dist.FileStore(store_path, world))
    nccl = dist.new_group(backend="nccl")
    checked = 0

    def both(what, fn, *inputs):
        """fn(group, *clones of inputs) -> tensors; equal bitwise between the groups."""
        got = fn(pg, *[t.clone() for t in inputs])
        want = fn(nccl, *[t.clone() for t in inputs])
        for i, (g, w) in enumerate(zip(got, want)):
            _check(f"{what} [{i}]", g, w)
        return 1

    def all_reduce(op):
        def f(g, t):
            dist.all_reduce(t, op=op, group=g)
            return [t]
        return f

    def reduce(op, dst):
        def f(g, t):
            dist.reduce(t, dst=dst, op=op, group=g)
            return [t]
        return f

    def rs_tensor(op):
        def f(g, t):
            out = torch.full((t.numel() // world,), -3, dtype=t.dtype, device="cuda")
            dist.reduce_scatter_tensor(out, t, op=op, group=g)
            return [out]
        return f

    for n in SIZES:
        for dtype in DTYPES:
            x = _data(n, dtype, rank)
            xs = _data(n, dtype, rank, small=True)
            big = _data(n * world, dtype, rank)
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
            if dtype.is_floating_point:
                ops.append(dist.ReduceOp.AVG)
            for op in ops:
                checked += both(f"all_reduce {op} {dtype} {n}", all_reduce(op), x)
                checked += both(f"reduce {op} {dtype} {n}", reduce(op, world - 1), x)
                checked += both(f"reduce_scatter_tensor {op} {dtype} {n}", rs_tensor(op), big)
            checked += both(f"all_reduce PRODUCT {dtype} {n}", all_reduce(dist.ReduceOp.PRODUCT), xs)
            if dtype.is_floating_point and HAS_FACTOR:
                checked += both(f"all_reduce premul_sum {dtype} {n}", all_reduce(_make_nccl_premul_sum(3.0)), xs)
            for root in range(world):
                def bcast(g, t, root=root):
                    dist.broadcast(t, src=root, group=g)
                    return [t]
                checked += both(f"broadcast root {root} {dtype} {n}", bcast, x)

            def ag_list(g, t):
                outs = [torch.full_like(t, -3) for _ in range(world)]
                dist.all_gather(outs, t, group=g)
                return outs

            def ag_tensor(g, t):
                out = torch.full((t.numel() * world,), -3, dtype=t.dtype, device="cuda")
                dist.all_gather_into_tensor(out, t, group=g)
                return [out]

            def rs_list(g, t):
                out = torch.full((n,), -3, dtype=t.dtype, device="cuda")
                dist.reduce_scatter(out, list(t.chunk(world)), group=g)
                return [out]

            def a2a_single(g, t):
                out = torch.full_like(t, -3)
                dist.all_to_all_single(out, t, group=g)
                return [out]

            def gather(g, t):
                outs = [torch.full_like(t, -3) for _ in range(world)] if rank == world - 1 else None
                dist.gather(t, outs, dst=world - 1, group=g)
                return outs or []

            def scatter(g, t):
                ins = list(t.chunk(world)) if rank == world - 1 else None
                out = torch.full((n,), -3, dtype=t.dtype, device="cuda")
                dist.scatter(out, ins, src=world - 1, group=g)
                return [out]

            checked += both(f"all_gather {dtype} {n}", ag_list, x)
            checked += both(f"all_gather_into_tensor {dtype} {n}", ag_tensor, x)
            checked += both(f"reduce_scatter {dtype} {n}", rs_list, big)
            checked += both(f"all_to_all_single {dtype} {n}", a2a_single, big)
            checked += both(f"gather {dtype} {n}", gather, x)
            checked += both(f"scatter {dtype} {n}", scatter, big)

    # uneven all_to_all: rank r sends (r + p + 1) rows of 3 to peer p
    def a2a_uneven(g, t):
        ins = [t[: 3 * (rank + p + 1)].clone() for p in range(world)]
        outs = [torch.full((3 * (p + rank + 1),), -3, dtype=t.dtype, device="cuda") for p in range(world)]
        dist.all_to_all(outs, ins, group=g)
        return outs

    def a2a_single_splits(g, t):
        in_splits = [rank + p + 1 for p in range(world)]
        out_splits = [p + rank + 1 for p in range(world)]
        src = t[: sum(in_splits) * 3].reshape(-1, 3).clone()
        out = torch.full((sum(out_splits), 3), -3, dtype=t.dtype, device="cuda")
        dist.all_to_all_single(out, src, output_split_sizes=out_splits, input_split_sizes=in_splits, group=g)
        return [out]

    def send_recv(g, t):
        got = torch.full_like(t, -3)
        peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            dist.send(t, dst=peer_next, group=g)
            dist.recv(got, src=peer_prev, group=g)
        else:
            dist.recv(got, src=peer_prev, group=g)
            dist.send(t, dst=peer_next, group=g)
        return [got]

    def async_all_reduce(g, t):
        w = dist.all_reduce(t, async_op=True, group=g)
        w.wait()
        return [w.get_future().wait()[0]]

    def coalesced(g, a, b):
        if g is pg:
            pg.allreduce_coalesced([a, b], AllreduceCoalescedOptions()).wait()
        else:
            dist.all_reduce(a, group=g)
            dist.all_reduce(b, group=g)
        return [a, b]

    x = _data(4099 * 3, torch.int32, rank)
    checked += both("all_to_all uneven", a2a_uneven, x)
    checked += both("all_to_all_single uneven splits", a2a_single_splits, x)
    checked += both("send/recv ring", send_recv, x)
    checked += both("async all_reduce", async_all_reduce, _data(1023, torch.float32, rank))
    checked += both("allreduce_coalesced", coalesced, _data(1023, torch.float32, rank), _data(7, torch.int32, rank))
    dist.barrier()
    dist.barrier(group=nccl)
    dist.destroy_process_group()
    assert pg.communicator.destroyed
    return checked


def ddp_vs_nccl(rank, world, store_path, steps=50):
    """DDP on "pyccl" and on "nccl", same model, data and optimizer: bitwise equal parameters after `steps`."""
    pg = _init(rank, world, dist.FileStore(store_path, world))
    nccl = dist.new_group(backend="nccl")
    dev = torch.cuda.current_device()
    base = _model()
    # small buckets: several all_reduces per step, in DDP's bucket order
    a = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[dev], process_group=pg,
                                                  bucket_cap_mb=0.1)
    b = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[dev], process_group=nccl,
                                                  bucket_cap_mb=0.1)
    oa = torch.optim.SGD(a.parameters(), lr=0.02, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.02, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    first = last = None
    for _ in range(steps):
        x = torch.randn(64, 32, device="cuda", generator=g)
        y = torch.randn(64, 4, device="cuda", generator=g)
        la = _step(a, oa, x, y)
        _step(b, ob, x, y)
        first = la.item() if first is None else first
        last = la.item()
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        _check(f"DDP {steps} steps, {name}", p.detach(), q.detach())
    # and the replicas agree across ranks
    flat = torch.cat([p.detach().reshape(-1) for p in a.module.parameters()])
    sums = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(world)]
    dist.all_gather(sums, flat.view(torch.int32).to(torch.int64).sum().reshape(1))
    assert len({s.item() for s in sums}) == 1, sums
    dist.destroy_process_group()
    return first, last


def ddp_killed_peer(rank, world, store_path, timeout, kill_after):
    """DDP on "pyccl" with timeout=`timeout`; the last rank SIGKILLs itself after `kill_after`
    steps.  The others return (seconds from the kill to the exception, its type, its text)."""
    store = dist.FileStore(store_path, world)
    _init(rank, world, store, timeout=timeout)
    dev = torch.cuda.current_device()
    model = torch.nn.parallel.DistributedDataParallel(_model(), device_ids=[dev])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 32, device="cuda")
    y = torch.randn(64, 4, device="cuda")
    for step in range(100_000):
        if rank == world - 1 and step == kill_after:
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            _step(model, opt, x, y).item()
        except Exception as e:  # noqa: BLE001 (what DDP raises is the measurement)
            raised = time.time()
            killed_at = float(store.get("killed_at").decode())
            return raised - killed_at, type(e).__name__, str(e)[:2000], step
    raise AssertionError("no step raised after the peer was killed")


def device_id_places_groups(rank, world, store_path):
    """init_process_group(device_id=cuda:rank) with every rank's current device left at cuda:0:
    the communicator goes on cuda:rank (where torch tells the creator about the device,
    opts.process_group, and where it does not), all_reduce is exact there and a new_group
    follows it."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world) if world > 1 else dist.HashStore()
    dist.init_process_group("pyccl", store=store, rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    got = {"world": pg.communicator.device}
    x = _data(1023, torch.int32, rank).to(dev)
    want = sum(_data(1023, torch.int32, r) for r in range(world)).to(dev)
    dist.all_reduce(x)
    _check("all_reduce with device_id", x, want)
    sub = dist.new_group(list(range(world)))
    got["sub"] = sub.communicator.device
    y = _data(7, torch.float32, rank).to(dev)
    dist.all_reduce(y, group=sub)
    _check("all_reduce on a new_group", y, sum(_data(7, torch.float32, r) for r in range(world)).to(dev))
    dist.barrier()
    dist.destroy_process_group()
    return got


def survivors_shrink_group(rank, world, store_path, timeout):
    """"pyccl" default group with timeout=`timeout`; the last rank SIGKILLs itself at step 100
    of a loop of exact all_reduces.  The others raise, pyccl.distributed.shrink_group() the
    default group to the ranks left, and finish the 200 steps there, bitwise.  -> (seconds
    from the kill to the exception, the new world size and rank)."""
    store = dist.FileStore(store_path, world)
    _init(rank, world, store, timeout=timeout)
    victim, members = world - 1, list(range(world))
    t = torch.empty(1 << 16, device="cuda")
    step, raised = 0, None
    while step < 200:
        if rank == victim and step == 100:
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t.fill_(rank + 1 + step % 5)
        try:
            dist.all_reduce(t)
            dist.distributed_c10d._get_default_group().communicator.wait()  # bounded
        except pyccl.NcclError:
            raised = time.time() - float(store.get("killed_at").decode())
            pd.shrink_group([members.index(victim)])
            members.remove(victim)
            continue  # this step again, on the ranks left
        _check(f"step {step}", t, torch.full_like(t, float(sum(m + 1 + step % 5 for m in members))))
        step += 1
    size, new_rank = dist.get_world_size(), dist.get_rank()
    dist.destroy_process_group()
    return raised, size, new_rank
