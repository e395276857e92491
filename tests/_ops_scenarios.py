"""Per-rank scenarios of pyccl's torch custom ops on GPUs (tests/test_ops_gpu.py).

Each runs in its own spawned process (tests/_ranks.py) with a "pyccl" default group and a
"nccl" group of the same processes, the oracle: every op of pyccl.ops on the group and on
its Communicator equals the same collective on "nccl" bitwise (integer-valued data), and
torch.compile (fullgraph=True; then mode="reduce-overhead", CUDA graphs) equals eager
bitwise.  That the CUDA graphs really replay is checked by counting the ops' Python
implementation: after the warm-up and the recording runs it is not called again.
"""
import torch
import torch.distributed as dist

import pyccl.ops as ops
import _dist_scenarios as ds

DTYPES = (torch.int32, torch.float32, torch.bfloat16)
ROWS = (1, 7, 341)  # rows per rank, of 3 elements: 12, 84, 4092 bytes of float32 per rank
REDUCE = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
          "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}


def _values(rows, dtype, rank, world, small=False):
    """Rank-dependent integers, exact in dtype after any reduction over `world` ranks."""
    small = small or dtype == torch.bfloat16  # bfloat16 holds integers up to 256 exactly
    return ds._data(rows * 3, dtype, rank, small=small).reshape(rows, 3)


def _oracle(nccl, name, x, op=None, root=None):
    world = nccl.size()
    if name == "all_reduce":
        y = x.clone()
        dist.all_reduce(y, op=REDUCE[op], group=nccl)
        return y
    if name == "all_gather":
        out = torch.full((x.shape[0] * world,) + tuple(x.shape[1:]), -3, dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=nccl)
        return out
    if name == "reduce_scatter":
        out = torch.full((x.shape[0] // world,) + tuple(x.shape[1:]), -3, dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, op=REDUCE[op], group=nccl)
        return out
    if name == "broadcast":
        y = x.clone()
        dist.broadcast(y, src=root, group=nccl)
        return y
    if name == "all_to_all_single":
        out = torch.full_like(x, -3)
        dist.all_to_all_single(out, x, group=nccl)
        return out
    raise AssertionError(name)


def every_op_vs_nccl(rank, world, store_path):
    pg = ds._init(rank, world, dist.FileStore(store_path, world))
    nccl = dist.new_group(backend="nccl")
    comm = pg.communicator
    checked = 0
    for handle in (pg, comm, comm.name):
        for rows in ROWS:
            for dtype in DTYPES:
                x = _values(rows, dtype, rank, world)
                big = _values(rows * world, dtype, rank, world)
                reductions = ["sum", "min", "max"] + (["avg"] if dtype.is_floating_point else [])
                if dtype != torch.bfloat16 or world <= 4:  # 3**world stays exact
                    reductions.append("prod")
                for op in reductions:
                    xin = _values(rows, dtype, rank, world, small=True) if op == "prod" else x
                    bin_ = _values(rows * world, dtype, rank, world, small=True) if op == "prod" else big
                    ds._check(f"all_reduce {op} {dtype} {rows}", ops.all_reduce(xin, handle, op),
                              _oracle(nccl, "all_reduce", xin, op))
                    y = xin.clone()
                    ops.all_reduce_(y, handle, op)
                    ds._check(f"all_reduce_ {op} {dtype} {rows}", y, _oracle(nccl, "all_reduce", xin, op))
                    ds._check(f"reduce_scatter {op} {dtype} {rows}", ops.reduce_scatter(bin_, handle, op),
                              _oracle(nccl, "reduce_scatter", bin_, op))
                    checked += 3
                ds._check(f"all_gather {dtype} {rows}", ops.all_gather(x, handle), _oracle(nccl, "all_gather", x))
                root = world - 1
                ds._check(f"broadcast {dtype} {rows}", ops.broadcast(x, handle, root),
                          _oracle(nccl, "broadcast", x, root=root))
                y = x.clone()
                ops.broadcast_(y, handle, root)
                ds._check(f"broadcast_ {dtype} {rows}", y, _oracle(nccl, "broadcast", x, root=root))
                ds._check(f"all_to_all_single {dtype} {rows}", ops.all_to_all_single(big, handle),
                          _oracle(nccl, "all_to_all_single", big))
                checked += 4
    # a non-contiguous input: the values it shows, into a new contiguous tensor
    xt = _values(8 * world, torch.float32, rank, world).t()
    got = ops.all_reduce(xt, comm)
    ds._check("all_reduce of a transposed input", got, _oracle(nccl, "all_reduce", xt.contiguous(), "sum"))
    assert got.is_contiguous()
    dist.barrier(group=nccl)
    dist.destroy_process_group()
    return checked + 1


def _model_fn(world):
    def f(x, g):
        a = ops.all_reduce(x + 1, g, "sum")
        b = ops.all_gather(a * 2, g)
        c = ops.reduce_scatter(b, g, "max")
        d = ops.broadcast(c - 1, g, world - 1)
        e = ops.all_to_all_single(d, g)
        v = x * 3
        ops.all_reduce_(v, g, "min")
        return e * 3, a, v
    return f


class _Counting:
    """Counts the custom ops' Python implementations (each resolves its group once)."""

    def __init__(self, monkey_target):
        self.calls, self._orig, self._target = 0, monkey_target.communicator, monkey_target

    def __enter__(self):
        orig = self._orig

        def counted(opname, group):
            self.calls += 1
            return orig(opname, group)
        self._target.communicator = counted
        return self

    def __exit__(self, *exc):
        self._target.communicator = self._orig


def compiled_equals_eager(rank, world, store_path):
    """fullgraph=True, then mode="reduce-overhead" (CUDA graphs) with new data each call: bitwise
    equal to eager; the graphs replay without running the ops' Python again; also torch's own
    functional collectives and dist.all_reduce on the "pyccl" group, against the same on "nccl"."""
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters
    pg = ds._init(rank, world, dist.FileStore(store_path, world))
    nccl = dist.new_group(backend="nccl")
    f = _model_fn(world)
    checked = 0
    x0 = _values(4 * world, torch.float32, rank, world)
    for handle in (pg, pg.communicator):
        want = f(x0, handle)
        got = torch.compile(f, fullgraph=True)(x0, handle)
        for i, (g, w) in enumerate(zip(got, want)):
            ds._check(f"compiled fullgraph [{i}] on {type(handle).__name__}", g, w)
        checked += 1
        counters.clear()
        graphed = torch.compile(f, fullgraph=True, mode="reduce-overhead")
        with _Counting(ops) as count:
            per_call = []
            for k in range(6):
                x = x0 + 5 * k
                want = f(x, handle)
                before = count.calls
                got = graphed(x, handle)
                per_call.append(count.calls - before)
                for i, (g, w) in enumerate(zip(got, want)):
                    ds._check(f"reduce-overhead call {k} [{i}] on {type(handle).__name__}", g.clone(), w)
                checked += 1
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        # eager's calls of f inside the loop are not counted: only the compiled ones are.
        assert per_call[-3:] == [0, 0, 0], f"the ops ran in Python on every call: not replayed {per_call}"
        assert per_call[0] > 0, per_call

    def tf(x, g):
        y = x * 2
        dist.all_reduce(y, group=g)
        z = funcol.all_gather_tensor(y + 1, 0, g)
        return funcol.reduce_scatter_tensor(z, "sum", 0, g), y

    for mode in (None, "reduce-overhead"):
        compiled = torch.compile(tf, fullgraph=True, mode=mode)
        for k in range(4):
            x = x0 + 3 * k
            want = tf(x, nccl)  # the oracle: the same on "nccl", eager
            got = compiled(x, pg)
            for i, (g, w) in enumerate(zip(got, want)):
                ds._check(f"torch functional collectives on pyccl, mode {mode}, call {k} [{i}]", g.clone(), w)
            checked += 1
    dist.barrier(group=nccl)
    dist.destroy_process_group()
    return checked
