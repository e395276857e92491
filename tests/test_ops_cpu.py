"""CPU tier of pyccl's torch custom ops (pyccl/ops.py, torch.ops.pyccl.*): their schemas,
torch's own checks of them (torch.library.opcheck: schema, fake implementation against the
real one, autograd registration, AOT dispatch), what each op computes, torch.compile with
fullgraph=True (no graph break) equal to eager, torch's functional collectives and dist.*
compiled on a "pyccl" group, and every refused argument with its message.

The communicator behind the group is a stand-in on host tensors that plays rank 0 of
`size` ranks which all hold the same input, so each collective has a known answer that
differs from its input (all_gather repeats it, reduce_scatter scales a part of it, ...).
"""
import datetime
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import pyccl
import pyccl.distributed as pd
import pyccl.ops as ops

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

RANK = 0
OPS = ("SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings ('sum', ...), "
       "or a torch.distributed.ReduceOp")


class SameInputComm:
    """Rank 0 of `size` ranks that all hold the same tensor: each method writes what the collective
    gives there, and logs its call."""

    device = None

    def __init__(self, size, log):
        self.size, self.log, self.destroyed = size, log, False

    def all_reduce(self, t, op=pyccl.SUM, out=None):
        self.log.append(("all_reduce", op))
        r = {pyccl.SUM: t * self.size, pyccl.PROD: t ** self.size, pyccl.MIN: t, pyccl.MAX: t,
             pyccl.AVG: t * self.size / self.size}[op]
        (t if out is None else out).copy_(r)

    def all_gather(self, inp, out):
        self.log.append(("all_gather",))
        out.copy_(torch.cat([inp] * self.size))

    def reduce_scatter(self, inp, out, op):
        self.log.append(("reduce_scatter", op))
        full = torch.empty_like(inp)
        self.all_reduce(inp, op, out=full)
        self.log.pop()
        out.copy_(full.chunk(self.size)[RANK])

    def broadcast(self, t, root, out=None):
        # the ranks' tensors differ here only: rank r holds this one + 7 r (a wrong root shows)
        self.log.append(("broadcast", root))
        (t if out is None else out).copy_(t + 7 * root)

    def all_to_all_single(self, inp, out, in_splits=None, out_splits=None):
        self.log.append(("all_to_all_single", in_splits, out_splits))
        out.copy_(torch.cat([inp.chunk(self.size)[RANK]] * self.size))

    def destroy(self):
        self.destroyed = True


@pytest.fixture(params=[1, 2], ids=["size1", "size2"])
def group(request, monkeypatch):
    """(group, stand-in communicator): a "pyccl" ProcessGroup of `size` ranks, this process rank 0.

    Size 1 comes from dist.init_process_group("pyccl"); size 2 is the group object built as the
    backend builds it and entered in torch's name registry, as init_process_group would."""
    log = []
    comm = SameInputComm(request.param, log)
    if request.param == 1:
        monkeypatch.setattr(pd, "_new_communicator", lambda *a: comm)
        monkeypatch.setattr(pd, "_unique_id", lambda: bytes(range(128)))
        dist.init_process_group("pyccl", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        yield dist.group.WORLD, comm
        dist.destroy_process_group()
    else:
        from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
        pg = pd.ProcessGroupPyccl(comm, RANK, 2, "pyccl-ops-test")
        _register_process_group(pg.group_name, pg)
        yield pg, comm
        _unregister_process_group(pg.group_name)


def _x(dtype, rows=6, cols=3):
    """Integer values 2..102, not a multiple of anything in particular."""
    return ((torch.arange(rows * cols, dtype=torch.int64) * 7 + 5) % 101 + 2).to(dtype).reshape(rows, cols)


def _want(comm, name, x, op="sum", root=0):
    s = comm.size
    red = {"sum": x * s, "prod": x ** s, "min": x, "max": x, "avg": x * s / s}
    return {
        "all_reduce": lambda: red[op],
        "all_gather": lambda: torch.cat([x] * s),
        "reduce_scatter": lambda: red[op].chunk(s)[RANK],
        "broadcast": lambda: x + 7 * root,
        "all_to_all_single": lambda: torch.cat([x.chunk(s)[RANK]] * s),
    }[name]()


def test_schemas():
    want = {
        "all_reduce": 'pyccl::all_reduce(Tensor input, str group, str op="sum") -> Tensor',
        "all_reduce_": 'pyccl::all_reduce_(Tensor(a0!) tensor, str group, str op="sum") -> ()',
        "all_gather": "pyccl::all_gather(Tensor input, str group, SymInt group_size) -> Tensor",
        "reduce_scatter": 'pyccl::reduce_scatter(Tensor input, str group, SymInt group_size, str op="sum") '
                          "-> Tensor",
        "broadcast": "pyccl::broadcast(Tensor input, str group, SymInt root) -> Tensor",
        "broadcast_": "pyccl::broadcast_(Tensor(a0!) tensor, str group, SymInt root) -> ()",
        "all_to_all_single": "pyccl::all_to_all_single(Tensor input, str group, SymInt group_size) -> Tensor",
    }
    got = {name: str(getattr(torch.ops.pyccl, name).default._schema) for name in want}
    assert got == want


TORCH_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_each_op_computes_its_collective(group, dtype):
    pg, comm = group
    x = _x(dtype)
    for handle in (pg, pg.group_name):
        for op in ("sum", "prod", "min", "max") + (("avg",) if dtype.is_floating_point else ()):
            assert torch.equal(ops.all_reduce(x, handle, op), _want(comm, "all_reduce", x, op)), op
            assert comm.log[-1] == ("all_reduce", ops.REDUCE_OPS[op])
            y = x.clone()
            assert ops.all_reduce_(y, handle, op) is y and torch.equal(y, _want(comm, "all_reduce", x, op))
            r = ops.reduce_scatter(x, handle, op)
            assert torch.equal(r, _want(comm, "reduce_scatter", x, op)), op
            # the other spellings of the op: its name in capitals, pyccl's constant, torch's ReduceOp
            for other in (op.upper(), ops.REDUCE_OPS[op], TORCH_OPS[op], dist.ReduceOp(TORCH_OPS[op])):
                assert torch.equal(ops.all_reduce(x, handle, other), _want(comm, "all_reduce", x, op)), other
                assert comm.log[-1] == ("all_reduce", ops.REDUCE_OPS[op]), other
        assert torch.equal(ops.all_gather(x, handle), _want(comm, "all_gather", x))
        for root in range(comm.size):
            want = _want(comm, "broadcast", x, root=root)
            assert torch.equal(ops.broadcast(x, handle, root), want) and comm.log[-1] == ("broadcast", root)
            assert torch.equal(x, _x(dtype))  # the input is left alone
            y = x.clone()
            assert ops.broadcast_(y, handle, root) is y and torch.equal(y, want), root
            assert comm.log[-1] == ("broadcast", root)
        assert torch.equal(ops.all_to_all_single(x, handle), _want(comm, "all_to_all_single", x))
    # a non-contiguous input is read as its values; the output is a new contiguous tensor
    xt = _x(dtype, 6, 6).t()
    got = ops.all_reduce(xt, pg)
    assert got.is_contiguous() and torch.equal(got, _want(comm, "all_reduce", xt.contiguous()))
    assert torch.equal(xt, _x(dtype, 6, 6).t())  # the input is left alone


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_opcheck_every_op(group):
    """torch's own test of a custom op: schema (what it mutates), the fake implementation's
    output against the real one's (shape, dtype, strides), autograd registration, AOT dispatch."""
    pg, _ = group
    name, n = pg.group_name, group[1].size
    x = _x(torch.float32)
    cases = {
        "all_reduce": (x, name, "max"), "all_reduce_": (x.clone(), name, "sum"),
        "all_gather": (x, name, n), "reduce_scatter": (x, name, n, "sum"), "broadcast": (x, name, 0),
        "broadcast_": (x.clone(), name, 0), "all_to_all_single": (x, name, n),
    }
    for op, args in cases.items():
        res = torch.library.opcheck(getattr(torch.ops.pyccl, op).default, args)
        assert set(res.values()) == {"SUCCESS"}, (op, res)


def _every_op(pg):
    def f(x):
        a = ops.all_reduce(x + 1, pg, "max")
        g = ops.all_gather(a, pg)
        r = ops.reduce_scatter(g * 3, pg)
        b = ops.broadcast(r, pg, 0)
        t = ops.all_to_all_single(b - 2, pg)
        v = x * 5
        ops.all_reduce_(v, pg)
        return t, v
    return f


def test_compiled_fullgraph_equals_eager(group):
    pg, comm = group
    torch._dynamo.reset()
    f = _every_op(pg)
    x = _x(torch.float32)
    comm.log.clear()
    want = f(x)
    eager_calls = sorted(map(repr, comm.log))
    comm.log.clear()
    got = torch.compile(f, fullgraph=True)(x)  # fullgraph: a graph break raises
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # the compiled code ran each collective once, as eager did (none dropped, none repeated)
    assert sorted(map(repr, comm.log)) == eager_calls


def test_compiled_op_spellings(group):
    """Every spelling of an op compiles with fullgraph=True (no graph break) and reaches the
    communicator as pyccl's op, as in eager code."""
    pg, comm = group
    torch._dynamo.reset()

    def f(x):
        return (ops.all_reduce(x, pg, "MAX"), ops.all_reduce(x, pg, pyccl.PROD),
                ops.all_reduce(x, pg, dist.ReduceOp.MIN), ops.reduce_scatter(x, pg, dist.ReduceOp.SUM))
    x = _x(torch.float32)
    comm.log.clear()
    want = f(x)
    assert comm.log == [("all_reduce", pyccl.MAX), ("all_reduce", pyccl.PROD), ("all_reduce", pyccl.MIN),
                        ("reduce_scatter", pyccl.SUM)]
    comm.log.clear()
    got = torch.compile(f, fullgraph=True)(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert comm.log == [("all_reduce", pyccl.MAX), ("all_reduce", pyccl.PROD), ("all_reduce", pyccl.MIN),
                        ("reduce_scatter", pyccl.SUM)]


def test_the_op_name_carries_torchs_constant_mark():
    """What makes an op's name a compile-time constant (ops._op_name, set by pyccl so that importing
    it leaves torch's compiler unloaded) is what torch.compiler.assume_constant_result sets."""
    def by_torch(opname, op):
        pass

    def by_pyccl(opname, op):
        pass
    assert torch.compiler.assume_constant_result(by_torch) is by_torch
    assert ops._assume_constant(by_pyccl) is by_pyccl
    assert vars(by_pyccl) == vars(by_torch) == {"_dynamo_marked_constant": True}
    assert vars(ops._op_name) == vars(by_torch)


def test_importing_pyccl_leaves_torchs_compiler_unloaded():
    """`import pyccl` (its ops included) loads neither torch's compiler nor sympy: they load at the
    first torch.compile, as for any torch program."""
    code = ("import sys, torch\n"
            "before = set(sys.modules)\n"
            "import pyccl, pyccl.ops\n"
            "heavy = ('torch._dynamo', 'torch._inductor', 'sympy')\n"
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'sympy' or m in heavy))\n"
            "import torch._dynamo\n"
            "print(torch.ops.pyccl.all_reduce.default.name())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "pyccl::all_reduce"], r.stdout


def test_communicator_is_a_compile_time_constant_per_group(group, monkeypatch):
    """Two groups into one compiled function: each call uses its own group (no stale name)."""
    pg, comm = group
    torch._dynamo.reset()
    other = SameInputComm(comm.size, [])
    other.all_gather = lambda inp, out: out.copy_(torch.cat([inp + 1000] * other.size))
    monkeypatch.setattr(ops, "_C", _Registry(ops._C, {"other": other}))
    f = torch.compile(lambda x, g: ops.all_gather(x, g), fullgraph=True)
    x = _x(torch.int64)
    assert torch.equal(f(x, pg), torch.cat([x] * comm.size))
    assert torch.equal(f(x, "other"), torch.cat([x + 1000] * comm.size))
    assert torch.equal(f(x, pg), torch.cat([x] * comm.size))


class _Registry:
    """pyccl._C with extra names in _communicator() (a Communicator needs a GPU)."""

    def __init__(self, c, extra):
        self._c, self._extra = c, extra

    def _communicator(self, name):
        return self._extra.get(name) or self._c._communicator(name)

    def __getattr__(self, name):
        return getattr(self._c, name)


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")
def test_torch_functional_collectives_compile_on_a_pyccl_group(group):
    """dist.all_reduce and torch's functional collectives on a "pyccl" group, compiled with
    fullgraph=True, reach the group (through torch's C++ ops) and equal eager."""
    import torch.distributed._functional_collectives as funcol
    pg, comm = group
    torch._dynamo.reset()

    def f(x):
        y = x + 1
        dist.all_reduce(y, group=pg)
        a = funcol.all_reduce(x * 2, "sum", pg)
        g = funcol.all_gather_tensor(x, 0, pg)
        r = funcol.reduce_scatter_tensor(g, "sum", 0, pg)
        return y, a, g, r
    x = _x(torch.float32)
    comm.log.clear()
    want = f(x)
    eager_calls = sorted(map(repr, comm.log))
    assert len(eager_calls) == 4
    comm.log.clear()
    got = torch.compile(f, fullgraph=True)(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sorted(map(repr, comm.log)) == eager_calls


@pytest.mark.parametrize("call,exc,text", [
    (lambda x, g: ops.all_reduce(x, g, "xor"), ValueError,
     f"pyccl.ops.all_reduce: op='xor' is not a reduction op ({OPS})"),
    (lambda x, g: ops.reduce_scatter(x, g, op=7), ValueError,
     f"pyccl.ops.reduce_scatter: op=7 is not a reduction op ({OPS})"),
    (lambda x, g: ops.all_reduce_(x, g, op=pyccl.premul_sum(2)), TypeError,
     f"pyccl.ops.all_reduce_: op must be a reduction op ({OPS}), got premul_sum"),
    (lambda x, g: ops.all_reduce(x, g, dist.ReduceOp.BAND), ValueError,
     f"pyccl.ops.all_reduce: op=ReduceOp.BAND has no NCCL reduction ({OPS})"),
    (lambda x, g: torch.ops.pyccl.all_reduce(x, "g", "xor"), ValueError,
     f"pyccl.ops.all_reduce: op='xor' is not a reduction op ({OPS})"),
    (lambda x, g: ops.all_reduce_(x, "no-such-group"), ValueError,
     "pyccl.ops.all_reduce_: group 'no-such-group' names no live pyccl Communicator and no "
     "torch.distributed process group"),
    (lambda x, g: ops.broadcast(x, 5, 0), TypeError,
     "pyccl.ops.broadcast: group must be a pyccl.Communicator, a torch.distributed ProcessGroup on backend "
     "\"pyccl\" or the name of one (str), got int"),
    (lambda x, g: ops.group_name(None), TypeError,
     "pyccl.ops.group_name: group must be a pyccl.Communicator, a torch.distributed ProcessGroup on backend "
     "\"pyccl\" or the name of one (str), got NoneType"),
    (lambda x, g: ops.all_gather(x.sum(), g), ValueError,
     "pyccl.ops.all_gather: input must have at least one dimension (the ranks' parts are along dim 0), "
     "got a 0-dim tensor"),
    (lambda x, g: ops.communicator("all_reduce", 3), TypeError,
     "pyccl.ops.all_reduce: group must be a str (a Communicator's name or a torch.distributed group name), "
     "got int"),
])
def test_refused_arguments(group, call, exc, text):
    pg, comm = group
    x = _x(torch.float32)
    n = len(comm.log)
    with pytest.raises(exc) as e:
        call(x, pg)
    assert str(e.value) == text
    assert len(comm.log) == n  # nothing reached the communicator
    assert torch.equal(ops.all_reduce(x, pg), x * comm.size)  # and the group is usable


@pytest.fixture
def group2(monkeypatch):
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
    comm = SameInputComm(2, [])
    pg = pd.ProcessGroupPyccl(comm, RANK, 2, "pyccl-ops-test-2")
    _register_process_group(pg.group_name, pg)
    yield pg, comm
    _unregister_process_group(pg.group_name)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_to_all_single"])
def test_first_dimension_not_a_multiple_of_the_ranks(group2, op):
    pg, comm = group2
    x = _x(torch.float32, rows=7)
    with pytest.raises(ValueError) as e:
        getattr(ops, op)(x, pg)
    assert str(e.value) == (f"pyccl.ops.{op}: input's first dimension (7) is not a multiple of the "
                            "number of ranks (2)")
    # the same check in the fake implementation: torch.compile refuses it while tracing
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        torch.compile(lambda t: getattr(ops, op)(t, pg), fullgraph=True)(x)
    assert "input's first dimension (7) is not a multiple of the number of ranks (2)" in str(e.value)


def test_group_of_another_backend_refused():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gloo = dist.group.WORLD
        with pytest.raises(ValueError) as e:
            ops.all_reduce(_x(torch.float32), gloo)
        assert str(e.value) == (f"pyccl.ops.all_reduce: group {gloo.group_name!r} is a torch.distributed "
                                "group on backend 'gloo', not \"pyccl\"")
    finally:
        dist.destroy_process_group()


def test_communicator_registry_argument_checked():
    with pytest.raises(TypeError) as e:
        pyccl._C._communicator(5)
    assert str(e.value) == "_communicator: name must be a str, got int"
    assert pyccl._C._communicator("pyccl.Communicator.0") is None  # serials start at 1
