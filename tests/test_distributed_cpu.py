"""CPU tier of the torch.distributed backend (pyccl/distributed.py): registration,
the ReduceOp mapping, every refused call's message, the unique-id handshake through
real stores, and the Work/future plumbing through dist.* with a stand-in communicator
that does at one rank what each collective means there (so a swapped input/output or
a wrong argument shows in the data)."""
import contextlib
import datetime
import threading
import types

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllreduceOptions, BroadcastOptions, ReduceOp, ReduceOptions,
                                        _DistributedBackendOptions, _make_nccl_premul_sum)

import pyccl
import pyccl.distributed as pd

OPS = ("SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings ('sum', ...), "
       "or a torch.distributed.ReduceOp")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


class StubComm:
    """A 1-rank communicator on host tensors: each method does what the collective means at 1 rank."""

    device = None

    def __init__(self, log):
        self.log = log
        self.destroyed = False
        self.in_place = []  # the memory the in-place collectives were given (data_ptr)

    def _rec(self, name, *args):
        self.log.append((name,) + args)

    def all_reduce(self, t, op=pyccl.SUM):
        self._rec("all_reduce", op)
        self.in_place.append(t.data_ptr())
        if isinstance(op, pyccl.premul_sum):
            t.mul_(op.premul_scalar)

    def all_reduce_coalesced(self, ts, op=pyccl.SUM):
        self._rec("all_reduce_coalesced", len(ts), op)

    def broadcast(self, t, root):
        self._rec("broadcast", root)
        self.in_place.append(t.data_ptr())

    def reduce(self, t, root, op):
        self._rec("reduce", root, op)
        self.in_place.append(t.data_ptr())

    def all_gather(self, inp, out):
        self._rec("all_gather")
        (out[0] if isinstance(out, list) else out).copy_(inp)

    def reduce_scatter(self, inp, out, op):
        self._rec("reduce_scatter", op)
        out.copy_(inp[0] if isinstance(inp, list) else inp)

    def all_to_all_single(self, inp, out, in_splits=None, out_splits=None):
        self._rec("all_to_all_single", in_splits, out_splits)
        out.copy_(inp)

    def all_to_all(self, inp, out):
        self._rec("all_to_all")
        out[0].copy_(inp[0])

    def gather(self, t, outs, root):
        self._rec("gather", root)
        outs[0].copy_(t)

    def scatter(self, ins, t, root):
        self._rec("scatter", root)
        t.copy_(ins[0])

    def send(self, t, peer):
        self._rec("send", peer)

    def recv(self, t, peer):
        self._rec("recv", peer)

    def barrier(self):
        self._rec("barrier")

    def destroy(self):
        self._rec("destroy")
        self.destroyed = True

    def abort(self):
        self._rec("abort")
        self.destroyed = True


@pytest.fixture
def stub(monkeypatch):
    """(log, created): creations of the backend get a StubComm; the NCCL id is made up."""
    log, created = [], []

    def new_comm(size, uid, rank, timeout, device=None):
        created.append((size, uid, rank, timeout))
        log.append(("device", device))
        return StubComm(log)

    monkeypatch.setattr(pd, "_new_communicator", new_comm)
    monkeypatch.setattr(pd, "_unique_id", lambda: bytes(range(128)))
    yield log, created
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def world(stub):
    dist.init_process_group("pyccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=42))
    return stub


def test_registered_for_cuda_only():
    assert "pyccl" in dist.Backend.backend_list
    assert dist.Backend.PYCCL == "pyccl"
    assert dist.Backend.backend_capability["pyccl"] == ["cuda"]
    assert dist.distributed_c10d.BackendConfig("pyccl").get_device_backend_map() == {"cuda": "pyccl"}
    # importing pyccl must not take CUDA from nccl for init_process_group() without a backend
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    assert dist.Backend._plugins["PYCCL"].extended_api is True
    pd._register()  # twice is harmless
    assert dist.Backend.backend_list.count("pyccl") == 1


@pytest.mark.parametrize("op, expected", [
    (ReduceOp.SUM, pyccl.SUM), (ReduceOp.PRODUCT, pyccl.PROD), (ReduceOp.MIN, pyccl.MIN),
    (ReduceOp.MAX, pyccl.MAX), (ReduceOp.AVG, pyccl.AVG)])
def test_reduce_op_mapping(op, expected):
    assert pd.reduce_op("allreduce", op) == expected
    opts = AllreduceOptions()
    opts.reduceOp = op
    assert pd.reduce_op("allreduce", opts.reduceOp) == expected  # the ReduceOp object form


def test_premul_sum_mapping():
    if not hasattr(_make_nccl_premul_sum(1.0), "factor"):  # torch 2.11: refused, saying why
        with pytest.raises(RuntimeError) as e:
            pd.reduce_op("allreduce", _make_nccl_premul_sum(2.5))
        assert str(e.value) == ("pyccl backend: allreduce with ReduceOp.PREMUL_SUM on this torch "
                                f"({torch.__version__}: the factor is not readable from Python) is not supported")
        return
    m = pd.reduce_op("allreduce", _make_nccl_premul_sum(2.5))
    assert isinstance(m, pyccl.premul_sum) and m.premul_scalar == 2.5
    m = pd.reduce_op("allreduce", _make_nccl_premul_sum(torch.tensor([0.25])))
    assert m.premul_scalar == 0.25
    # (a factor tensor of more than one element is refused by torch itself)


@pytest.mark.parametrize("name", ["BAND", "BOR", "BXOR"])
def test_bitwise_ops_refused(name):
    with pytest.raises(ValueError) as e:
        pd.reduce_op("reduce_scatter", getattr(ReduceOp, name))
    assert str(e.value) == f"pyccl backend: reduce_scatter: op=ReduceOp.{name} has no NCCL reduction ({OPS})"


def test_refused_calls_through_dist(world):
    t = torch.arange(4.0)
    refused = [
        (lambda: dist.recv(t), "pyccl backend: recv_anysource is not supported"),
        (lambda: dist.all_reduce(t, op=ReduceOp.BOR),
         f"pyccl backend: allreduce: op=ReduceOp.BOR has no NCCL reduction ({OPS})"),
        (lambda: dist.reduce(t, 0, op=ReduceOp.BXOR),
         f"pyccl backend: reduce: op=ReduceOp.BXOR has no NCCL reduction ({OPS})"),
    ]
    pg = dist.group.WORLD
    opts = BroadcastOptions()
    opts.rootTensor = 1
    ropts = ReduceOptions()
    ropts.rootTensor = 1
    refused += [
        (lambda: pg.allreduce([t, t.clone()], AllreduceOptions()),
         "pyccl backend: allreduce with 2 tensors per process (one per process only) is not supported"),
        (lambda: pg.broadcast([t], opts),
         "pyccl backend: broadcast with rootTensor=1 (one tensor per process only) is not supported"),
        (lambda: pg.reduce([t], ropts),
         "pyccl backend: reduce with rootTensor=1 (one tensor per process only) is not supported"),
        (lambda: pg.split_group([0]),
         "pyccl backend: split_group (use dist.new_group or dist.new_subgroups) is not supported"),
        (lambda: pg.merge_remote_group(None, 1, None), "pyccl backend: merge_remote_group is not supported"),
        (lambda: pg.monitored_barrier(), "pyccl backend: monitored_barrier is not supported"),
        (lambda: pg._start_coalescing(torch.device("cuda")),
         "pyccl backend: _start_coalescing (torch's NCCL-style coalescing manager) is not supported"),
    ]
    log = world[0]
    for call, message in refused:
        n = len(log)
        with pytest.raises(Exception) as e:
            call()
        # an op NCCL cannot reduce with is a ValueError (as torch's NCCL backend), the rest RuntimeError
        assert type(e.value) is (ValueError if "has no NCCL reduction" in message else RuntimeError)
        assert str(e.value) == message
        assert len(log) == n, f"{message}: the communicator was called anyway"


def test_pg_options_refused(stub):
    opts = _DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size = dist.HashStore(), 0, 1
    opts.timeout, opts.group_id = datetime.timedelta(seconds=1), "g"
    with pytest.raises(RuntimeError) as e:
        pd.create_process_group(opts, "x")
    assert str(e.value) == ("pyccl backend: init_process_group/new_group with pg_options='x' (the group's "
                            "timeout= is the communicator's timeout) is not supported")
    assert stub[1] == []


def _opts(store, rank, size, name, seconds=7.5):
    o = _DistributedBackendOptions()
    o.store, o.group_rank, o.group_size, o.group_id = store, rank, size, name
    o.timeout = datetime.timedelta(seconds=seconds)
    return o


def _two_ranks(stores, name, results):
    def rank(r):
        results[r] = pd.create_process_group(_opts(stores[r], r, 2, name))
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert all(not th.is_alive() for th in threads)


def test_unique_id_handshake_tcpstore(stub, monkeypatch):
    """Rank 0's id reaches rank 1 through a real TCPStore; the key is per group and per creation."""
    _, created = stub
    joined = threading.Barrier(2)
    real = pd._new_communicator

    def new_comm(*a):  # NCCL's init returns only once every rank joined: so does this one
        joined.wait(30)
        return real(*a)
    monkeypatch.setattr(pd, "_new_communicator", new_comm)
    ids = iter([b"A" * 128, b"B" * 128, b"C" * 128])
    monkeypatch.setattr(pd, "_unique_id", lambda: next(ids))
    # both "ranks" are threads of this process: give each its own generation count, as processes have
    monkeypatch.setattr(pd, "_generation", _PerThreadCounter())
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", master.port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    stores = [master, client]
    for name, uid in (("0", b"A" * 128), ("0", b"B" * 128), ("1", b"C" * 128)):
        created.clear()
        pgs = {}
        _two_ranks(stores, name, pgs)
        assert sorted(created, key=lambda c: c[2]) == [(2, uid, 0, 7.5), (2, uid, 1, 7.5)]
        assert pgs[0].group_name == pgs[1].group_name == name
        assert (pgs[0].rank(), pgs[1].rank(), pgs[0].size()) == (0, 1, 2)
    # rank 0 deleted each key once NCCL's init (here the stand-in) returned on it
    assert master.num_keys() <= 1  # TCPStore may count its own bookkeeping key
    assert not master.check(["pyccl/unique_id/0/0"]) and not master.check(["pyccl/unique_id/0/1"])


class _PerThreadCounter(threading.local):
    def __init__(self):
        import collections
        self.c = collections.Counter()

    def __getitem__(self, k):
        return self.c[k]

    def __setitem__(self, k, v):
        self.c[k] = v


def test_handshake_one_rank_and_generations(monkeypatch):
    monkeypatch.setattr(pd, "_unique_id", lambda: b"Z" * 128)
    store = dist.HashStore()
    before = pd._generation["handshake-test"]
    assert pd.exchange_unique_id(store, 0, 1, "handshake-test") == (b"Z" * 128, None)
    assert store.num_keys() == 0  # one rank: nothing goes through the store
    assert pd.exchange_unique_id(store, 0, 2, "handshake-test") == (b"Z" * 128, f"pyccl/unique_id/handshake-test/{before + 1}")
    assert store.get(f"pyccl/unique_id/handshake-test/{before + 1}") == b"Z" * 128
    assert pd._generation["handshake-test"] == before + 2


def test_creator_through_init_process_group(world):
    log, created = world
    assert created == [(1, bytes(range(128)), 0, 42.0)]  # timeout= of init_process_group, in seconds
    pg = dist.group.WORLD
    assert isinstance(pg, pd.ProcessGroupPyccl)
    assert dist.get_backend() == "pyccl"
    assert pg.name() == "pyccl" and pg.group_name == dist.distributed_c10d._get_process_group_name(pg)
    assert pg._get_backend(torch.device("cuda")).supports_splitting is False
    assert dist.get_backend_config() == "cuda:pyccl"
    sub = dist.new_group([0])
    assert isinstance(sub, pd.ProcessGroupPyccl) and sub.group_name != pg.group_name
    assert len(created) == 2
    pg._set_group_name("renamed")
    assert pg.group_name == "renamed"
    pg._set_group_name(dist.distributed_c10d._get_process_group_name(pg))
    dist.destroy_process_group()
    assert [e for e in log if e[0] == "destroy"] == [("destroy",), ("destroy",)]


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # torch 2.13 renamed the *_tensor forms
def test_every_op_through_dist(world):
    """Each dist.* call reaches the right method with the right arguments, and returns a finished Work."""
    log, _ = world
    x = torch.arange(1, 8, dtype=torch.int64) * 3  # 7 elements, not zeros or ones
    out = torch.full_like(x, -1)

    def fresh():
        out.fill_(-1)
        return out

    comm = dist.group.WORLD.communicator
    dist.all_reduce(x)
    assert log[-1] == ("all_reduce", pyccl.SUM)
    dist.all_reduce(x, op=ReduceOp.MAX)
    assert log[-1] == ("all_reduce", pyccl.MAX)
    dist.broadcast(x, src=0)
    assert log[-1] == ("broadcast", 0)
    dist.reduce(x, dst=0, op=ReduceOp.MIN)
    assert log[-1] == ("reduce", 0, pyccl.MIN)
    # in place: the communicator got x's own memory each time (no copy, nothing to copy back)
    assert comm.in_place == [x.data_ptr()] * 4
    outs = [fresh()]
    dist.all_gather(outs, x)
    assert torch.equal(outs[0], x)
    dist.all_gather_into_tensor(fresh(), x)
    assert torch.equal(out, x) and log[-1] == ("all_gather",)
    dist.reduce_scatter(fresh(), [x], op=ReduceOp.PRODUCT)
    assert torch.equal(out, x) and log[-1] == ("reduce_scatter", pyccl.PROD)
    dist.reduce_scatter_tensor(fresh(), x)
    assert torch.equal(out, x) and log[-1] == ("reduce_scatter", pyccl.SUM)
    dist.all_to_all_single(fresh(), x)
    assert torch.equal(out, x) and log[-1] == ("all_to_all_single", None, None)
    dist.all_to_all_single(fresh(), x, output_split_sizes=[7], input_split_sizes=[7])
    assert log[-1] == ("all_to_all_single", [7], [7])
    outs = [fresh()]
    dist.all_to_all(outs, [x])
    assert torch.equal(outs[0], x)
    outs = [fresh()]
    dist.gather(x, outs, dst=0)
    assert torch.equal(outs[0], x) and log[-1] == ("gather", 0)
    dist.scatter(fresh(), [x], src=0)
    assert torch.equal(out, x) and log[-1] == ("scatter", 0)
    dist.barrier()
    assert log[-1] == ("barrier",)
    pg = dist.group.WORLD
    # (dist.send/recv refuse the own rank before the group sees it: call the group as they do)
    assert pg.send([x], 0, 0).is_completed() and log[-1] == ("send", 0)
    assert pg.recv([out], 0, 0).is_completed() and log[-1] == ("recv", 0)
    w = pg.allreduce_coalesced([x, out], dist.AllreduceCoalescedOptions())
    assert log[-1] == ("all_reduce_coalesced", 2, pyccl.SUM) and w.is_completed()
    # mixed dtypes (torch allows them): one group of per-tensor all_reduces
    n = len(log)
    w = pg.allreduce_coalesced([x, x.to(torch.int32)], dist.AllreduceCoalescedOptions())
    assert log[n:] == [("all_reduce", pyccl.SUM)] * 2 and w.is_completed()
    n = len(log)
    pg.allgather_into_tensor_coalesced([fresh()], [x])
    assert torch.equal(out, x) and len(log) == n + 1
    if hasattr(_make_nccl_premul_sum(1.0), "factor"):
        y = x.double()
        dist.all_reduce(y, op=_make_nccl_premul_sum(2.0))
        assert torch.equal(y, x * 2)


def test_async_work_and_future(world):
    x = torch.arange(5, dtype=torch.int32) + 11
    w = dist.all_reduce(x, async_op=True)
    assert w.is_completed() and w.is_success()
    fut = w.get_future()
    assert fut.done()
    value = fut.wait()
    assert len(value) == 1 and value[0] is x
    assert w.wait() is True
    # what DDP does with it: chain a callback on the future
    chained = fut.then(lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), x * 2)
    outs = [torch.zeros_like(x)]
    w = dist.all_gather(outs, x, async_op=True)
    assert w.get_future().wait() == [outs]
    w = dist.barrier(async_op=True)
    assert w.get_future().wait() == []


def test_error_from_communicator_propagates(world, monkeypatch):
    pg = dist.group.WORLD

    def fail(*a, **k):
        raise pyccl.NcclError("all_reduce: rank 0 of 2 timed out")
    monkeypatch.setattr(pg.communicator, "all_reduce", fail)
    with pytest.raises(pyccl.NcclError, match="timed out"):
        dist.all_reduce(torch.ones(3))


def test_shutdown_of_a_failed_communicator_is_quiet(world):
    log, _ = world
    pg = dist.group.WORLD
    pg.abort()
    dist.destroy_process_group()
    # destroy() of a failed or aborted communicator frees what it kept (a revoked handle, the
    # record of its failure) and raises nothing; it still comes after the abort
    assert log.index(("abort",)) < log.index(("destroy",)), log


def test_shutdown_frees_compiled_cuda_graphs_before_destroy(world, monkeypatch):
    """NCCL's destroy waits for the CUDA graphs that captured the communicator's work (seen on an
    H100: destroy_process_group hung after torch.compile(mode="reduce-overhead")): the backend
    frees torch.compile's graphs first."""
    import sys
    import types
    log, _ = world
    trees = types.SimpleNamespace(reset_cudagraph_trees=lambda: log.append(("reset_cudagraph_trees",)))
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    dist.destroy_process_group()
    assert log[-2:] == [("reset_cudagraph_trees",), ("destroy",)], log[-2:]


def test_coalesced_forms_refuse_unpaired_lists(world):
    pg = dist.group.WORLD
    x = torch.arange(4, dtype=torch.float32)
    cases = [
        (lambda: pg.allgather_coalesced([[x], [x]], [x]), "allgather_coalesced: 2 output lists for 1 inputs"),
        (lambda: pg.allgather_into_tensor_coalesced([x], [x, x]), "allgather_into_tensor_coalesced: 1 outputs for 2 inputs"),
        (lambda: pg.reduce_scatter_tensor_coalesced([x, x], [x]), "reduce_scatter_tensor_coalesced: 2 outputs for 1 inputs"),
    ]
    log, _ = world
    n = len(log)
    for call, text in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == "pyccl backend: " + text
    assert len(log) == n  # nothing reached the communicator


def test_device_id_places_the_communicator(stub):
    # init_process_group(device_id=cuda:1): torch binds the group it made, and hands it to the
    # creator (opts.process_group on torch >= 2.14); the communicator goes there, and so do
    # the communicators of groups made from this one
    log, created = stub
    bound = dist.ProcessGroup(0, 1)
    bound.bound_device_id = torch.device("cuda", 1)
    # the creator reads only attributes: torch 2.11's options object has no process_group
    o = _opts(dist.HashStore(), 0, 1, "g")
    opts = types.SimpleNamespace(store=o.store, group_rank=0, group_size=1, group_id="g",
                                 timeout=o.timeout, process_group=bound)
    pg = pd.create_process_group(opts)
    assert log[-1] == ("device", 1)
    assert pg._device_id == 1
    assert pg.bound_device_id is None  # else DeviceMesh would split_group, which needs NCCL's backend
    # without a bound device: the current one (None here), and a plain group says nothing
    opts = _opts(dist.HashStore(), 0, 1, "h")
    pd.create_process_group(opts)
    assert log[-1] == ("device", None)


def test_groups_made_later_follow_the_default_groups_device(world, monkeypatch):
    log, created = world
    default = dist.distributed_c10d._get_default_group()
    default._device_id = 3
    dist.new_group([0])
    assert log[-1] == ("device", 3)


def test_get_backend_refuses_a_device_id_the_communicator_is_not_on():
    class Comm:
        device = 0
    pg = pd.ProcessGroupPyccl(Comm(), 0, 1, "g")
    assert pg._get_backend(torch.device("cuda")) is pg
    assert pg._get_backend(torch.device("cuda", 0)) is pg
    with pytest.raises(ValueError) as e:
        pg._get_backend(torch.device("cuda", 2))
    assert str(e.value) == ("pyccl backend: device_id=cuda:2 but the communicator is on cuda:0 (the current "
                            "device when the group was made); call torch.cuda.set_device(2) before "
                            "init_process_group")


def test_all_to_all_of_uneven_sizes_is_a_group_of_sends_and_receives(world, monkeypatch):
    """torch's list all_to_all allows a size per peer; the Communicator's all_to_all takes equal
    chunks only (it refused: 'input[1] has 6 elements, expected 3'), so uneven lists become one
    NCCL group of a send and a receive per rank, and equal ones stay NCCL's all_to_all."""
    log, _ = world

    @contextlib.contextmanager
    def group():
        log.append(("group start",))
        yield
        log.append(("group end",))

    monkeypatch.setattr(pyccl._api, "group", group)
    pg = dist.group.WORLD
    x = torch.arange(1, 4, dtype=torch.int64) * 5
    assert pg.alltoall([torch.full((5,), -1)], [x]).is_completed()
    assert log[-4:] == [("group start",), ("send", 0), ("recv", 0), ("group end",)], log[-4:]
    assert pg.alltoall([torch.full((3,), -1)], [x]).is_completed()
    assert log[-1] == ("all_to_all",)
    with pytest.raises(ValueError) as e:
        pg.alltoall([torch.full((5,), -1), torch.full((5,), -1)], [x])
    assert str(e.value) == ("pyccl backend: alltoall: 1 inputs and 2 outputs, expected 1 each "
                            "(one per rank)")


def test_shrink_group_refuses_other_backends_and_a_torch_without_the_machinery(monkeypatch):
    assert pd.shrink_group.__doc__ and "Communicator.shrink" in pd.shrink_group.__doc__
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        # a one-rank group is torch's own refusal (nothing to shrink), before anything of pyccl's
        with pytest.raises(ValueError, match="Cannot shrink a process group with size 1"):
            pd.shrink_group([0])
        monkeypatch.setattr(dist.distributed_c10d, "_prepare_shrink_target_group",
                            lambda group: {"process_group": dist.group.WORLD, "group_size": 2,
                                           "current_rank": 0, "is_default_group": True,
                                           "group_name": "0"})
        with pytest.raises(TypeError, match=r'^pyccl.distributed.shrink_group: the group\'s backend is '
                                            r'not "pyccl" \(ProcessGroup\); use torch.distributed.shrink_group$'):
            pd.shrink_group([1])
        monkeypatch.delattr(dist.distributed_c10d, "_register_process_group")
        with pytest.raises(RuntimeError, match=r"lacks _register_process_group \(torch.distributed's "
                                               r"shrink_group machinery\)$"):
            pd.shrink_group([1])
    finally:
        dist.destroy_process_group()


def test_shrunk_group_registered_as_torch_registers_groups_with_or_without_its_helper(monkeypatch):
    # torch 2.11 has no _register_pg_in_world: the same steps are taken by hand there
    c10d = dist.distributed_c10d
    for helper in (True, False):
        if not helper:
            monkeypatch.delattr(c10d, "_register_pg_in_world", raising=False)
        pg = pd.ProcessGroupPyccl(StubComm([]), 0, 1, f"shrunk-{helper}")
        store = dist.HashStore()
        pd._register_in_world(c10d, pg, "pyccl", store, f"shrunk-{helper}", "cuda:pyccl", {5: 0})
        try:
            assert c10d._world.pg_map[pg] == ("pyccl", store)
            assert c10d._world.pg_names[pg] == f"shrunk-{helper}"
            assert c10d._world.pg_group_ranks[pg] == {5: 0}
            assert c10d._resolve_process_group(f"shrunk-{helper}") is pg
            assert c10d.get_global_rank(pg, 0) == 5
        finally:
            for m in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks,
                      c10d._world.pg_backend_config, c10d._world.pg_to_tag):
                m.pop(pg, None)
            c10d._world.tags_to_pg.pop(f"ptd:shrunk-{helper}", None)
            c10d._unregister_process_group(f"shrunk-{helper}")



def test_device_id_read_from_init_process_group_where_torch_does_not_hand_it_over(stub, monkeypatch):
    # torch up to 2.13 makes the group without telling the creator about device_id: the
    # creator reads it from the init_process_group call it runs in (two ranks of a machine
    # would otherwise both be on the current device, cuda:0, which NCCL refuses)
    import inspect
    c10d = dist.distributed_c10d
    real = pd._INIT_CODE  # torch's function under its decorators, with device_id a parameter
    assert real is inspect.unwrap(c10d.init_process_group).__code__
    assert (real.co_name, real.co_filename) == ("init_process_group", c10d.__file__)
    assert "device_id" in real.co_varnames[:real.co_argcount + real.co_kwonlyargcount]
    log, _ = stub

    def init_process_group(backend, device_id=None):  # torch's, as far as the creator can see
        return pd.create_process_group(_opts(dist.HashStore(), 0, 1, "g"))

    monkeypatch.setattr(pd, "_INIT_CODE", init_process_group.__code__)
    # torch turns an int into torch.device("cuda", i) before the creator runs; both are read
    for device_id, want in ((torch.device("cuda", 1), 1), (2, 2), (None, None)):
        pg = init_process_group("pyccl", device_id=device_id)
        assert log[-1] == ("device", want), device_id
        assert pg._device_id == want
    pd.create_process_group(_opts(dist.HashStore(), 0, 1, "direct"))  # no init call running
    assert log[-1] == ("device", None)
