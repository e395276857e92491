"""Scenarios of communicators with a timeout, on tests/fakegpu/fakegpu.c.

Run as `python child_fakegpu.py LIBPATH SCENARIO` (test_timeout_cpu.py does): a
stub `torch` module is installed first so that no real torch, NCCL or CUDA is
loaded, then pyccl._C is pointed at the fake library, which stands in for
both libnccl and libcudart.  Each scenario asserts its own results and
returns something JSON-able, printed as the last line ("RESULT {...}").
"""
import atexit
import ctypes
import json
import os
import sys
import threading
import time
import types

LIB, SCENARIO = sys.argv[1], sys.argv[2]
fake = ctypes.CDLL(LIB)
fake.fake_get.restype = ctypes.c_double
fake.fake_get.argtypes = [ctypes.c_char_p]
fake.fake_set.argtypes = [ctypes.c_char_p, ctypes.c_double]


def get(key):
    return fake.fake_get(key.encode())


def put(key, value):
    assert fake.fake_set(key.encode(), float(value)) == 0, key


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "torch." + self.name


def _stub_torch():
    torch = types.ModuleType("torch")
    torch.Tensor = type("Tensor", (), {})
    torch.__version__ = "0+stub"
    torch.strided = object()
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64",
                 "uint32", "uint64", "bool", "int16", "uint16", "complex64", "complex128"):
        setattr(torch, name, _Dtype(name))
    cuda = types.ModuleType("torch.cuda")
    cuda.Stream = type("Stream", (), {})
    cuda.device_count = lambda: 2
    cuda.set_device = lambda d: None
    torch.cuda = cuda
    c = types.ModuleType("torch._C")
    c._cuda_getCurrentRawStream = lambda dev: 0x7000 + dev

    def no_kernels(*a, **k):
        raise RuntimeError("stub torch runs no kernels")
    torch._foreach_copy_ = no_kernels
    nn = types.ModuleType("torch._C._nn")

    def flatten_dense_tensors(tensors):  # torch's signature: one sequence of tensors
        raise RuntimeError(f"stub torch runs no kernels (flatten_dense_tensors of {len(tensors)} tensors)")
    nn.flatten_dense_tensors = flatten_dense_tensors
    nn.unflatten_dense_tensors = no_kernels
    c._nn = nn
    torch._C = c
    sys.modules.update({"torch": torch, "torch.cuda": cuda, "torch._C": c})


_stub_torch()
# Runs after pyccl's own exit hook (atexit is last in, first out).
atexit.register(lambda: print("AT_EXIT " + json.dumps({k: get(k) for k in ("aborts", "misuse", "concurrent")}),
                              flush=True))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pyccl  # noqa: E402

pyccl._C._set_library_candidates([LIB], [LIB])


class Array:
    """float32 host memory the fake NCCL works on, by __cuda_array_interface__."""

    def __init__(self, values):
        self.buf = (ctypes.c_float * len(values))(*values)
        self.__cuda_array_interface__ = {"shape": (len(values),), "typestr": "<f4",
                                         "data": (ctypes.addressof(self.buf), False),
                                         "strides": None, "version": 3}

    def tolist(self):
        return list(self.buf)


class Tensor(sys.modules["torch"].Tensor):
    """What pyccl.nccl (the drop-in) reads off a torch.Tensor, over an Array."""

    is_cuda = True

    def __init__(self, values, device=0):
        import torch
        self.array = Array(values)
        self.device = device
        self.layout, self.dtype = torch.strided, torch.float32

    def is_contiguous(self):
        return True

    def numel(self):
        return len(self.array.buf)

    def get_device(self):
        return self.device

    def data_ptr(self):
        return ctypes.addressof(self.array.buf)

    def tolist(self):
        return self.array.tolist()


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return time.monotonic() - t0, e
    return time.monotonic() - t0, None


def clean():
    """What pyccl must never do, whatever happened."""
    assert get("misuse") == 0, "a dead communicator or event was used"
    assert get("concurrent") == 0, "two threads were inside one communicator"


# FAKE_BLOCKING=1: the communicators these scenarios make with a timeout have a blocking
# handle (the backend's kind), so the same behaviour is checked on both
BLOCKING = True if os.environ.get("FAKE_BLOCKING") == "1" else None


def new(world=2, rank=0, timeout=5.0):
    return pyccl.Communicator(world, pyccl.unique_id(), rank, timeout=timeout,
                              blocking=BLOCKING if timeout else None)


# ---------------------------------------------------------------- scenarios

def init_then_collectives():
    put("init_delay", 0.2)
    dt, err = timed(lambda: globals().__setitem__("c", new(timeout=5)))
    assert err is None, err
    c = globals()["c"]
    assert 0.2 <= dt < 2, dt
    assert c.timeout == 5.0 and isinstance(c.timeout, float)
    put("op_time", 0.001)
    a = Array([1, 2, 3])
    c.all_reduce(a)   # the first call connects (ncclInProgress, polled)
    c.all_reduce(a)
    c.wait()
    assert a.tolist() == [4, 8, 12], a.tolist()
    out = Array([0, 0, 0])
    c.all_reduce(a, out=out)
    c.barrier()
    assert out.tolist() == [8, 16, 24]
    assert get("event_records") >= 4
    assert get("last_error") == 0, "cudaErrorNotReady left as the last error"
    c.all_reduce(a, op=pyccl.premul_sum(2.0))  # op made and destroyed under the lock
    assert get("redops") == 0
    c.destroy()
    assert (get("finalizes"), get("destroys"), get("aborts")) == (1, 1, 0)
    assert get("events_live") == 0, get("events_live")
    assert c.destroyed and c.timeout == 5.0
    c.destroy()  # idempotent
    # wait() reads its timeout first, then must still refuse a destroyed communicator
    for args in ((), (1.0,)):
        _, err = timed(lambda: c.wait(*args))
        assert type(err) is RuntimeError and str(err) == \
            "wait: the communicator (rank 0 of 2) has been destroyed", repr(err)
    clean()
    return "ok"


def blocking_kind():
    """The handle's kind: blocking without a timeout, the user's choice with one (non-blocking
    by default).  A blocking one is made in one call (no polling: the stand-in's non-blocking
    init takes 0.2 s), watched all the same: a stuck collective times out and is aborted."""
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    assert c.blocking is True and c.timeout is None
    c.destroy()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=5.0)
    assert c.blocking is False
    c.destroy()
    t0 = time.monotonic()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=0.5, blocking=True)
    assert time.monotonic() - t0 < 0.15, time.monotonic() - t0
    assert c.blocking is True and c.timeout == 0.5
    a = Array([1.0, 2.0, 3.0])
    c.all_reduce(a)
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(a)
    dt, err = timed(c.wait)
    assert type(err) is pyccl.NcclTimeoutError and dt < 1.5, (dt, err)
    assert c.destroyed
    put("peer_dead", 0)
    c.destroy()
    assert get("aborts") == 1  # revoked at the timeout (kept for shrink()), aborted by destroy()
    clean()
    return "ok"


def init_timeout():
    put("init_hang", 1)
    uid = pyccl.unique_id()
    dt, err = timed(lambda: pyccl.Communicator(3, uid, 0, timeout=0.5))
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err) == ("Communicator: rank 0 of 3 timed out after 0.5 s waiting for its peers to "
                        "join (every rank must call it with the same unique_id and world_size); "
                        "the communicator was aborted"), str(err)
    assert err.timeout == 0.5 and err.code == 7
    assert isinstance(err, TimeoutError) and isinstance(err, pyccl.NcclError)
    assert 0.5 <= dt < 1.5, dt
    assert get("aborts") == 1
    clean()
    return dt


def collective_timeout():
    c = new(timeout=0.5)
    a = Array([1.0] * 4)
    for _ in range(3):
        c.all_reduce(a)
    c.wait()
    put("peer_dead", 1)
    t0 = time.monotonic()
    c.all_reduce(a)
    dt, err = timed(c.wait)
    since_call = time.monotonic() - t0
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err) == ("wait: all_reduce: rank 0 of 2 timed out after 0.5 s waiting for its peers; "
                        "the communicator was aborted"), str(err)
    assert dt < 0.5 + 0.5, dt
    assert since_call >= 0.5, f"gave up {since_call:.3f} s after the call, before its 0.5 s timeout"
    # its work stopped by a revoke: the handle is kept for shrink() until abort() or destroy()
    assert (get("revokes"), get("aborts"), get("events_live")) == (1, 0, 0)
    # the next call raises the same, and the communicator is unusable
    dt2, err = timed(lambda: c.all_reduce(a))
    assert type(err) is pyccl.NcclTimeoutError and str(err).startswith("all_reduce: rank 0 of 2 timed out"), err
    assert c.destroyed and "aborted" in repr(c) and c.handle == 0
    e = c.get_async_error()
    assert type(e) is pyccl.NcclTimeoutError and "timed out after 0.5 s" in str(e)
    c.abort()  # idempotent: already aborted
    c.destroy()
    assert get("destroys") == 0 and get("aborts") == 1
    # a fresh communicator works
    put("peer_dead", 0)
    c2 = pyccl.Communicator(1, pyccl.unique_id(), 0, timeout=0.5)
    x, y = Array([1, 2, 3]), Array([0, 0, 0])
    c2.all_reduce(x, out=y)
    c2.wait()
    assert y.tolist() == [1, 2, 3]
    c2.destroy()
    clean()
    return dt


def watchdog_alone():
    """No call after the stuck one: the watchdog aborts by itself."""
    c = new(timeout=0.3)
    c.all_reduce(Array([1.0]))
    c.wait()
    put("peer_dead", 1)
    t0 = time.monotonic()
    c.all_reduce(Array([1.0]))
    while get("revokes") == 0 and time.monotonic() - t0 < 1.0:
        time.sleep(0.002)
    fired = time.monotonic() - t0
    assert get("revokes") == 1, "the watchdog did not stop the work (revoke)"
    assert 0.3 <= fired < 1.0, f"the watchdog aborted {fired:.3f} s after the call; the timeout is 0.3 s"
    assert get("capture_mode_calls") >= 1, "watchdog thread not in relaxed capture mode"
    e = c.get_async_error()
    assert type(e) is pyccl.NcclTimeoutError, repr(e)
    assert str(e) == ("get_async_error: all_reduce: rank 0 of 2 timed out after 0.3 s waiting for "
                      "its peers; the communicator was aborted"), str(e)
    clean()
    return "ok"


def back_pressure():
    """A loop that never synchronizes stops enqueueing while the GPU is stuck."""
    c = new(timeout=0.5)
    a = Array([1.0])
    c.all_reduce(a)
    c.wait()
    put("peer_dead", 1)
    n = [0]

    def loop():
        while True:
            c.all_reduce(a)
            n[0] += 1
    dt, err = timed(loop)
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err).startswith("all_reduce: rank 0 of 2 timed out after 0.5 s"), str(err)
    assert n[0] <= pyccl._C._MAX_PENDING, n[0]
    assert dt < 1.5, dt
    clean()
    return n[0]


def queue_not_queried():
    """The calling thread records an event per call and queries none while fewer than
    _C._MAX_PENDING calls are unfinished (a query costs it more than the record): the watchdog
    drops the finished ones; at the bound the caller looks itself, and finds room."""
    c = new(timeout=30)
    a = Array([1.0])
    c.all_reduce(a)
    c.wait()
    put("op_time", 0.01)  # 1.28 s of work queued: none of it finishes during the loops
    records, mine = get("event_records"), get("my_queries")
    for _ in range(pyccl._C._MAX_PENDING // 2):
        c.all_reduce(a)
    assert get("event_records") - records == pyccl._C._MAX_PENDING // 2
    assert get("my_queries") == mine, get("my_queries") - mine
    put("op_time", 0.0)
    for _ in range(2 * pyccl._C._MAX_PENDING):  # past the bound: the caller queries
        c.all_reduce(a)
    assert get("my_queries") > mine
    c.wait()
    assert c.get_async_error() is None
    clean()
    return "ok"


def deadline_after_the_work_ahead():
    """Four calls of 0.25 s each, enqueued at once, on a communicator with a 0.4 s timeout: the
    last finishes 1 s after its enqueue, yet none timed out (each call's deadline counts from
    when the one ahead of it on its stream finished); a stuck one still times out."""
    c = new(timeout=0.4)
    a = Array([1.0])
    c.all_reduce(a)
    c.wait()
    put("op_time", 0.25)
    t0 = time.monotonic()
    for _ in range(4):
        c.all_reduce(a)
    c.wait()
    took = time.monotonic() - t0
    assert 0.9 <= took < 2.0, took
    assert c.get_async_error() is None
    assert a.tolist() == [float(2 ** 5)], a.tolist()
    put("op_time", 0.0)
    put("peer_dead", 1)
    c.all_reduce(a)
    dt, err = timed(c.wait)
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert 0.3 <= dt < 1.0, dt
    clean()
    return took


def async_error():
    c = new(timeout=30)
    c.all_reduce(Array([1.0]))
    c.wait()
    put("async_error", 6)
    t0 = time.monotonic()
    while get("aborts") == 0 and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    dt, err = timed(lambda: c.all_reduce(Array([1.0])))
    assert type(err) is pyccl.NcclError, repr(err)
    assert err.code == 6
    assert str(err) == ("all_reduce: watchdog: rank 0 of 2: NCCL error 6 (remote process exited or "
                        "there was a network error) while its work ran; the communicator was aborted"), str(err)
    clean()
    return "ok"


def connect_slow_and_hung():
    put("connect_delay", 0.3)
    c = new(timeout=2)
    dt, err = timed(lambda: c.all_reduce(Array([1.0])))
    assert err is None and dt >= 0.3, (err, dt)
    c.destroy()
    put("connect_hang", 1)
    c = new(timeout=0.4)
    dt, err = timed(lambda: c.all_reduce(Array([1.0])))
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err) == ("all_reduce: rank 0 of 2 timed out after 0.4 s waiting for its peers; the "
                        "communicator was aborted"), str(err)
    assert 0.4 <= dt < 1.2, dt
    clean()
    return dt


MIXED = ("all_reduce: one pyccl.group() cannot mix communicators "
         "with and without a timeout (NCCL's non-blocking and blocking kinds); this call was not "
         "enqueued")


def mixed_group():
    """A group mixing a communicator with a timeout and one without: pyccl refuses the call of
    the second kind at once (NCCL refuses such groups only where a connection or launch job is
    queued: on some ranks and not others), the first kind's work runs at the group's end, and
    the next group starts afresh."""
    for first in ("timed", "untimed"):
        comms = {"timed": new(timeout=5), "untimed": new(timeout=None)}
        other = "untimed" if first == "timed" else "timed"
        a, b = Array([1.0, 2.0]), Array([5.0, 7.0])
        err = None
        try:
            with pyccl.group():
                comms[first].all_reduce(a)
                comms[other].all_reduce(b)
        except pyccl.NcclError as e:
            err = e
        assert type(err) is pyccl.NcclError and str(err) == MIXED and err.code == 4, repr(err)
        comms[first].wait()
        assert a.tolist() == [2.0, 4.0] and b.tolist() == [5.0, 7.0], (a.tolist(), b.tolist())
        with pyccl.group():  # one kind per group again
            comms[other].all_reduce(b)
        comms[other].wait()
        assert b.tolist() == [10.0, 14.0], b.tolist()
        for c in comms.values():
            c.destroy()
    clean()
    return "ok"


def group_calls():
    c = new(timeout=1)
    a, b = Array([1.0, 2.0]), Array([0.0, 0.0])
    c.all_reduce(a)
    c.wait()
    before = get("event_records")
    with pyccl.group():
        c.send(a, 1)
        c.recv(b, 1)
        assert get("event_records") == before, "event recorded inside a group"
    assert get("event_records") == before + 1, get("event_records") - before
    c.wait()
    # destroy is refused inside an open group, abort too
    with pyccl.group():
        c.send(a, 1)
        for fn, name in ((c.destroy, "destroy"), (c.abort, "abort")):
            _, err = timed(fn)
            assert type(err) is RuntimeError and name in str(err) and "pyccl.group()" in str(err), err
    c.wait()
    # a group whose work never finishes
    put("peer_dead", 1)
    with pyccl.group():
        c.send(a, 1)
        c.recv(b, 1)
    dt, err = timed(c.wait)
    assert type(err) is pyccl.NcclTimeoutError and "send: rank 0 of 2 timed out" in str(err), repr(err)
    # connection that hangs inside a group: the group's end raises
    put("peer_dead", 0)
    put("connect_hang", 1)
    c = new(timeout=0.4)
    def grp():
        with pyccl.group():
            c.all_reduce(a)
    dt, err = timed(grp)
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err).startswith("all_reduce: rank 0 of 2 timed out after 0.4 s"), str(err)
    assert dt < 1.2
    clean()
    return "ok"


def wait_limit_not_aborted():
    put("op_time", 1.0)
    c = new(timeout=5)
    c.all_reduce(Array([1.0]))
    dt, err = timed(lambda: c.wait(timeout=0.1))
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err) == ("wait: rank 0 of 2: the work enqueued on the communicator (the oldest "
                        "unfinished: all_reduce) did not finish within 0.1 s; the communicator's "
                        "own timeout of 5.0 s has not passed, so it was not aborted"), str(err)
    assert err.timeout == 0.1
    assert get("aborts") == 0 and not c.destroyed
    c.wait()   # now it finishes
    for bad, exc, text in ((0, ValueError, "wait: timeout must be a finite number of seconds > 0, got 0"),
                           ("1", TypeError, "wait: timeout must be a number of seconds (int or float), a datetime.timedelta or None, got str")):
        _, err = timed(lambda: c.wait(bad))
        assert type(err) is exc and str(err) == text, err
    _, err = timed(lambda: c.wait(timeout=1, x=2))
    assert type(err) is TypeError, err
    c.destroy()
    clean()
    return dt


def destroy_stuck():
    c = new(timeout=0.4)
    c.all_reduce(Array([1.0]))
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(Array([1.0]))
    dt, err = timed(c.destroy)
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err).startswith("destroy: all_reduce: rank 0 of 2 timed out after 0.4 s"), str(err)
    assert dt < 1.0 and get("aborts") == 1 and get("destroys") == 0
    assert c.destroyed
    _, err = timed(lambda: c.all_reduce(Array([1.0])))
    assert type(err) is RuntimeError and "has been destroyed" in str(err), err
    clean()
    return dt


def split_child():
    put("split_delay", 0.1)
    c = new(timeout=1.5)
    sub = c.split(0)
    assert sub.timeout == 1.5 and (sub.rank, sub.size) == (0, 2)
    sub.all_reduce(Array([1.0]))
    sub.wait()
    assert c.split(-1) is None
    sub.destroy()
    put("split_hang", 1)
    dt, err = timed(lambda: c.split(0))
    assert type(err) is pyccl.NcclTimeoutError and str(err).startswith("split: rank 0 of 2 timed out after 1.5 s"), err
    assert c.destroyed
    clean()
    return dt


def graph_capture():
    c = new(timeout=5)
    a = Array([1.0])
    c.all_reduce(a)
    c.wait()
    put("op_time", 0.2)
    for _ in range(12):      # unfinished: the next enqueue looks at them
        c.all_reduce(a)
    put("capturing", 1)
    before = get("event_records")
    c.all_reduce(a)
    assert get("event_records") == before, "event recorded into a capturing stream"
    time.sleep(0.1)          # the watchdog looks meanwhile
    assert get("capture_violations") == 0, "an event query would invalidate the capture"
    put("capturing", 0)
    c.wait()
    clean()
    return "ok"


def stream(handle):
    """A torch.cuda.Stream as pyccl reads one (device_index, cuda_stream)."""
    import torch
    s = torch.cuda.Stream.__new__(torch.cuda.Stream)
    s.device_index, s.cuda_stream = 0, handle
    return s


def untimed():
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    assert c.timeout is None
    a = Array([1.0])
    put("op_time", 0.3)
    c.all_reduce(a)
    c.all_reduce(a, stream=stream(0x5555))
    c.all_reduce(a, stream=stream(0x5555))
    assert get("event_records") == 0 and get("capture_mode_calls") == 0, "untimed work was tracked"
    assert threading.active_count() == 1, "a watchdog thread without any timeout"
    assert c.get_async_error() is None
    # wait(): as long as it takes, on every stream it used (0.6 s on the side one)
    dt, err = timed(c.wait)
    assert err is None and 0.55 <= dt < 1.5, (err, dt)
    assert get("event_records") == 2 and get("events_live") == 0
    put("op_time", 0)
    put("peer_dead", 1)
    c.all_reduce(a)
    dt, err = timed(lambda: c.wait(timeout=0.3))
    assert type(err) is pyccl.NcclTimeoutError and str(err) == (
        "wait: rank 0 of 2: the work enqueued on the communicator did not finish within 0.3 s; it has "
        "no timeout of its own, so it was not aborted"), err
    assert 0.3 <= dt < 1.0 and get("aborts") == 0 and not c.destroyed
    # abort() from another thread is how such a wait ends early: the work did not finish,
    # and the wait says why, as a communicator with a timeout's does; also when NCCL's abort
    # returns long after the work it ended (its teardown), as it does on a GPU
    put("abort_delay", 0.2)
    t_abort = time.monotonic()  # dt from the timer's start (timed() starts later)
    threading.Timer(0.3, c.abort).start()
    dt, err = timed(c.wait)
    dt = time.monotonic() - t_abort
    assert type(err) is RuntimeError and str(err) == \
        "wait: the communicator (rank 0 of 2) has been aborted", (err, dt)
    assert 0.5 <= dt < 1.2, dt
    put("abort_delay", 0)
    assert get("aborts") == 1 and c.destroyed
    _, err = timed(lambda: c.all_reduce(a))
    assert type(err) is RuntimeError and str(err) == \
        "all_reduce: the communicator (rank 0 of 2) has been aborted", err
    c.destroy()
    put("peer_dead", 0)
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    put("async_error", 6)
    e = c.get_async_error()
    assert type(e) is pyccl.NcclError and e.code == 6 and str(e) == (
        "get_async_error: rank 0 of 2: NCCL reports error 6 (remote process exited or there was "
        "a network error)"), e
    put("async_error", 0)
    c.abort()
    assert c.destroyed and get("aborts") == 2
    c.abort()
    _, err = timed(lambda: c.all_reduce(a))
    assert type(err) is RuntimeError and str(err) == \
        "all_reduce: the communicator (rank 0 of 2) has been aborted", err
    _, err = timed(c.get_async_error)
    assert type(err) is RuntimeError and "has been aborted" in str(err), err
    c.destroy()
    assert get("destroys") == 0
    # a barrier() waiting on a dead peer, ended by abort() from another thread: it raises
    # (before, abort() was refused while the barrier was in flight)
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    put("peer_dead", 1)
    put("abort_delay", 0.2)
    t_abort = time.monotonic()
    threading.Timer(0.3, c.abort).start()
    _, err = timed(c.barrier)
    dt = time.monotonic() - t_abort
    assert type(err) is RuntimeError and str(err) == \
        "barrier: the communicator (rank 0 of 2) has been aborted", (err, dt)
    assert 0.5 <= dt < 1.2 and get("aborts") == 3, (dt, get("aborts"))
    put("peer_dead", 0)
    put("abort_delay", 0)
    c.destroy()
    clean()
    return "ok"


def abort_from_thread():
    """abort() while another thread waits: that thread raises at once."""
    c = new(timeout=30)
    c.all_reduce(Array([1.0]))
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(Array([1.0]))
    t_abort = time.monotonic()  # dt from the timer's start (timed() starts later)
    threading.Timer(0.3, c.abort).start()
    dt, err = timed(c.wait)
    dt = time.monotonic() - t_abort
    assert type(err) is RuntimeError and str(err) == \
        "wait: the communicator (rank 0 of 2) has been aborted", repr(err)
    assert 0.3 <= dt < 1.0, dt
    clean()
    return dt


def drop_in():
    c = new(timeout=0.4)
    a = Tensor([1.0, 2.0])
    before = get("event_records")
    pyccl.nccl.all_reduce([a], comms=[c])
    assert get("event_records") == before + 1
    c.wait()
    assert a.tolist() == [2.0, 4.0]
    put("peer_dead", 1)
    pyccl.nccl.all_reduce([a], comms=[c])
    time.sleep(0.8)
    _, err = timed(lambda: pyccl.nccl.all_reduce([a], comms=[c]))
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    clean()
    return "ok"


def two_comms_one_call():
    """One drop-in call over two watched communicators (one NCCL group)."""
    c0 = pyccl.Communicator(2, pyccl.unique_id(), 0, device=0, timeout=0.5)
    c1 = pyccl.Communicator(2, pyccl.unique_id(), 0, device=1, timeout=0.5)
    t0, t1 = Tensor([1.0, 2.0], 0), Tensor([3.0, 4.0], 1)
    before = get("event_records")
    pyccl.nccl.all_reduce([t0, t1], comms=[c0, c1])
    assert get("event_records") == before + 2
    c0.wait()
    c1.wait()
    assert t0.tolist() == [2.0, 4.0] and t1.tolist() == [6.0, 8.0]
    # a group whose connection hangs: both fail, whichever was polled
    c2 = pyccl.Communicator(2, pyccl.unique_id(), 0, device=0, timeout=0.5)
    c3 = pyccl.Communicator(2, pyccl.unique_id(), 0, device=1, timeout=0.5)
    put("connect_hang", 1)
    dt, err = timed(lambda: pyccl.nccl.all_reduce([t0, t1], comms=[c2, c3]))
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert dt < 1.5 and c2.destroyed and c3.destroyed, (dt, c2, c3)
    assert not c0.destroyed and not c1.destroyed
    for c in (c0, c1, c2, c3):
        c.destroy()
    clean()
    return "ok"


def threads_share_comm():
    """Several threads enqueue on one timed communicator: no overlap in NCCL, and every
    call of every thread reaches it."""
    put("op_time", 0.0002)
    c = new(timeout=5)
    a = Array([1.0] * 8)
    errs = []
    before = get("ops")

    def work():
        try:
            for _ in range(200):
                c.all_reduce(a)
            c.wait()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errs, errs
    assert get("ops") - before == 4 * 200, get("ops") - before
    c.destroy()
    clean()
    return get("ops")


def threads_share_untimed():
    """Threads on communicators without a timeout (NCCL's blocking kind):
    every NCCL call on one communicator is still made by one thread at a
    time (the fake counts overlapping entries per communicator)."""
    put("op_time", 0.0001)
    c0 = pyccl.Communicator(2, pyccl.unique_id(), 0, device=0)
    c1 = pyccl.Communicator(2, pyccl.unique_id(), 0, device=1)
    assert c0.timeout is None and c1.timeout is None
    errs = []

    def work(k):
        try:
            a, b = Array([1.0] * 8), Tensor([1.0] * 8, 0)
            t0, t1 = Tensor([1.0, 2.0], 0), Tensor([3.0, 4.0], 1)
            for i in range(150):
                c0.all_reduce(a, algo="nccl")
                if i % 10 == k:
                    c0.barrier()
                    c0.all_reduce(a, op=pyccl.premul_sum(0.5))
                pyccl.nccl.all_reduce([b], comms=[c0])
                # one NCCL group over both: the locks in one order everywhere
                if k % 2:
                    pyccl.nccl.all_reduce([t1, t0], comms=[c1, c0])
                else:
                    pyccl.nccl.all_reduce([t0, t1], comms=[c0, c1])
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    assert get("ops") >= 4 * 150 * 3, get("ops")
    c0.destroy()
    c1.destroy()
    clean()
    return get("concurrent")


def launch_queue_full():
    """The launch itself blocks behind a stuck kernel while holding the
    communicator's lock: the watchdog gives up on it after timeout + 1 s."""
    c = new(timeout=0.5)
    a = Array([1.0])
    c.all_reduce(a)
    c.wait()
    put("launch_block", 1)
    put("peer_dead", 1)
    c.all_reduce(a)          # stuck on the GPU
    dt, err = timed(lambda: c.all_reduce(a))   # stuck in the launch
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert str(err) == ("all_reduce: rank 0 of 2 timed out after 0.5 s waiting for its peers (the call "
                        "itself was stuck in NCCL or CUDA, e.g. behind a full launch queue); the "
                        "communicator was aborted"), str(err)
    assert 1.4 < dt < 2.5, dt
    assert get("aborts") == 1 and get("misuse") == 0
    assert get("concurrent") == 1   # that abort, while the launch was inside NCCL
    put("concurrent", 0)
    assert c.destroyed
    c.destroy()
    clean()
    return dt


def second_device_only():
    """A rank on cuda:1 that never touches cuda:0: nor does the watchdog."""
    fake.fake_device_used.restype = ctypes.c_int
    fake.cudaSetDevice(1)   # torch.cuda.set_device(1), as a rank on cuda:1 does
    c = pyccl.Communicator(2, pyccl.unique_id(), 1, timeout=0.3)
    assert c.device == 1
    a = Array([1.0, 2.0])
    c.all_reduce(a)
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(a)
    time.sleep(0.8)
    assert get("revokes") == 1
    assert fake.fake_device_used(1) == 1
    assert fake.fake_device_used(0) == 0, "a context was made on cuda:0"
    clean()
    return "ok"


def sigint_in_wait():
    c = new(timeout=60)
    c.all_reduce(Array([1.0]))
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(Array([1.0]))
    print("WAITING", flush=True)
    c.wait()   # the parent sends SIGINT
    return "not interrupted"


def sigint_in_barrier():
    """barrier() on a communicator without a timeout, its peer gone: Ctrl-C ends it."""
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    c.barrier()
    put("peer_dead", 1)
    print("WAITING", flush=True)
    c.barrier()   # the parent sends SIGINT
    return "not interrupted"


def fork_beside_a_call():
    """fork() while another thread of this process is inside calls on a communicator (timeout
    and blocking as given): the child's copy raises at once, whatever locks the parent's
    thread held; destroy() and abort() there forget it (no NCCL call, nothing waited for);
    the child ends within its bound; the parent's communicator works on."""
    p = _params()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"],
                           blocking=p.get("blocking"))
    a = Array([1.0, 2.0])
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            c.all_reduce(a, op=pyccl.premul_sum(1.0))  # several NCCL calls under the lock

    t = threading.Thread(target=busy)
    t.start()
    outcomes = []
    for k in range(p["tries"]):
        time.sleep(0.001)
        pid = os.fork()
        if pid == 0:  # the child: one thread, a copy of everything
            code = 0
            try:
                try:
                    c.all_reduce(a)
                    code = 10
                except RuntimeError as e:
                    want = (f"all_reduce: the communicator (rank 0 of 2) was made by process "
                            f"{os.getppid()}; this process ({os.getpid()}) is a child made by "
                            "fork(), where it cannot be used (NCCL's state does not survive a "
                            "fork): drop it, and make a new one here")
                    code = 0 if str(e) == want else 11
                if code == 0 and (c.abort() is not None or c.destroy() is not None or not c.destroyed):
                    code = 12
            finally:
                os._exit(code)
        deadline = time.monotonic() + 10
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError(f"try {k}: the child hung")
            time.sleep(0.005)
        outcomes.append(os.waitstatus_to_exitcode(status))
    stop.set()
    t.join(LIFE_JOIN)
    assert outcomes == [0] * p["tries"], outcomes
    c.all_reduce(a)
    c.wait() if p["timeout"] else None
    c.destroy()
    clean()
    return {"tries": p["tries"]}


def exit_with_stuck_work():
    c = new(timeout=60)
    c.all_reduce(Array([1.0]))
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(Array([1.0]))
    globals()["keep"] = c   # alive at exit
    return "exiting"


def _own_kernels_unavailable(key, value, reason, device=None):
    """One of two ranks, each a process (FAKE_RANK), of a library built with
    FAKE_PEER_MEMORY: the own kernels' set-up finds them unusable, every rank
    says why once and all_reduce is NCCL's.  device: both ranks' (default: the rank)."""
    rank = int(os.environ["FAKE_RANK"])
    device = rank if device is None else device
    put(key, value)
    assert fake.cudaSetDevice(device) == 0  # where Array memory lives (cudaPointerGetAttributes)
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=device)
    assert c.all_reduce_info["state"] == "not set up", c.all_reduce_info
    a = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
    for _ in range(3):
        c.all_reduce(a)   # the first sets up, finds the kernels unusable, and uses NCCL
    info = c.all_reduce_info
    assert info["state"] == "off", info
    assert info["reason"] == reason(rank), info["reason"]
    c.destroy()
    clean()
    return {"values": a.tolist(), "reason": info["reason"]}


def no_kernel_image():
    return _own_kernels_unavailable(
        "module_error", 209,  # CUDA_ERROR_NO_BINARY_FOR_GPU
        lambda r: f"loading the kernels on cuda:{r} failed: no kernel image is available for "
                  "execution on the device (no code for this GPU?)")


def no_peer_access():
    return _own_kernels_unavailable(
        "no_p2p", 1, lambda r: f"cuda:{r} has no peer access to cuda:{1 - r} (rank {1 - r})")


def shared_gpu_refused():
    """Both ranks on cuda:0 without PYCCL_AR_SHARED_GPU: NCCL, and the reason names the setting."""
    return _own_kernels_unavailable(
        "no_p2p", 0, lambda r: f"ranks {r} and {1 - r} share GPU 00000000:10:00.0 "
        "(PYCCL_AR_SHARED_GPU=1 lets the own kernels run there, correct but slow: the GPU "
        "time-slices the ranks)", device=0)


def launch_floor():
    """pyccl._C._ar_launch_floor on the stand-in driver: `calls` launches of the empty kernel
    (the stand-in counts them), microseconds per launch as a float; each bad argument named."""
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    before = get("launches")
    us = pyccl._C._ar_launch_floor(rank, 0, 300, False)
    launched = get("launches") - before
    errors = []
    for args in ((rank, 0, 0, False), (rank, "s", 1, False), (rank, 0, "n", False), (-1, 0, 1, False),
                 (rank, 0, 1, True), (rank, 0, 1)):
        try:
            pyccl._C._ar_launch_floor(*args)
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return {"rank": rank, "us": us, "launches": launched, "errors": errors,
            "after": pyccl._C._ar_launch_floor(rank, 0, 5, False) > 0}


def watch_costs():
    """pyccl._C._watch_costs on the stand-in: each of what a timed call adds, `calls` times
    in C (the stand-in counts the event records and queries); refused on a captured stream,
    nothing recorded; each bad argument named."""
    before = {k: get(k) for k in ("event_records", "event_queries", "stream_syncs", "events_live")}
    costs = pyccl._C._watch_costs(1, 0x5555, 300)
    after = {k: get(k) - before[k] for k in before}
    put("capturing", 1)
    records = get("event_records")
    errors = []
    for args in ((0, 0, 10), (0, 0, 0), (0, "s", 1), (0, 0, "n"), (2, 0, 1), (0, 0)):
        try:
            pyccl._C._watch_costs(*args)
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    put("capturing", 0)
    clean()
    return {"names": list(costs), "positive": all(type(v) is float and v > 0 for v in costs.values()),
            "counted": after, "recorded_while_captured": get("event_records") - records,
            "errors": errors}


def shared_gpu_ready():
    """Both ranks on cuda:0 with PYCCL_AR_SHARED_GPU=1 (and no peer access between devices,
    which a peer on the same device does not need): the own kernels are set up and exact."""
    rank = int(os.environ["FAKE_RANK"])
    put("no_p2p", 1)
    assert fake.cudaSetDevice(0) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=0)
    a = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
    c.all_reduce(a)
    info = c.all_reduce_info
    assert info["state"] == "ready", info
    c.destroy()
    clean()
    return {"values": a.tolist(), "ipc_live": get("ipc_live")}


def coalesced_packs():
    """all_reduce_coalesced of 170 tensors of 1 to 7 float32 elements, integer values that
    differ per rank, tensor and element: with the own kernels loadable, the pack and unpack are
    the copy kernel's (160 tensors a launch: two launches each way), the sum exact in every
    element of every tensor; with no kernel image for the GPU, torch's pack is asked for all
    170 at once (the stub runs no kernels, so it raises)."""
    from _hostile import T
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
    sizes = [1 + i % 7 for i in range(170)]

    def value(r, i, j):
        return float(1000 * i + 10 * j + r + 1)
    ts = [T(n, rank) for n in sizes]
    for i, t in enumerate(ts):
        for j in range(sizes[i]):
            t.buf[j] = value(rank, i, j)
    before = get("copy_launches")
    # the calling thread's current device is the other one: the module must still be loaded
    # with the communicator's device current (into its context)
    assert fake.cudaSetDevice(1 - rank) == 0
    c.all_reduce_coalesced(ts)
    launches = get("copy_launches") - before
    module_device = get("module_device")
    assert fake.cudaSetDevice(rank) == 0
    wrong = [(i, j) for i, t in enumerate(ts) for j in range(sizes[i])
             if t.buf[j] != value(0, i, j) + value(1, i, j)]
    info = c.all_reduce_info
    c.destroy()
    put("module_error", 209)  # CUDA_ERROR_NO_BINARY_FOR_GPU: the kernels cannot load anywhere now
    fallback = None
    try:
        # the other device: the kernels were never loaded on it in this process
        c2 = pyccl.Communicator(2, pyccl.unique_id(), rank, device=1 - rank)
        loads = get("module_loads")
        for _ in range(2):
            try:
                c2.all_reduce_coalesced([T(n, 1 - rank) for n in sizes])
            except RuntimeError as e:
                fallback = str(e)
        loads = get("module_loads") - loads
        c2.destroy()
    finally:
        put("module_error", 0)
    clean()
    return {"copy_launches": launches, "wrong": wrong[:5], "state": info["state"], "fallback": fallback,
            "module_device": module_device, "failed_loads": loads}


def own_chunked():
    """With PYCCL_AR_BUFFER_MB=1, all_reduce of 3 MiB + 20 B of float32 (values that differ per
    rank and element, so a chunk at the wrong place shows): algo='oneshot' and 'twoshot' (in and
    out of place) run as four kernels of at most the buffer each, and sum every element; auto
    takes NCCL above its thresholds, and the chunked one-shot where PYCCL_AR_ONESHOT_MAX reaches
    above the buffer."""
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    n = (3 << 18) + 5

    def fill(r):
        return Array(range(r * 3 + 1, r * 3 + 1 + n))  # element j: j + 3r + 1

    def wrong(a, want=lambda j: 2 * j + 5):
        return [j for j, v in enumerate(a.buf) if v != want(j)][:5]
    out = {}

    def run(c, name, **kw):
        a = fill(rank)
        o = fill(rank) if kw.pop("out", False) else None
        k0, x0 = get("ar_kernels"), get("ar_oversize")
        if o is None:
            c.all_reduce(a, **kw)
        else:
            o.buf[:3] = [-1.0] * 3
            c.all_reduce(a, out=o, **kw)
            out[name + " input kept"] = wrong(a, lambda j: j + rank * 3 + 1) == []
        out[name] = [get("ar_kernels") - k0, get("ar_oversize") - x0, wrong(a if o is None else o)]
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
    run(c, "oneshot", algo="oneshot")
    run(c, "twoshot", algo="twoshot")
    run(c, "twoshot out", algo="twoshot", out=True)
    run(c, "auto", algo="auto")
    c.destroy()
    os.environ["PYCCL_AR_ONESHOT_MAX"] = str(4 << 20)
    try:
        c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
        out["oneshot_max"] = c.all_reduce_info["oneshot_max"]
        run(c, "auto, oneshot_max 4 MiB")
        c.destroy()
    finally:
        del os.environ["PYCCL_AR_ONESHOT_MAX"]
    clean()
    return out


def own_gather_scatter():
    """With PYCCL_AR_BUFFER_MB=1, all_gather and reduce_scatter with algo='oneshot' on the own
    kernels: parts of 16-byte multiples and not (the stand-in refuses a unit that does not fit),
    and parts larger than a launch stages (chunks); values that differ per rank and element, so
    a part at the wrong place shows.  auto stays NCCL's.  Then the argument errors, each followed
    by a working call."""
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
    out = {}

    def val(r, j):
        return float(j % 100003 + 7 * r + 1)

    def gather(name, n, **kw):
        a = Array([val(rank, j) for j in range(n)])
        o = Array([-1.0] * (2 * n))
        k0, x0 = get("ag_kernels"), get("ar_oversize")
        c.all_gather(a, o, **kw)
        bad = [j for j in range(2 * n) if o.buf[j] != val(j // n, j % n)][:5]
        out[name] = [get("ag_kernels") - k0, get("ar_oversize") - x0, bad]

    def scatter(name, n, **kw):
        a = Array([val(rank, j) for j in range(2 * n)])
        o = Array([-1.0] * n)
        k0, x0 = get("rs_kernels"), get("ar_oversize")
        c.reduce_scatter(a, o, **kw)
        want = [val(0, rank * n + j) + val(1, rank * n + j) for j in range(n)]
        bad = [j for j in range(n) if o.buf[j] != want[j]][:5] if kw else None
        out[name] = [get("rs_kernels") - k0, get("ar_oversize") - x0, bad]
    gather("ag 1024", 1024, algo="oneshot")
    gather("ag 1001", 1001, algo="oneshot")
    gather("ag chunked", (1 << 18) + 5, algo="oneshot")
    gather("ag auto", 1024)
    scatter("rs 1024", 1024, algo="oneshot")
    scatter("rs 1001", 1001, algo="oneshot")
    scatter("rs chunked", (1 << 17) + 3, algo="oneshot")
    scatter("rs auto", 1024)
    a, o = Array([1.0, 2.0]), Array([0.0] * 4)
    errors = []
    for call in (lambda: c.all_gather(a, o, algo="twoshot"),
                 lambda: c.all_gather(a, o, algo=1),
                 lambda: c.all_gather(a, [Array([0.0, 0.0]), Array([0.0, 0.0])], algo="oneshot"),
                 lambda: c.reduce_scatter(o, a, algo="twoshot"),
                 lambda: c.reduce_scatter([Array([0.0, 0.0]), Array([0.0, 0.0])], a, algo="oneshot"),
                 lambda: c.reduce_scatter(o, a, pyccl.premul_sum(2.0), algo="oneshot")):
        try:
            call()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the message is the result
            errors.append(f"{type(e).__name__}: {e}")
        gather("after", 4, algo="oneshot")
        errors.append(out["after"][2] == [])
    with pyccl.group():
        try:
            c.all_gather(a, o, algo="oneshot")
            errors.append("no error")
        except RuntimeError as e:
            errors.append(f"RuntimeError: {e}")
    out["errors"] = errors
    c.destroy()
    clean()
    return out


def _own_kernels_ready(timeout=None):
    """One of two ranks (FAKE_RANK) of a library built with FAKE_PEER_MEMORY: a
    communicator whose first all_reduce sets the own kernels up (regions shared
    between the processes, the probe) and runs the stand-in's all-reduce kernel."""
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank, timeout=timeout)
    a = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
    launches = get("launches")
    c.all_reduce(a)
    info = c.all_reduce_info
    assert info["state"] == "ready", info
    assert get("launches") == launches + 3, "two probe stages and one all-reduce kernel"
    assert a.tolist() == [3.0, 4.0, 9.0], a.tolist()
    return c


def own_kernels_lifecycle():
    """Ten communicators, every other one with a timeout, set the own kernels
    up and are destroyed (every rank together): each gives back its device
    memory, its peer mapping and its host word."""
    base = get("mem_live")
    seen = []
    for i in range(10):
        c = _own_kernels_ready(timeout=5.0 if i % 2 else None)
        region = get("mem_live") - base
        assert region >= 2 << 20, region  # two 1 MiB halves (PYCCL_AR_BUFFER_MB=1) and more
        assert (get("ipc_live"), get("host_live")) == (1, 1)
        c.destroy()
        seen.append([i, get("mem_live") - base, get("ipc_live"), get("host_live")])
    clean()
    return {"after_destroy": seen}


def _wait_file(name, limit=30.0):
    path = os.path.join(os.environ["FAKE_XPROC_DIR"], name)
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert time.monotonic() - t0 < limit, f"{name} did not come"
        time.sleep(0.01)


def _touch(name):
    open(os.path.join(os.environ["FAKE_XPROC_DIR"], name), "w").close()


def _parked():
    """The parked regions left after a release: a one-rank communicator's
    destroy drains them (every release does)."""
    probe = pyccl.Communicator(1, pyccl.unique_id(), 0)
    probe.destroy()
    return probe.all_reduce_info["parked"]


def own_kernels_abort():
    """abort() after the own kernels ran: the peer mapping and the host word
    go at once, the communicator refuses use, and the exported region comes
    back once the peer closed its mapping too (the release handshake).  Then:
    rank 0 aborts while rank 1 still maps its region (parked until rank 1
    releases), and rank 1's process exits without releasing (a peer that is
    gone counts as closed)."""
    rank = int(os.environ["FAKE_RANK"])
    base = get("mem_live")
    c = _own_kernels_ready()
    region = get("mem_live") - base
    c.abort()
    got = {"ipc_live": get("ipc_live"), "host_live": get("host_live"), "region": region}
    try:
        c.all_reduce(Array([1.0]))
        raise AssertionError("all_reduce after abort() did not raise")
    except RuntimeError as e:
        got["after"] = str(e)
    c.destroy()
    # collective: both ranks are past their abort, so the peer closed its mapping;
    # this set-up frees the parked region first
    c2 = _own_kernels_ready()
    got["after_next_setup"] = get("mem_live") - base
    if rank == 0:
        c2.abort()
        got["parked_while_peer_maps"] = [_parked(), get("mem_live") - base]
        _touch("release")
        _wait_file("released")
        got["parked_after_peer_released"] = [_parked(), get("mem_live") - base]
    else:
        _wait_file("release")
        # (the stand-in pairs communicators by how many each process made: as many as rank 0)
        got["parked_before_release"] = [_parked(), get("mem_live") - base]
        c2.abort()
        _touch("released")
        got["parked_after_release"] = [_parked(), get("mem_live") - base]
    # a peer that exits without releasing
    c3 = _own_kernels_ready()
    if rank == 1:
        with open(os.path.join(os.environ["FAKE_XPROC_DIR"], "pid1.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(os.environ["FAKE_XPROC_DIR"], "pid1.tmp"),
                  os.path.join(os.environ["FAKE_XPROC_DIR"], "pid1"))
        sys.stdout.write("RESULT " + json.dumps(got) + "\n")
        sys.stdout.flush()
        os._exit(0)  # its mapping of rank 0's region goes with the process
    _wait_file("pid1")
    with open(os.path.join(os.environ["FAKE_XPROC_DIR"], "pid1")) as f:
        pid1 = int(f.read())
    t0 = time.monotonic()
    while not _gone(pid1):
        assert time.monotonic() - t0 < 30, "rank 1 did not exit"
        time.sleep(0.01)
    c3.abort()
    got["parked_after_peer_exited"] = [_parked(), get("mem_live") - base]
    clean()
    return got


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def own_kernels_setup_two_threads():
    """Two threads make the first all_reduce of one communicator at once: one
    sets the own kernels up, the other waits for it and then uses them (two
    set-ups would run two exchanges on one communicator at once)."""
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
    arrays = [Array([1.0 + rank, 2.0, 3.0 * (rank + 1)]) for _ in range(2)]
    errors = []

    def run(a):
        try:
            assert fake.cudaSetDevice(rank) == 0  # the stand-in's current device is per thread
            c.all_reduce(a)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(a,)) for a in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert c.all_reduce_info["state"] == "ready", c.all_reduce_info
    values = [a.tolist() for a in arrays]
    c.destroy()
    clean()
    return {"values": values, "ipc_live": get("ipc_live"), "launches": get("launches")}


# ---- own kernels: lifecycle under failure
# One of two ranks each (FAKE_RANK), on the library built with FAKE_PEER_MEMORY;
# tests/test_own_lifecycle_cpu.py runs them and FAKE_CASE picks the variant.  Each
# returns what it measured and the test judges it; a hang ends the process after
# _bounded()'s seconds with every thread's traceback on stderr.

def _bounded(seconds):
    """Exit 1 with every thread's traceback after `seconds` (a hang, interpreter exit
    included), well before the test's own limit kills the process without one."""
    import faulthandler
    faulthandler.dump_traceback_later(seconds, exit=True)


def _step(text):
    """Progress on stdout: the test shows the last steps of a process that hung."""
    print("STEP " + text, flush=True)


def _outcome(err):
    return None if err is None else [type(err).__name__, str(err)]


def _rank_stream(handle):
    """A torch.cuda.Stream of this rank's device (cuda:rank)."""
    s = stream(handle)
    s.device_index = int(os.environ["FAKE_RANK"])
    return s


def own_setup_behind_stuck_stream():
    """The peer dies before the first all_reduce that would set the own kernels up, on a
    communicator with timeout=2: its NCCL work sticks on the stream and the next launch
    blocks behind it (a full launch queue).  FAKE_CASE:
    'nccl', 'auto': the next all_reduce with that algo ('auto' sets the own kernels up
      first, whose NCCL calls must be watched as any call's);
    'abort': abort() from another thread 0.5 s into that set-up;
    'destroy': the own kernels were set up before the peer died, and the stuck work is on
      the legacy stream, which destroy()'s release barrier uses;
    'untimed': a communicator without timeout (PYCCL_AR_TIMEOUT bounds the set-up), no
      launch blocking: 'auto' sets up behind the stuck work until that bound, then the next
      call raises the same failure."""
    _bounded(20)
    case = os.environ["FAKE_CASE"]
    rank = int(os.environ["FAKE_RANK"])
    if case == "destroy":
        c = _own_kernels_ready(timeout=2.0)
    else:
        assert fake.cudaSetDevice(rank) == 0
        c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank,
                               timeout=None if case == "untimed" else 2.0)
    put("peer_dead", 1)
    c.all_reduce(Array([1.0]), algo="nccl", stream=_rank_stream(0) if case == "destroy" else None)
    if case != "untimed":
        put("launch_block", 1)
    _step(f"stuck work enqueued; own kernels {c.all_reduce_info['state']}")
    out = {}
    if case in ("nccl", "auto", "untimed"):
        dt, err = timed(lambda: c.all_reduce(Array([1.0, 2.0]), algo=None if case != "nccl" else "nccl"))
        if case == "untimed":
            out["next"] = _outcome(timed(lambda: c.all_reduce(Array([1.0]), algo="nccl"))[1])
            out["state"] = c.all_reduce_info["state"]
    elif case == "abort":
        def abort_later():
            time.sleep(0.5)
            _step("abort()")
            out["abort"] = list(timed(c.abort))
            _step("abort() returned")
        th = threading.Thread(target=abort_later, daemon=True)
        th.start()
        dt, err = timed(lambda: c.all_reduce(Array([1.0, 2.0])))
        th.join(20)
        out["abort"] = [out["abort"][0], _outcome(out["abort"][1])]
    else:
        _step("destroy()")
        dt, err = timed(c.destroy)
    _step("returned")
    out.update(dt=dt, err=_outcome(err), misuse=get("misuse"))
    return out


def own_abort_refused_in_group():
    """abort() inside an open pyccl.group() in which the communicator was used is refused
    (FAKE_CASE 'timed': timeout=5, 'untimed': none); the communicator stays alive, and
    after the group its next all_reduce runs the own kernels, exactly."""
    _bounded(30)
    rank = int(os.environ["FAKE_RANK"])
    c = _own_kernels_ready(timeout=5.0 if os.environ["FAKE_CASE"] == "timed" else None)
    refused = group_end = "not reached"
    try:
        inside = Array([5.0, 7.0])  # kept: NCCL reads it at the group's end
        with pyccl.group():
            c.all_reduce(inside)   # NCCL's inside a group
            _, err = timed(c.abort)
            refused = _outcome(err)
        group_end = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        group_end = _outcome(e)
    _step("group ended")
    a = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
    launches = get("launches")
    _, err = timed(lambda: c.all_reduce(a))
    out = {"refused": refused, "group_end": group_end, "after": _outcome(err), "values": a.tolist(),
           "state": c.all_reduce_info["state"], "launches": get("launches") - launches}
    if not c.destroyed:
        c.destroy()
    out["misuse"] = get("misuse")
    return out


def own_kernel_stuck_untimed():
    """A communicator without a timeout whose own kernel waits for a peer that died with
    the call in flight.  FAKE_CASE 'abort_during_destroy': destroy() (which waits for the
    kernel), and abort() from another thread 1 s later; 'abort_then_destroy': abort(),
    then destroy().  The process must then exit (rc 0)."""
    _bounded(25)
    case = os.environ["FAKE_CASE"]
    c = _own_kernels_ready(timeout=None)
    put("peer_dead", 1)
    c.all_reduce(Array([1.0, 2.0]))   # the own kernel: it waits for the dead peer
    assert get("ar_stuck") == 1, "the own kernel was not launched"
    out = {}
    if case == "abort_then_destroy":
        dt, err = timed(c.abort)
        out["abort"] = [dt, _outcome(err)]
        dt, err = timed(c.destroy)
        out["destroy"] = [dt, _outcome(err)]
    else:
        got = {}

        def abort_later():
            time.sleep(1.0)
            _step("abort()")
            got["t0"] = time.monotonic()
            got["abort"] = timed(c.abort)
            _step("abort() returned")
        th = threading.Thread(target=abort_later, daemon=True)
        th.start()
        _step("destroy()")
        dt, err = timed(c.destroy)
        out["destroy_after_abort"] = time.monotonic() - got["t0"] if "t0" in got else None
        out["destroy"] = [dt, _outcome(err)]
        th.join(10)
        out["abort"] = [got["abort"][0], _outcome(got["abort"][1])] if "abort" in got else "not returned"
    _step("destroy() returned")
    out["misuse"] = get("misuse")
    return out


def own_kernel_stuck_abort_wait():
    """An own kernel waiting for a peer that died with the call in flight; wait() on the
    main thread, abort() from another 0.5 s later, on a communicator without a timeout
    (FAKE_CASE 'untimed') or with one of 30 s ('timed').  The abort's stop word ends the
    kernel at once, its NCCL abort returns 0.3 s later (its teardown, as on a GPU): the
    wait raises that the communicator was aborted all the same."""
    _bounded(25)
    c = _own_kernels_ready(timeout=None if os.environ["FAKE_CASE"] == "untimed" else 30.0)
    put("peer_dead", 1)
    put("abort_delay", 0.3)
    c.all_reduce(Array([1.0, 2.0]))   # the own kernel: it waits for the dead peer
    assert get("ar_stuck") == 1, "the own kernel was not launched"
    got = {}

    def abort_later():
        time.sleep(0.5)
        got["abort"] = timed(c.abort)
    th = threading.Thread(target=abort_later, daemon=True)
    th.start()
    _step("wait()")
    dt, err = timed(c.wait)
    th.join(10)
    out = {"wait": [dt, _outcome(err)], "destroyed": c.destroyed,
           "abort": [got["abort"][0], _outcome(got["abort"][1])] if "abort" in got else "not returned"}
    put("abort_delay", 0)
    c.destroy()
    out["misuse"] = get("misuse")
    return out


def own_kernel_stuck_timed():
    """A communicator with a 2 s timeout whose own kernel waits for a peer that died with
    the call in flight: the kernel gives up at its deadline (the timeout), so wait() raises
    NcclTimeoutError once the timeout passed, and so does the next call."""
    _bounded(25)
    c = _own_kernels_ready(timeout=2.0)
    put("peer_dead", 1)
    c.all_reduce(Array([1.0, 2.0]))   # the own kernel: it waits for the dead peer
    assert get("ar_stuck") == 1, "the own kernel was not launched"
    _step("wait()")
    dt, err = timed(c.wait)
    out = {"wait": [dt, _outcome(err)]}
    _step("all_reduce()")
    dt, err = timed(lambda: c.all_reduce(Array([1.0, 2.0])))
    out["next"] = [dt, _outcome(err)]
    out["misuse"] = get("misuse")
    return out


def own_kernel_timed_unevented():
    """A communicator with a 2 s timeout.  Its own-kernel calls record no CUDA event (their
    waits on peers are bounded by the timeout) and give their sums; wait() still covers them
    (an event of its own on their stream).  Then, FAKE_CASE "gave_up": a kernel stuck on a
    dead peer gives up at the timeout, and the watchdog fails the communicator by itself, no
    call of this process looking (get_async_error() only reads its verdict), and the next
    call raises it.  "nccl_error": NCCL reports an error while the kernel waits: the watchdog
    fails the communicator, and the kernel stops at once (destroy() waits for it)."""
    _bounded(25)
    case = os.environ["FAKE_CASE"]
    rank = int(os.environ["FAKE_RANK"])
    c = _own_kernels_ready(timeout=2.0)
    records = get("event_records")
    sums = []
    for i in range(20):
        a = Array([float(i + 3 * rank), -1.5 * (rank + 1)])
        c.all_reduce(a)
        sums.append(a.tolist())
    out = {"records": get("event_records") - records, "sums": sums}
    c.wait()
    out["wait_records"] = get("event_records") - records
    put("peer_dead", 1)
    c.all_reduce(Array([1.0, 2.0]))
    assert get("ar_stuck") == 1, "the own kernel was not launched"
    t0 = time.monotonic()
    if case == "nccl_error":
        put("async_error", 2)
    seen = None
    while seen is None and time.monotonic() - t0 < 6.0:
        time.sleep(0.02)
        err = c.get_async_error()
        if err is not None:
            seen = [round(time.monotonic() - t0, 2), type(err).__name__, str(err)]
    out["async"] = seen
    if case == "gave_up":
        _step("all_reduce()")
        out["next"] = _outcome(timed(lambda: c.all_reduce(Array([1.0, 2.0])))[1])
    else:
        _step("destroy()")
        dt, err = timed(c.destroy)
        out["destroy"] = [dt, _outcome(err)]
    out["misuse"] = get("misuse")
    return out


def _own_loop(c, res, algo=None, group=0):
    """1000 all_reduces on c (the rank's device made this thread's), or with `group` 1000
    pyccl.group()s of that many; the first exception, with the number of the call (or group)
    that raised it, goes into res["err"]."""
    n = 0
    assert fake.cudaSetDevice(int(os.environ.get("FAKE_RANK", "0"))) == 0  # the device is per thread
    try:
        for n in range(1, 1001):
            if group:
                bufs = [Array([1.0, 2.0]) for _ in range(group)]  # alive until the group's end runs
                with pyccl.group():
                    for b in bufs:
                        c.all_reduce(b, algo=algo)
            else:
                c.all_reduce(Array([1.0, 2.0]), algo=algo)
    except BaseException as e:  # noqa: BLE001 (reported)
        res["err"] = [n, type(e).__name__, str(e)]


def _own_loop_beside(c, res, seconds=1.0, algo=None, group=0):
    """_own_loop on a new thread while this one ticks every 10 ms for `seconds` (the ticks say
    whether it ran meanwhile): (the thread, when it started, ticks)."""
    t = threading.Thread(target=_own_loop, args=(c, res, algo, group))
    t0 = time.monotonic()
    t.start()
    ticks = 0
    while time.monotonic() - t0 < seconds:
        ticks += 1
        time.sleep(0.01)
    return t, t0, ticks


def _stuck_loop_ended(c, case, counter, algo=None, group=0):
    """The peer just died: _own_loop on c until its call waits, then (case "abort") abort()
    from this thread while the loop runs on another, NCCL's abort taking 0.3 s (the call must
    end at once meanwhile), or ("sigint") the loop on this thread, a SIGINT 1 s in, then
    abort().  How far the stand-in's `counter` went meanwhile (ahead), this thread's ticks,
    abort()'s time and outcome, how soon after abort() began the loop's call ended, and the
    loop's error."""
    import signal
    before, res = get(counter), {}
    if case == "abort":
        t, _, ticks = _own_loop_beside(c, res, algo=algo, group=group)
        out = {"ahead": get(counter) - before, "ticks": ticks}
        put("abort_delay", 0.3)
        t1 = time.monotonic()
        dt, err = timed(c.abort)
        t.join(10)
        put("abort_delay", 0)
        out["ended_after"] = time.monotonic() - t1
    else:
        # Ctrl-C's handler, also where this process was started with SIGINT ignored (a
        # background job of a shell without job control)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        _own_loop(c, res, algo=algo, group=group)
        out = {"ahead": get(counter) - before}
        dt, err = timed(c.abort)
    out["abort"] = [dt, _outcome(err)]
    out["err"] = res.get("err")
    return out


def own_kernel_timed_lead():
    """A communicator with a 2 s timeout whose own kernels wait for a dead peer, called in a
    loop on another thread: the host stops 16 x 16 launches ahead of the stuck kernel (the
    mark of every 16th launch, the one 16 back waited for), waiting with the GIL released (this
    thread runs meanwhile) until the kernel gave up at the timeout; then the call raises."""
    _bounded(25)
    c = _own_kernels_ready(timeout=2.0)
    put("peer_dead", 1)
    launches = get("launches")
    res = {}
    t, t0, ticks = _own_loop_beside(c, res)
    out = {"ahead": get("launches") - launches, "ticks": ticks}
    t.join(10)
    out["err"], out["dt"] = res.get("err"), time.monotonic() - t0
    out["misuse"] = get("misuse")
    return out


def own_kernel_untimed_lead():
    """A communicator without a timeout whose own kernels wait for a dead peer (as NCCL's
    would, for ever): the host still stops 16 x 16 launches ahead of the stuck kernel (every
    16th launch's kernel stores its mark in a host word as it ends; the mark 16 back is waited
    for), the GIL released.  FAKE_CASE "abort": the loop runs on another thread, this one
    runs meanwhile and calls abort(), which ends the wait: the waiting call raises that the
    communicator was aborted (while NCCL's abort still runs).  "sigint": the loop runs on this thread, a SIGINT arrives while
    it waits, and the call raises KeyboardInterrupt; the communicator can be aborted then."""
    _bounded(25)
    c = _own_kernels_ready(timeout=None)
    put("peer_dead", 1)
    out = _stuck_loop_ended(c, os.environ["FAKE_CASE"], "launches")
    out["misuse"] = get("misuse")
    return out


def _nccl_marks(out, group, healthy, captured):
    """NCCL's marks on a communicator without a timeout, the stand-in's launch queue 1024 calls
    deep: `healthy` steps (an all_reduce, or with `group` a pyccl.group() of that many), then
    `captured` steps while the stream is captured, then destroy(); then on a fresh
    communicator for each of abort() and SIGINT, 5 calls and a peer dead unseen:
    _stuck_loop_ended.  Into out."""
    def step(c):
        if group:
            bufs = [Array([1.0]) for _ in range(group)]  # alive until the group's end runs
            with pyccl.group():
                for b in bufs:
                    c.all_reduce(b, algo="nccl")
        else:
            c.all_reduce(Array([1.0]), algo="nccl")

    put("launch_block", 1024)
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    recs, live = get("event_records"), get("events_live")
    for _ in range(healthy):
        step(c)
    out["healthy"] = [get("event_records") - recs, get("events_live") - live]
    put("capturing", 1)
    for _ in range(captured):
        step(c)
    put("capturing", 0)
    out["captured"] = get("event_records") - recs
    c.destroy()
    out["after_destroy"] = get("events_live")
    for case in ("abort", "sigint"):
        c = pyccl.Communicator(2, pyccl.unique_id(), 0)
        for _ in range(5):
            c.all_reduce(Array([1.0]), algo="nccl")
        put("peer_dead", 1)
        out[case] = _stuck_loop_ended(c, case, "ops", "nccl", group=group)
        out[case]["live_after_abort"] = get("events_live")
        c.destroy()
        put("peer_dead", 0)


def nccl_untimed_lead():
    """NCCL's calls on a communicator without a timeout.  Healthy: every 16th call records one
    event (none while the stream is captured), and destroy() or garbage collection leaves none.  A peer dead unseen
    (NCCL's kernel waits for ever; the launch queue here is 1024 calls deep, and a launch
    behind a full one blocks, holding the communicator's lock): the host stops 16 x 16 calls
    ahead of the stuck one, waiting for the mark 16 back without the lock or the GIL, so that
    this thread runs meanwhile and its abort() ends that call, which raises that the
    communicator was aborted.  Then on another communicator, a SIGINT ends the same wait with
    KeyboardInterrupt."""
    _bounded(40)
    out = {}
    _nccl_marks(out, 0, 64, 32)
    # collected without destroy(): its ring goes with it
    import gc
    c = pyccl.Communicator(2, pyccl.unique_id(), 0)
    for _ in range(16):
        c.all_reduce(Array([1.0]), algo="nccl")
    out["before_gc"] = get("events_live")
    del c
    gc.collect()
    out["events_live"] = get("events_live")
    clean()
    return out


def nccl_untimed_group_lead():
    """The same with a loop of pyccl.group()s of 3 NCCL all_reduces (whose launch is the
    group's end, outside the communicator's lock, the communicator counted in the group, where
    abort() refuses it): the group's calls are counted and its end records the mark when the
    count passes a multiple of 16, then leaves the group and waits for the mark 16 back, so the
    host stops 256 calls and at most one group ahead of the stuck one, and abort() from this
    thread ends the wait (the group's end raises that the communicator was aborted), as SIGINT
    does.  Healthy: 30 groups (90 calls) record 5 marks, none while captured."""
    _bounded(40)
    out = {}
    _nccl_marks(out, 3, 30, 16)
    out["misuse"] = get("misuse")
    clean()
    return out


def group_other_thread():
    """A communicator in a pyccl.group() open on one thread, called from another (with and
    without a timeout): NCCL takes a communicator's calls from one thread's group at a time
    (the group's end works on it without any lock of pyccl's), so the other thread's call is
    refused, nothing enqueued (split() and shrink() too), and works once the group ended.  Then one thread loops groups
    on it while another loops calls: never two threads inside it."""
    _bounded(40)
    out = {}
    for timeout in (None, 5.0):
        c = new(timeout=timeout)
        a, b = Array([1.0]), Array([2.0])
        opened, done = threading.Event(), threading.Event()

        def in_group():
            with pyccl.group():
                c.all_reduce(a)
                opened.set()
                done.wait(10)

        t = threading.Thread(target=in_group)
        t.start()
        opened.wait(10)
        ops, splits, shrinks = get("ops"), get("splits"), get("shrinks")
        err = timed(lambda: c.all_reduce(b))[1]
        key = "untimed" if timeout is None else "timed"
        out[key] = {"refused": _outcome(err), "ops": get("ops") - ops,
                    "split": _outcome(timed(lambda: c.split(0))[1]), "splits": get("splits") - splits,
                    "shrink": _outcome(timed(lambda: c.shrink([1]))[1]),
                    "shrinks": get("shrinks") - shrinks}
        done.set()
        t.join(10)
        err = timed(lambda: c.all_reduce(b))[1]
        out[key]["after"] = [_outcome(err), a.tolist(), b.tolist()]
        refused, errs = [0], []

        def groups():
            for _ in range(150):
                with pyccl.group():
                    c.all_reduce(a)

        def calls():
            for _ in range(150):
                try:
                    c.all_reduce(b)
                except RuntimeError as e:
                    refused[0] += 1
                    if "open on another thread" not in str(e):
                        errs.append(str(e))

        ts = [threading.Thread(target=groups), threading.Thread(target=calls)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(30)
        out[key]["race"] = {"concurrent": get("concurrent"), "other_errors": errs,
                            "alive": any(th.is_alive() for th in ts)}
        put("concurrent", 0)
        c.destroy()
    clean()
    return out


class _EndsOnRead(Array):
    """An Array whose __cuda_array_interface__, the first time it is read, calls `end`
    (the communicator's destroy or abort): user code that runs while pyccl reads the
    arguments."""

    def __init__(self, values, end):  # not Array's: it would assign the property
        self.buf = (ctypes.c_float * len(values))(*values)
        self._cai = {"shape": (len(values),), "typestr": "<f4", "data": (ctypes.addressof(self.buf), False),
                     "strides": None, "version": 3}
        self._end = end

    @property
    def __cuda_array_interface__(self):
        end, self._end = self._end, None
        if end is not None:
            end()
        return self._cai


def own_setup_comm_gone_while_reading():
    """The first all_reduce (the one that would set the own kernels up) of a communicator
    that the tensor's or the stream's own Python code destroys or aborts (FAKE_CASE) while
    pyccl reads them, with and without a timeout: what it raises, and how many device
    bytes, peer mappings and host words it left behind."""
    import torch
    _bounded(30)
    case = os.environ["FAKE_CASE"]
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0

    class EndsOnReadStream(torch.cuda.Stream):
        device_index = rank

        def __init__(self, end):
            self._end = end

        @property
        def cuda_stream(self):
            end, self._end = self._end, None
            if end is not None:
                end()
            return 0x7000 + rank   # the current stream (the stub torch's)
    out = {}
    for what in ("tensor", "stream"):
        for timeout in (None, 5.0):
            c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank, timeout=timeout)
            end = getattr(c, case)
            before = [get(k) for k in ("mem_live", "ipc_live", "host_live")]
            if what == "tensor":
                call = lambda: c.all_reduce(_EndsOnRead([1.0, 2.0], end))  # noqa: E731
            else:
                call = lambda: c.all_reduce(Array([1.0, 2.0]), stream=EndsOnReadStream(end))  # noqa: E731
            _, err = timed(call)
            left = [get(k) - b for k, b in zip(("mem_live", "ipc_live", "host_live"), before)]
            out[f"{what}, timeout={timeout}"] = [_outcome(err), left]
            c.destroy()
    out["misuse"] = get("misuse")
    return out


def own_setup_other_group():
    """The first all_reduce that would set the own kernels up, on a communicator that a
    pyccl.group() open on another thread holds (with and without a timeout; both ranks alike):
    refused before the set-up sent anything (its first NCCL call would go beside that group,
    whose end works on the communicator without pyccl's lock), nothing of the kernels kept and
    their state untouched; once the group ended the next call sets them up."""
    _bounded(30)
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    out = {}
    for timeout in (None, 5.0):
        c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank, timeout=timeout)
        b = Array([1.0 + rank])
        opened, done = threading.Event(), threading.Event()

        def in_group():
            assert fake.cudaSetDevice(rank) == 0
            with pyccl.group():
                c.all_reduce(b, algo="nccl")
                opened.set()
                done.wait(10)

        t = threading.Thread(target=in_group)
        t.start()
        opened.wait(10)
        a = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
        before = [get(k) for k in ("mem_live", "ipc_live", "host_live", "ops", "launches")]
        _, err = timed(lambda: c.all_reduce(a))
        left = [get(k) - v for k, v in zip(("mem_live", "ipc_live", "host_live", "ops", "launches"), before)]
        r = {"refused": _outcome(err), "left": left, "values": a.tolist(),
             "state": c.all_reduce_info["state"]}
        done.set()
        t.join(10)
        _, err = timed(lambda: c.all_reduce(a))
        r["after"] = [_outcome(err), a.tolist(), c.all_reduce_info["state"]]
        out[f"timeout={timeout}"] = r
        c.destroy()
    out["misuse"] = get("misuse")
    return out


def own_bad_ar_timeout():
    """PYCCL_AR_TIMEOUT, or the setting FAKE_VAR names (set by the test; FAKE_CASE "rank0": on
    rank 0 only), on a communicator without a timeout: what the first all_reduce that would
    use the own kernels does (its values), what all_reduce_info says, then NCCL's all_reduce."""
    _bounded(30)
    rank = int(os.environ["FAKE_RANK"])
    name = os.environ.get("FAKE_VAR", "PYCCL_AR_TIMEOUT")
    value = os.environ.pop(name, None)
    if value is not None and (os.environ.get("FAKE_CASE") != "rank0" or rank == 0):
        os.environ[name] = value
    assert fake.cudaSetDevice(rank) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
    a = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
    _, err = timed(lambda: c.all_reduce(a))
    info = c.all_reduce_info
    b = Array([1.0 + rank, 2.0, 3.0 * (rank + 1)])
    _, err2 = timed(lambda: c.all_reduce(b, algo="nccl"))
    out = {"first": _outcome(err), "first_values": a.tolist(), "state": info["state"],
           "reason": info["reason"], "timeout": info["timeout"], "nccl": _outcome(err2),
           "values": b.tolist()}
    c.destroy()
    out["misuse"] = get("misuse")
    return out


def _refs(args, kw):
    """The objects whose refcounts a call must leave unchanged: the arguments
    and the items of list/tuple arguments (a snapshot: `slots` says how many
    times each item sits in those lists now)."""
    tops = list(args) + list(kw.values())
    seqs = [a for a in tops if isinstance(a, (list, tuple))]
    items = [i for a in seqs for i in a]
    return tops, seqs, items, _slots(seqs, items), [len(a) for a in tops if isinstance(a, list)]


def _slots(seqs, items):
    return [sum(1 for q in seqs for x in q if x is o) for o in items]


def _counts(snap):
    tops, _, items, _, _ = snap
    return [sys.getrefcount(o) for o in tops + items]


def _refs_want(snap, before):
    """What the counts must be after the call: unchanged, except that an item
    the row removed from its list lost that list's reference, and a list that
    was emptied is left out (its removed items may have held it)."""
    tops, seqs, items, slots, lens = snap
    now = _slots(seqs, items)
    want = list(before)
    for k, (was, is_) in enumerate(zip(slots, now)):
        want[len(tops) + k] -= was - is_
    lists = [k for k, o in enumerate(tops) if isinstance(o, list)]
    for k, n in zip(lists, lens):
        if len(tops[k]) != n:
            want[k] = None
    return want


def _usable(c):
    """A correct call afterwards: on a fresh communicator, and on c if alive."""
    for comm in [pyccl.Communicator(2, pyccl.unique_id(), 0)] + ([] if c.destroyed else [c]):
        a = Array([1.0, 2.0])
        comm.all_reduce(a)
        assert a.tolist() == [2.0, 4.0], a.tolist()
        t = Tensor([3.0], 0)
        pyccl.nccl.all_reduce([t], comms=[comm])
        assert t.tolist() == [6.0], t.tolist()
        comm.destroy()


def bad_input():
    """Rows of the bad-input catalogue (JSON on stdin: id, code): run
    each row's code (it sets fn, args and maybe kw), call fn, and report the
    exception, whether the arguments' refcounts are unchanged, and whether
    correct calls work afterwards."""
    import _hostile
    rows = json.loads(sys.stdin.read())
    out = {}
    for row in rows:
        ns = dict(_hostile.NAMESPACE, Array=Array, Tensor=Tensor, stream=stream)
        ns["c"] = pyccl.Communicator(2, pyccl.unique_id(), 0)
        exec(row["code"], ns)
        fn, args, kw = ns["fn"], ns["args"], ns.get("kw", {})
        snap = _refs(args, kw)
        before = _counts(snap)
        got = None
        try:
            fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            got = [type(e).__name__, str(e)] + list(getattr(e, "__notes__", ()))
        after = _counts(snap)
        want = _refs_want(snap, before)
        after = [None if w is None else a for w, a in zip(want, after)]
        usable = "ok"
        try:
            _usable(ns["c"])
            clean()
        except BaseException as e:  # noqa: BLE001
            usable = repr(e)
        out[row["id"]] = {"exc": got, "refs_ok": want == after, "refs": [before, want, after],
                          "usable": usable}
        ns.clear()
    return out


def loader_messages():
    """What the first GPU use says (RuntimeError) when NCCL is not found, when the library
    given for it is not NCCL, and when it is an NCCL too old; then, given the stand-in, it
    works.  JSON on stdin: the paths of a library without ncclGetVersion and of one whose
    ncclGetVersion alone is there.  The two wrong libraries first: where the dynamic loader's
    search path holds an NCCL, "missing" loads it, and nothing is looked for after that."""
    paths = json.loads(sys.stdin.read())
    out = {}
    for key, candidates in (("not_nccl", [paths["not_nccl"]]), ("old", [paths["old"]]), ("missing", [])):
        pyccl._C._set_library_candidates(candidates, [LIB])
        try:
            pyccl.unique_id()
            out[key] = None
        except RuntimeError as e:
            out[key] = [type(e).__name__, str(e)]
    out["then"] = None
    if out["missing"] is not None:
        pyccl._C._set_library_candidates([LIB], [LIB])
        out["then"] = len(pyccl.unique_id())
    return out


def note_through_logging():
    """no_peer_access with a handler on the "pyccl" logger: the note is a record there."""
    import logging
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])
    logging.getLogger("pyccl").addHandler(Keep())
    res = no_peer_access()
    res["records"] = records
    return res


def fuzz():
    """tests/test_fuzz_cpu.py: PYCCL_FUZZ_SEED and PYCCL_FUZZ_N from the environment."""
    import _fuzz
    seed, n = int(os.environ["PYCCL_FUZZ_SEED"]), int(os.environ["PYCCL_FUZZ_N"])
    counts = _fuzz.run(seed, n, lambda: get("misuse"))
    clean()
    return {"seed": seed, "calls": n, "counts": counts}


def lifecycle():
    """What README promises about a communicator's life: destroyed on garbage collection
    (timed and untimed), closed by `with`, and create/use/destroy repeated in one process
    leaves nothing behind (events, NCCL communicators, watchdog threads)."""
    import gc
    counts = lambda: (get("finalizes") + get("aborts"), get("destroys") + get("aborts"))  # noqa: E731
    for timeout in (None, 5.0):
        before = counts()
        c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=timeout)
        a = Array([1.0, 2.0])
        c.all_reduce(a)
        c.wait()
        del c
        gc.collect()
        after = counts()
        assert after[1] == before[1] + 1, ("not released on garbage collection", timeout, before, after)
    assert get("events_live") == 0, get("events_live")
    with new(timeout=5) as c:
        a = Array([1, 2, 3])
        c.all_reduce(a)
        c.wait()
        assert not c.destroyed
    assert c.destroyed and a.tolist() == [2, 4, 6], a.tolist()
    # the body raising: the communicator is still destroyed, the exception goes through
    try:
        with new(timeout=5) as c2:
            raise KeyError("boom")
    except KeyError:
        pass
    assert c2.destroyed
    threads = threading.active_count()
    base = counts()
    for k in range(50):
        c = new(timeout=5) if k % 2 else pyccl.Communicator(2, pyccl.unique_id(), 0)
        a = Array([k, 1])
        c.all_reduce(a)
        c.wait()
        assert a.tolist() == [2 * k, 2], (k, a.tolist())
        c.destroy()
    assert counts()[1] == base[1] + 50, (base, counts())
    assert get("events_live") == 0, get("events_live")
    assert threading.active_count() <= threads, "a thread per communicator was left running"
    clean()
    return "ok"


def names():
    """Communicator.name (what the torch custom ops pass): made on first read, unique, stable,
    found by _C._communicator while the object lives, gone from the table with it, never reused."""
    import gc
    import re
    a, b = new(timeout=None), new(timeout=5.0)
    na, nb = a.name, b.name
    assert re.fullmatch(r"pyccl\.Communicator\.[1-9][0-9]*", na), na
    assert na != nb and a.name is na, (na, nb)  # one str per communicator, kept
    assert pyccl._C._communicator(na) is a and pyccl._C._communicator(nb) is b
    unnamed = new(timeout=None)  # never asked: not in the table
    a.destroy()
    assert pyccl._C._communicator(na) is a  # destroyed but alive: found (its methods then say so)
    try:
        a.all_reduce(Array([1.0]))
        raise AssertionError("a destroyed communicator ran all_reduce")
    except RuntimeError as e:
        assert str(e) == "all_reduce: the communicator (rank 0 of 2) has been destroyed", str(e)
    del a
    gc.collect()
    assert pyccl._C._communicator(na) is None
    c = new(timeout=None)
    nc = c.name
    assert nc not in (na, nb) and int(nc.rsplit(".", 1)[1]) > int(nb.rsplit(".", 1)[1]), (na, nb, nc)
    # many short-lived named communicators leave no entries behind
    short = []
    for _ in range(20):
        d = new(timeout=None)
        short.append(d.name)
        assert pyccl._C._communicator(d.name) is d
        d.destroy()
        del d
    gc.collect()
    live = [n for n in [na, nb, nc] + short if pyccl._C._communicator(n) is not None]
    assert live == [nb, nc], live
    for x in (b, c, unnamed):
        x.destroy()
    clean()
    return "ok"


def op_spellings():
    """The NCCL op each spelling of a reduction reaches NCCL as, through the Communicator's
    all_reduce and reduce and the drop-in's all_reduce on it (the stand-in records the op it
    was passed).  torch.distributed's ReduceOp is a stand-in of the same shape here (a module
    torch._C._distributed_c10d whose ReduceOp holds .op, a ReduceOp.RedOpType with .name)."""
    c10d = types.ModuleType("torch._C._distributed_c10d")

    class RedOpType:
        def __init__(self, name):
            self.name = name

    class ReduceOp:
        def __init__(self, kind):
            self.op = kind
    ReduceOp.RedOpType = RedOpType
    c10d.ReduceOp = ReduceOp
    sys.modules[c10d.__name__] = c10d
    c = new(world=1, timeout=None)
    spellings = {"int 2": 2, "pyccl.MIN": pyccl.MIN, "'sum'": "sum", "'Prod'": "Prod", "'AVG'": "AVG",
                 "RedOpType MAX": RedOpType("MAX"), "RedOpType PRODUCT": RedOpType("PRODUCT"),
                 "ReduceOp(AVG)": ReduceOp(RedOpType("AVG")), "ReduceOp(MIN)": ReduceOp(RedOpType("MIN"))}
    out = {}
    for label, op in spellings.items():
        got = []
        for call in (lambda: c.all_reduce(Array([1.0]), op),
                     lambda: c.reduce(Array([1.0]), 0, op=op),
                     lambda: pyccl.nccl.all_reduce([Tensor([1.0])], op=op, comms=[c])):
            put("last_redop", -1)
            call()
            got.append(get("last_redop"))
        out[label] = got
    for label, op in {"RedOpType BXOR": RedOpType("BXOR"), "ReduceOp(PREMUL_SUM)": ReduceOp(RedOpType("PREMUL_SUM")),
                      "'xor'": "xor"}.items():
        for call in (lambda: c.all_reduce(Array([1.0]), op),
                     lambda: pyccl.nccl.all_reduce([Tensor([1.0])], op=op, comms=[c])):
            _, err = timed(call)
            out.setdefault(label, []).append([type(err).__name__, str(err)])
    c.destroy()
    clean()
    return out


def device_forms():
    """The device each form of device= puts a communicator on (torch.device is a stand-in
    of the same shape: .type and .index), and the messages of the forms refused."""
    import torch

    class device:
        def __init__(self, type, index=None):
            self.type, self.index = type, index

        def __str__(self):
            return self.type if self.index is None else f"{self.type}:{self.index}"
    torch.device = device
    out = {}
    forms = {"1": 1, "'cuda:1'": "cuda:1", "device('cuda', 1)": device("cuda", 1),
             "'cuda' (current: 1)": "cuda", "device('cuda') (current: 1)": device("cuda"),
             "None (current: 1)": None}
    for label, form in forms.items():
        fake.cudaSetDevice(1)
        a = pyccl.Communicator(1, pyccl.unique_id(), 0, device=form)
        b = pyccl.init_rank(1, pyccl.unique_id(), 0, device=form)
        out[label] = [a.device, b.device]
        a.destroy()
        b.destroy()
        fake.cudaSetDevice(0)
    comms = pyccl.init_ranks(2, pyccl.unique_id(), [0, 1], ["cuda:1", device("cuda", 0)])
    out["init_ranks"] = [x.device for x in comms]
    for x in comms:
        x.destroy()
    for label, call in {
        "device('cpu')": lambda: pyccl.Communicator(1, pyccl.unique_id(), 0, device=device("cpu")),
        "'cuda:5'": lambda: pyccl.Communicator(1, pyccl.unique_id(), 0, device="cuda:5"),
        "init_ranks 'cuda'": lambda: pyccl.init_ranks(2, pyccl.unique_id(), [0, 1], ["cuda", 1]),
    }.items():
        _, err = timed(call)
        out[label] = [type(err).__name__, str(err)]
    clean()
    return out


def keyword_order():
    """Communicator methods take input first (NCCL's order); by keyword, in any order, the
    arguments land where they are named.  One rank: all_gather and reduce_scatter copy input
    into output, so a swap would show as output unchanged and input overwritten."""
    c = new(world=1, timeout=None)
    out = {}
    calls = {
        "all_gather positional": lambda a, b: c.all_gather(a, b),
        "all_gather input=, output=": lambda a, b: c.all_gather(input=a, output=b),
        "all_gather output=, input=": lambda a, b: c.all_gather(output=b, input=a),
        "reduce_scatter output=, input=": lambda a, b: c.reduce_scatter(output=b, input=a),
        "reduce_scatter output=, input=, op='sum'": lambda a, b: c.reduce_scatter(output=b, input=a, op="sum"),
    }
    for label, call in calls.items():
        a, b = Array([1.0, 2.0]), Array([0.0, 0.0])
        call(a, b)
        out[label] = [a.tolist(), b.tolist()]
    # (one rank's send and recv move nothing on the stand-in: where they point is the check)
    where = {}
    a, b = Array([1.0, 2.0]), Array([0.0, 0.0])
    addr = {a.__cuda_array_interface__["data"][0]: "input", b.__cuda_array_interface__["data"][0]: "output"}
    c.all_to_all_single(output=b, input=a, output_splits=[2], input_splits=[2])
    where["all_to_all_single output=, input="] = [addr.get(get("last_send")), addr.get(get("last_recv"))]
    c.scatter(tensor=b, inputs=a, root=0)
    where["scatter tensor=, inputs="] = [addr.get(get("last_send")), addr.get(get("last_recv"))]
    out["sent from, received into"] = where
    c.destroy()
    clean()
    return out



# ---- shrink: the ranks left carry on

def _expect_exc(exc, text, fn, *a, **k):
    try:
        fn(*a, **k)
    except exc as e:
        assert str(e) == text, (str(e), text)
        return e
    raise AssertionError(f"no {exc.__name__}: {text}")


def shrink_healthy():
    """shrink() of a working communicator of 4 ranks (this process is rank 1), with and
    without a timeout: the ranks left, renumbered, in a communicator that works; the bad
    arguments refused with their messages before NCCL is called."""
    got = {}
    for timeout in (None, 5.0):
        c = pyccl.Communicator(4, pyccl.unique_id(), 1, timeout=timeout)
        shrinks = get("shrinks")
        for arg, exc, text in (
                ([1], ValueError, "shrink: this rank (1) is in exclude; only the ranks that remain "
                                  "call shrink()"),
                ([4], ValueError, "shrink: exclude[0] is 4, out of range for 4 ranks (ranks are 0..3)"),
                ([0, -1], ValueError, "shrink: exclude[1] is -1, out of range for 4 ranks (ranks are "
                                      "0..3)"),
                ([3, 3], ValueError, "shrink: rank 3 is in exclude twice"),
                (5, TypeError, "shrink: exclude must be a sequence of ranks, got int")):
            _expect_exc(exc, text, c.shrink, arg)
        assert get("shrinks") == shrinks, "NCCL called for a refused shrink"
        c2 = c.shrink([0])  # rank 1 becomes rank 0 of 3
        c3 = c.shrink(exclude=(2, 3))  # rank 1 stays rank 1 of 2
        assert (c2.rank, c2.size, c3.rank, c3.size) == (0, 3, 1, 2), (c2, c3)
        assert c2.timeout == c.timeout and c3.timeout == c.timeout
        x = Array([1.0, 2.0])
        c2.all_reduce(x)
        if timeout:
            c2.wait()
        assert x.tolist() == [3.0, 6.0], x.tolist()  # the stand-in: every rank has the same data
        for k in (c3, c2, c):
            k.destroy()
        got[str(timeout)] = get("shrinks") - shrinks
    clean()
    return got


def shrink_after_failure():
    """The survivors' way on: a communicator with a timeout whose peer died fails (its work
    stopped by ncclCommRevoke, the handle kept), the next call raises, shrink() makes a
    communicator of the ranks left that works, and destroy() of the failed one aborts its
    kept handle.  After abort() there is no handle left to shrink."""
    c = pyccl.Communicator(4, pyccl.unique_id(), 0, timeout=0.3)
    a = Array([1.0])
    c.all_reduce(a)
    c.wait()
    put("peer_dead", 1)
    c.all_reduce(a)
    t0 = time.monotonic()
    dt, err = timed(c.wait)
    assert type(err) is pyccl.NcclTimeoutError, repr(err)
    assert (get("revokes"), get("aborts")) == (1, 0)
    put("peer_dead", 0)
    c2 = c.shrink([3])
    assert (c2.rank, c2.size, c2.timeout) == (0, 3, 0.3), c2
    assert get("shrinks") == 1
    x = Array([1.0, 2.0])
    c2.all_reduce(x)
    c2.wait()
    assert x.tolist() == [3.0, 6.0], x.tolist()
    c.destroy()
    assert get("aborts") == 1, "the failed communicator's kept handle was not aborted"
    c2.destroy()
    # abort() lets the handle go: nothing to shrink then
    c3 = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=0.3)
    c3.abort()
    _expect_exc(RuntimeError, "shrink: the communicator (rank 0 of 2) was aborted, so no handle is "
                "left to shrink (a communicator whose timeout or error failed it is kept for "
                "shrink() where NCCL has ncclCommRevoke, until abort() or destroy())", c3.shrink, [1])
    c3.destroy()
    _expect_exc(RuntimeError, "shrink: the communicator (rank 0 of 2) has been destroyed", c3.shrink, [1])
    clean()
    return {"wait_s": dt, "since": time.monotonic() - t0}


# ---- lifecycle: threads, groups, registrations
# tests/test_lifecycle_cpu.py: a communicator's end (destroy, abort, a registration's
# close) decided once, whatever other threads or an open pyccl.group() do meanwhile.
# The parameters come as JSON on stdin; a thread that does not finish in time ends the
# process (exit 3, every thread's stack on stderr), so a hang is a failure, not a wait.

LIFE_JOIN = 15.0  # s a scenario's thread may take before it counts as hung


def _params():
    return json.loads(sys.stdin.read() or "{}")


def _join(threads):
    import faulthandler
    for t in threads:
        t.join(LIFE_JOIN)
        if t.is_alive():
            print(f"HUNG: thread {t.name} still running after {LIFE_JOIN} s", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)


def _expect(exc, text, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - compared below
        assert type(e) is exc and str(e) == text, f"{type(e).__name__}: {e}\n  wanted {exc.__name__}: {text}"
        return
    raise AssertionError(f"no {exc.__name__}: {text}")


def _who(c):
    return f"the communicator (rank {c.rank} of {c.size})"


def _destroy_refusals(c):
    """What destroy() says while another thread is inside a call on c: try again later."""
    return {f"destroy: {_who(c)} is in use by another thread; destroy it once that call returned",
            f"destroy: {_who(c)} is in use: enqueued on inside a pyccl.group() that has not ended, "
            "or by another thread; destroy it afterwards"}


def abort_waits_for_a_call_inside_nccl():
    """Without a timeout, abort() from another thread while a thread is inside an NCCL call
    on the handle (a deregistration that takes 1 s): abort() waits for that call to return,
    then aborts (no NCCL call under it: the stand-in counts one as concurrent); the other
    thread's close() deregistered on the live handle.  The same wait on the main thread is
    ended by a signal handler's exception, nothing changed: the communicator still works."""
    import signal
    out = {}
    c = new(timeout=None)
    reg = c.register(Array([1.0, 2.0]))
    put("dereg_delay", 1.0)
    closer = threading.Thread(target=lambda: out.__setitem__("close", timed(reg.close)))
    closer.start()
    time.sleep(0.2)              # the deregistration is inside NCCL, holding the lock
    dt, err = timed(c.abort)
    closer.join(LIFE_JOIN)
    assert err is None and 0.6 <= dt < 2.0, (err, dt)
    assert out["close"][1] is None and reg.closed, out
    assert c.destroyed and get("aborts") == 1 and get("dereg_calls") == 1
    c.destroy()
    # on the main thread: a signal handler's exception ends abort()'s wait
    c = new(timeout=None)
    reg = c.register(Array([3.0, 4.0]))
    closer = threading.Thread(target=lambda: out.__setitem__("close2", timed(reg.close)))
    closer.start()
    time.sleep(0.2)

    class Alarm(Exception):
        pass

    def alarm(*_):
        raise Alarm("alarm")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    dt, err = timed(c.abort)
    signal.signal(signal.SIGALRM, old)
    closer.join(LIFE_JOIN)
    assert type(err) is Alarm and dt < 0.6, (err, dt)
    assert not c.destroyed and get("aborts") == 1 and out["close2"][1] is None, out
    put("dereg_delay", 0)
    a = Array([1.0, 2.0])
    c.all_reduce(a)              # still usable
    c.wait()
    assert a.tolist() == [2.0, 4.0], a.tolist()
    c.destroy()
    clean()
    return "ok"


def thresholds_by_rank_count():
    """all_reduce_info's oneshot_max/twoshot_max, read before any set-up, for each world size:
    ar.c's one table (2 ranks: the whole buffer; 4: the 4-rank sweep's; others: the
    unmeasured default), each capped at the buffer, PYCCL_AR_* overriding (uncapped)."""
    got = {}
    for world in (2, 3, 4, 5, 8):
        c = new(world=world, timeout=None)
        info = c.all_reduce_info
        got[world] = [info["oneshot_max"], info["twoshot_max"], info["buffer_bytes"]]
        c.destroy()
    os.environ["PYCCL_AR_TWOSHOT_MAX"] = str(64 << 20)
    os.environ["PYCCL_AR_ONESHOT_MAX"] = str(1 << 20)
    c = new(world=4, timeout=None)
    info = c.all_reduce_info
    got["4, overridden"] = [info["oneshot_max"], info["twoshot_max"], info["buffer_bytes"]]
    c.destroy()
    clean()
    return got


def abort_beside():
    """Thread A repeats a call made of several NCCL calls (op: all_gather into a list, a group
    of broadcasts; premul, ncclRedOpCreatePreMulSum, the all_reduce, ncclRedOpDestroy; group,
    two all_reduces in a pyccl.group()), or one (all_reduce; split), on a communicator with a
    timeout (blocking as given) or without one, while thread B aborts it: abort() never ends
    the handle between A's NCCL calls nor under one (the stand-in counts any call on an
    aborted handle as misuse), and is never refused for A's call in flight; A's errors only
    "has been aborted", B's abort() returns."""
    import random
    p = _params()
    rng = random.Random(p.get("seed", 2))
    seen = {}
    for k in range(p["tries"]):
        timeout = p.get("timeout", 5.0)
        c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=timeout,
                               blocking=p["blocking"] if timeout else None)
        a, outs = Array([1.0, 2.0]), [Array([0.0, 0.0]), Array([0.0, 0.0])]
        name = {"all_gather": "all_gather", "premul": "all_reduce", "group": "all_reduce",
                "all_reduce": "all_reduce", "split": "split"}[p["op"]]
        allowed = {f"{name}: {_who(c)} has been aborted",
                   # the group's end, once the abort came between its calls
                   f"pyccl.group: {_who(c)} has been aborted"}

        def group():
            with pyccl.group():
                c.all_reduce(a)
                c.all_reduce(outs[0])

        def split():
            child = c.split(0)
            if child is not None:
                child.destroy()

        call = {"all_gather": lambda: c.all_gather(a, outs),
                "premul": lambda: c.all_reduce(a, op=pyccl.premul_sum(0.5)),
                "all_reduce": lambda: c.all_reduce(a, algo="nccl"),
                "split": split,
                "group": group}[p["op"]]
        bad, done = [], threading.Event()

        def thread_a():
            while not done.is_set():
                try:
                    call()
                except BaseException as e:  # noqa: BLE001 - checked
                    key = f"{type(e).__name__}: {e}"
                    seen[key] = seen.get(key, 0) + 1
                    if not (isinstance(e, RuntimeError) and str(e) in allowed):
                        bad.append(f"A: {key}")
                    return
                if p["op"] == "group":
                    time.sleep(rng.uniform(0, 0.0003))  # a gap between groups: abort() must find one

        in_group = (f"abort: {_who(c)} was used inside a pyccl.group() that has not ended; "
                    "end the group first")

        def thread_b():
            time.sleep(rng.uniform(0, 0.003))
            deadline = time.monotonic() + LIFE_JOIN / 2
            while True:
                try:
                    c.abort()
                    break
                except BaseException as e:  # noqa: BLE001 - checked
                    if not (type(e) is RuntimeError and str(e) == in_group) or time.monotonic() > deadline:
                        bad.append(f"B: {type(e).__name__}: {e}")
                        break
                    time.sleep(rng.uniform(0, 0.0005))  # A's group is open: once it ended
            done.set()

        ts = [threading.Thread(target=thread_a, name="A"), threading.Thread(target=thread_b, name="B")]
        for t in ts:
            t.start()
        _join(ts)
        assert not bad, (k, bad)
        assert c.destroyed
        c.destroy()
        clean()
    return {"tries": p["tries"], "seen": seen}


def async_error_beside():
    """get_async_error() on one thread while another enqueues on the same communicator
    (timeout as given): never two threads inside NCCL at once (counted by the stand-in)."""
    p = _params()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    a = Array([1.0, 2.0])
    bad, done = [], threading.Event()

    def enqueue():
        for _ in range(p["tries"]):
            c.all_reduce(a, algo="nccl")
        done.set()

    def ask():
        while not done.is_set():
            got = c.get_async_error()
            if got is not None:
                bad.append(repr(got))

    ts = [threading.Thread(target=enqueue, name="A"), threading.Thread(target=ask, name="B")]
    for t in ts:
        t.start()
    _join(ts)
    assert not bad, bad
    c.destroy()
    clean()
    return {"tries": p["tries"], "concurrent": get("concurrent")}


def group_of_a_thread_that_ended():
    """A thread opens a pyccl.group() (the raw start, as a generator left open would), queues
    an all_reduce and ends without ending it (timeout as given): the work never runs, so the
    communicator is failed with that reason at the next call; destroy() and abort() work
    (before: refused "in a group" for good); another communicator is untouched."""
    p = _params()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    other = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    a = Array([1.0, 2.0])

    def leave_it_open():
        pyccl._C._nccl_group_start()
        c.all_reduce(a, algo="nccl")

    t = threading.Thread(target=leave_it_open)
    t.start()
    t.join(LIFE_JOIN)
    time.sleep(0.2)  # join() returns before the thread's own end (where it hands its group over)
    reason = ("all_reduce: the communicator (rank 0 of 2) had work queued in a pyccl.group() of "
              "a thread that ended without ending the group; that work never ran, and the "
              "communicator was aborted")
    _expect(RuntimeError, reason, lambda: c.all_reduce(a))
    assert c.destroyed
    other.all_reduce(a, algo="nccl")
    if p["timeout"]:
        other.wait()
    assert a.tolist() == [2.0, 4.0], a.tolist()
    end = getattr(c, p["end"])
    assert end() is None
    other.destroy()
    c.destroy()
    clean()
    return "ok"


def close_waits_for_work():
    """A registration's close() (and destroy()'s own) while a collective on its memory still
    runs: the deregistration comes after the work ended (the stand-in counts one made while
    the communicator's work has not, dereg_busy); inside an open pyccl.group() holding work
    of the communicator, close() is refused and the registration stays open."""
    p = _params()
    put("op_time", 0.3)
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    buf = Array([1.0, 2.0])
    reg = c.register(buf)
    c.all_reduce(buf, algo="nccl")
    took, err = timed(reg.close)
    assert err is None and reg.closed and 0.2 < took < 2.0, (took, err)
    reg = c.register(buf)
    with pyccl.group():
        c.all_reduce(buf)
        _expect(RuntimeError, "Registration.close: the communicator (rank 0 of 2) has work queued "
                "in a pyccl.group() that has not ended; close the registration after the group",
                reg.close)
        assert not reg.closed
    reg.close()
    assert reg.closed
    regs = [c.register(Array([3.0])), c.register(Array([4.0]))]
    c.all_reduce(buf, algo="nccl")
    c.destroy()  # deregisters both, after the all_reduce
    assert all(r.closed for r in regs)
    put("op_time", 0.0)
    clean()
    return {"dereg_busy": get("dereg_busy"), "dereg_calls": get("dereg_calls")}


def close_beside_abort():
    """A registration's close() on one thread while another aborts its communicator
    (timeout as given): close() deregisters on the live handle or raises "has been
    aborted"; never an NCCL call on the aborted handle (the stand-in refuses a NULL one
    with its error 4, and counts a dead one as misuse), and the communicator's lock is
    left free (a later destroy() returns)."""
    import random
    p = _params()
    rng = random.Random(p.get("seed", 3))
    seen = {}
    for k in range(p["tries"]):
        c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
        regs = [c.register(Array([1.0, 2.0])), c.register(Array([3.0, 4.0]))]
        allowed = {f"Registration.close: {_who(c)} has been aborted"}
        bad, delays = [], (rng.uniform(0, 0.0005), rng.uniform(0, 0.0005))
        start = threading.Barrier(2, timeout=LIFE_JOIN)

        def note(who, fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - checked
                key = f"{type(e).__name__}: {e}"
                seen[key] = seen.get(key, 0) + 1
                if not (type(e) is RuntimeError and str(e) in allowed):
                    bad.append(f"{who}: {key}")

        def closer():
            start.wait()
            time.sleep(delays[0])
            for r in regs:
                note("A", r.close)

        def aborter():
            start.wait()
            time.sleep(delays[1])
            note("B", c.abort)

        ts = [threading.Thread(target=closer, name="A"), threading.Thread(target=aborter, name="B")]
        for t in ts:
            t.start()
        _join(ts)
        assert not bad, (k, bad)
        c.destroy()  # returns: the lock is free, whatever happened
        clean()
    return {"tries": p["tries"], "seen": seen}


def destroy_while_reading_arguments():
    """Thread B destroys the communicator while thread A's call (op: broadcast, reduce,
    all_gather; params timeout) reads its tensor: the tensor's __cuda_array_interface__
    starts B and waits 0.3 s, while B's destroy() is held 1 s in deregistering.  A's call
    thus begins with destroy() decided but not done: it raises, enqueuing nothing."""
    import threading
    p = _params()
    put("reg_delay", 0.0)
    put("dereg_delay", 0.0)
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    reg = c.register(Array([1.0] * 4))  # noqa: F841 - deregistered by destroy()
    # held 1 s: with a timeout the deregister is in progress (polled, the watch's lock
    # free); without, its call is (the communicator's lock held)
    put("reg_delay" if p["timeout"] else "dereg_delay", 1.0)
    out = {}

    def destroy():
        out["destroy"] = _outcome(timed(c.destroy)[1])

    b = threading.Thread(target=destroy)

    class Read(Array):
        @property
        def __cuda_array_interface__(self):
            if not b.is_alive() and "destroy" not in out:
                b.start()
                time.sleep(0.3)
            return self.cai

        @__cuda_array_interface__.setter
        def __cuda_array_interface__(self, value):
            self.cai = value

    a, other = Read([1.0, 2.0]), Array([0.0] * 4)
    call = {"broadcast": lambda: c.broadcast(a, 0), "reduce": lambda: c.reduce(a, 0),
            "all_gather": lambda: c.all_gather(a, other)}[p["op"]]
    ops = get("ops")
    out["call"] = _outcome(timed(call)[1])
    _join([b])
    out.update(enqueued=get("ops") - ops, destroyed=c.destroyed)
    return out


def destroy_beside():
    """Thread A repeats one call on a communicator (op: abort, premul, all_reduce, close,
    get_async_error) while thread B destroys it, retrying while destroy() says the
    communicator is in use.  Each try: a fresh communicator with registrations (destroy
    deregisters them first, each call held open for dereg_delay s: the window in which
    A's call meets the destroy half done), A starting after a random delay."""
    import faulthandler
    import random
    faulthandler.enable()
    p = _params()
    op, timeout, tries, nregs = p["op"], p["timeout"], p["tries"], p.get("regs", 2)
    put("dereg_delay", p.get("dereg_delay", 0.0005))
    rng = random.Random(p.get("seed", 1))
    name = {"abort": "abort", "premul": "all_reduce", "all_reduce": "all_reduce",
            "close": "Registration.close", "get_async_error": "get_async_error"}[op]
    seen = {}
    made = 0
    for k in range(tries):
        c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=timeout)
        regs = [c.register(Array([float(i + 1)] * 4)) for i in range(nregs)]
        made += nregs
        before = get("dereg_calls")
        a = Array([1.0, 2.0])
        allowed = {f"{name}: {_who(c)} has been destroyed", f"{name}: {_who(c)} has been aborted"}
        refusals = _destroy_refusals(c)
        # destroy() whose wait an abort() on A ended: it says so, and the communicator is gone
        ended = {f"destroy: {_who(c)} has been aborted"} if op == "abort" else set()
        calls = {"abort": c.abort,
                 "premul": lambda: c.all_reduce(a, op=pyccl.premul_sum(0.5)),
                 "all_reduce": lambda: c.all_reduce(a),
                 "close": lambda: regs[rng.randrange(nregs)].close(),
                 "get_async_error": c.get_async_error}
        call = calls[op]
        start = threading.Barrier(2, timeout=LIFE_JOIN)
        b_done = threading.Event()
        bad = []
        delay_a, delay_b = rng.uniform(0, 0.002), rng.uniform(0, 0.001)

        def note(who, e):
            key = f"{who} {type(e).__name__}: {e}"
            seen[key] = seen.get(key, 0) + 1

        def thread_a():
            start.wait()
            time.sleep(delay_a)
            deadline = time.monotonic() + LIFE_JOIN / 2
            while time.monotonic() < deadline:
                last = b_done.is_set()
                try:
                    got = call()
                    if op == "get_async_error" and got is not None:
                        bad.append(f"A: get_async_error returned {got!r}")
                except BaseException as e:  # noqa: BLE001 - checked
                    note("A", e)
                    if not (isinstance(e, RuntimeError) and str(e) in allowed):
                        bad.append(f"A: {type(e).__name__}: {e}")
                if last:
                    return
                time.sleep(rng.uniform(0, 0.0003))  # a gap: destroy() must find one
            bad.append("A: the destroy on thread B did not end within its time")

        def thread_b():
            start.wait()
            time.sleep(delay_b)
            deadline = time.monotonic() + LIFE_JOIN / 2
            try:
                while True:
                    try:
                        c.destroy()
                        return
                    except BaseException as e:  # noqa: BLE001 - checked
                        note("B", e)
                        if isinstance(e, RuntimeError) and str(e) in ended:
                            return
                        if not (type(e) is RuntimeError and str(e) in refusals):
                            bad.append(f"B: {type(e).__name__}: {e}")
                            return
                    if time.monotonic() > deadline:
                        bad.append("B: destroy() refused for its whole time")
                        return
                    time.sleep(0.0002)
            finally:
                b_done.set()

        ts = [threading.Thread(target=thread_a, name="A"), threading.Thread(target=thread_b, name="B")]
        for t in ts:
            t.start()
        _join(ts)
        assert not bad, (k, bad)
        assert c.destroyed, (k, repr(c))
        assert all(r.closed for r in regs), (k, regs)
        deregs = get("dereg_calls") - before
        # abort() forgets the registrations it finds open (the handle is gone); every other
        # end deregisters each exactly once
        if op == "abort":
            assert deregs <= nregs, f"try {k}: {deregs} deregister calls for {nregs} registrations"
        else:
            assert deregs == nregs, f"try {k}: {deregs} deregister calls for {nregs} registrations"
        clean()
    put("dereg_delay", 0)
    return {"tries": tries, "registrations": made, "dereg_calls": get("dereg_calls"), "seen": seen}


def _group_holder(c, a, go, ready, errs):
    """Another thread: a pyccl.group() with an all_reduce of c queued, held open until go."""
    def run():
        try:
            with pyccl.group():
                c.all_reduce(a)
                ready.set()
                if not go.wait(LIFE_JOIN / 2):
                    errs.append("the group was never let go")
        except BaseException as e:  # noqa: BLE001 - reported
            errs.append(repr(e))
        finally:
            ready.set()
    return threading.Thread(target=run, name="group")


def group_keeps_comm():
    """destroy() and abort() on a communicator enqueued on inside a pyccl.group() that has
    not ended (whose: this thread's or another's) refuse, and change nothing: once the group
    ended its all_reduce is right, the registrations are still open, the communicator works,
    and destroy() then succeeds."""
    p = _params()
    timeout, whose = p["timeout"], p["whose"]
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=timeout)
    regs = [c.register(Array([float(i + 1)] * 4)) for i in range(2)]
    counts = {k: get(k) for k in ("dereg_calls", "aborts", "destroys", "finalizes")}
    a = Array([1.0, 2.0, 3.0])
    destroy_text = (f"destroy: {_who(c)} is in use: enqueued on inside a pyccl.group() that has not "
                    "ended, or by another thread; destroy it afterwards")
    abort_text = (f"abort: {_who(c)} was used inside a pyccl.group() that has not ended; "
                  "end the group first")

    def refused():
        _expect(RuntimeError, abort_text, c.abort)
        _expect(RuntimeError, destroy_text, c.destroy)  # the refused abort left it as it was
        _expect(RuntimeError, abort_text, c.abort)      # and so did the refused destroy
        assert not c.destroyed and "aborted" not in repr(c) and "destroyed" not in repr(c), repr(c)
        assert c.handle != 0
        assert [r.closed for r in regs] == [False, False], regs
        now = {k: get(k) for k in counts}
        assert now == counts, (counts, now)

    if whose == "mine":
        with pyccl.group():
            c.all_reduce(a)
            refused()
    else:
        go, ready, errs = threading.Event(), threading.Event(), []
        t = _group_holder(c, a, go, ready, errs)
        t.start()
        assert ready.wait(LIFE_JOIN), "the other thread's group did not start"
        try:
            refused()
        finally:
            go.set()
            _join([t])
        assert not errs, errs
    c.wait()
    assert a.tolist() == [2.0, 4.0, 6.0], a.tolist()
    assert c.get_async_error() is None
    assert [r.closed for r in regs] == [False, False], regs
    b = Array([5.0, 7.0])
    c.all_reduce(b)
    c.wait()
    assert b.tolist() == [10.0, 14.0], b.tolist()
    c.destroy()
    assert c.destroyed and [r.closed for r in regs] == [True, True], regs
    assert get("dereg_calls") - counts["dereg_calls"] == 2, get("dereg_calls") - counts["dereg_calls"]
    assert get("aborts") == counts["aborts"], "a refused abort() aborted"
    clean()
    return "ok"


def barrier_in_group():
    """barrier() waits on the host, which cannot be inside a pyccl.group() (its all-reduce
    runs only at the group's end): refused, and the group ends cleanly with its own work."""
    p = _params()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    text = "barrier: cannot wait inside pyccl.group(); call it after the group ends"
    a = Array([1.0, 2.0])
    ops = get("ops")
    with pyccl.group():
        _expect(RuntimeError, text, c.barrier)   # first in the group
        c.all_reduce(a)
        _expect(RuntimeError, text, c.barrier)   # after queued work
    c.wait()
    assert a.tolist() == [2.0, 4.0], a.tolist()
    assert get("ops") == ops + 1, f"{get('ops') - ops} collectives ran for one all_reduce"
    c.barrier()  # after the group: a real one
    assert get("ops") == ops + 2, f"{get('ops') - ops} collectives ran for one all_reduce and one barrier"
    c.destroy()
    clean()
    return "ok"


def close_once():
    """One registration closed by two threads at once (how: close, both call close();
    destroy, one closes it while the other destroys its communicator): NCCL's deregister
    is called once, each deregister held open for dereg_delay s.  Each try a fresh
    communicator."""
    import faulthandler
    import random
    faulthandler.enable()
    p = _params()
    how, timeout, tries = p["how"], p["timeout"], p["tries"]
    put("dereg_delay", p.get("dereg_delay", 0.002))
    rng = random.Random(p.get("seed", 2))
    seen = {}
    for k in range(tries):
        c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=timeout)
        r = c.register(Array([1.0, 2.0, 3.0]))
        before = get("dereg_calls")
        start = threading.Barrier(2, timeout=LIFE_JOIN)
        results, bad = {}, []
        refusals = _destroy_refusals(c)
        destroyed = f"Registration.close: {_who(c)} has been destroyed"

        def closer(who):
            start.wait()
            time.sleep(rng.uniform(0, 0.0005))
            try:
                results[who] = r.close()
            except BaseException as e:  # noqa: BLE001 - checked
                seen[f"{type(e).__name__}: {e}"] = seen.get(f"{type(e).__name__}: {e}", 0) + 1
                ok = how == "destroy" and type(e) is RuntimeError and str(e) == destroyed
                results[who] = None if ok else f"{type(e).__name__}: {e}"

        def destroyer():
            start.wait()
            time.sleep(rng.uniform(0, 0.0005))
            deadline = time.monotonic() + LIFE_JOIN / 2
            while True:
                try:
                    c.destroy()
                    return
                except BaseException as e:  # noqa: BLE001 - checked
                    seen[f"{type(e).__name__}: {e}"] = seen.get(f"{type(e).__name__}: {e}", 0) + 1
                    if not (type(e) is RuntimeError and str(e) in refusals) or time.monotonic() > deadline:
                        bad.append(f"destroy: {type(e).__name__}: {e}")
                        return
                time.sleep(0.0002)

        second = (lambda: closer("second")) if how == "close" else destroyer
        ts = [threading.Thread(target=closer, args=("first",), name="first"),
              threading.Thread(target=second, name="second")]
        for t in ts:
            t.start()
        _join(ts)
        assert not bad, (k, bad)
        want = {"first": None, "second": None} if how == "close" else {"first": None}
        assert results == want, (k, results)
        assert r.closed, (k, r)
        deregs = get("dereg_calls") - before
        assert deregs == 1, f"try {k}: {deregs} deregister calls for one registration"
        c.destroy()
        assert get("dereg_calls") - before == 1, f"try {k}: destroy deregistered a closed registration"
        clean()
    put("dereg_delay", 0)
    return {"tries": tries, "dereg_calls": get("dereg_calls"), "seen": seen}


def premul_forced_algo():
    """premul_sum with algo='oneshot'/'twoshot' (NCCL's op only): refused before the op is
    made, so no ncclRedOpCreatePreMulSum (and no ncclRedOpDestroy outside the
    communicator's lock); the communicator works on."""
    p = _params()
    c = pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=p["timeout"])
    a = Array([1.0, 2.0])
    for algo in ("oneshot", "twoshot"):
        made = get("redop_creates")
        _expect(ValueError, f"all_reduce: algo='{algo}' supports SUM, MAX and MIN, not premul_sum",
                lambda: c.all_reduce(a, op=pyccl.premul_sum(2.0), algo=algo))
        assert get("redop_creates") == made, f"algo='{algo}': {get('redop_creates') - made} premul_sum ops made"
        assert get("redops") == 0, get("redops")
    assert a.tolist() == [1.0, 2.0], a.tolist()
    c.all_reduce(a, op=pyccl.premul_sum(2.0))  # without algo=: NCCL's, made and destroyed
    c.wait()
    assert get("redops") == 0 and get("redop_creates") >= 1
    assert not c.destroyed
    c.destroy()
    clean()
    return "ok"


if __name__ == "__main__":
    result = globals()[SCENARIO]()
    print("RESULT " + json.dumps(result), flush=True)
