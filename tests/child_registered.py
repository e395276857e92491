"""Scenarios of registered memory (csrc/memory.c, csrc/registration.c) on tests/fakegpu/fakegpu.c.

Run as `python child_registered.py LIBPATH SCENARIO` (tests/test_registered_cpu.py does):
child_fakegpu.py's set-up (a stub torch, pyccl._C pointed at the fake library) is imported,
then the scenario runs and prints "RESULT <json>".  The fake counts registrations, windows
and ncclMemAlloc memory, and anything used after it was freed or deregistered (misuse).
"""
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from child_fakegpu import Array, Tensor, clean, fake, get, put, pyccl  # noqa: E402

import json  # noqa: E402

_C = pyccl._C


def expect(exc, text, fn, *args):
    try:
        fn(*args)
    except exc as e:
        assert str(e) == text, f"{type(e).__name__}: {e!s}\n  wanted: {text}"
        assert type(e) is exc, (type(e), exc)
        return e
    raise AssertionError(f"no {exc.__name__}: {text}")


def counts():
    return {k: get(k) for k in ("registered", "windows", "nccl_mem_live", "reg_calls", "dereg_calls", "cumem_held")}


def comm(timeout=None, device=0):
    return pyccl.Communicator(1, pyccl.unique_id(), 0, device=device, timeout=timeout)


CAPTURE = "cannot register memory during CUDA graph capture; register before capturing"
NOT_CUMEM = ("register_window: the tensor's memory was not allocated with cuMem (torch's default caching "
             "allocator uses cudaMalloc); allocate it with pyccl.empty() or inside "
             "torch.cuda.use_mem_pool(pyccl.mem_pool())")


def lifecycle():
    """register/close/with, windows, refusals with exact messages, refcounts, destroy, abort, GC."""
    buf = _C._nccl_mem_alloc(64, 0)
    assert get("nccl_mem_live") == 1 and buf.nbytes == 64 and buf.device == 0 and buf.ptr != 0
    cai = buf.__cuda_array_interface__
    assert cai == {"version": 3, "shape": (64,), "typestr": "|u1", "data": (buf.ptr, False),
                   "strides": None, "stream": None}, cai
    assert repr(buf).startswith("<pyccl._C.NcclBuffer 64 bytes at 0x")
    c = comm()
    rc = sys.getrefcount(buf)
    h = c.register(buf)
    assert type(h) is pyccl.Registration and sys.getrefcount(buf) == rc + 1  # the handle keeps it
    assert (h.closed, h.window, h.nbytes, h.data_ptr) == (False, False, 64, buf.ptr)
    assert h.tensor is buf and h.communicator is c and h.handle != 0
    assert counts()["registered"] == 1 and "buffer 64 bytes" in repr(h)
    h.close()
    assert h.closed and counts()["registered"] == 0 and sys.getrefcount(buf) == rc
    h.close()  # idempotent
    assert counts()["dereg_calls"] == 1
    for what in ("handle", "tensor"):
        expect(RuntimeError, f"Registration.{what}: the registration is closed", getattr, h, what)
    expect(RuntimeError, "Registration.__enter__: the registration is closed", h.__enter__)
    with c.register(buf) as h2:
        assert get("registered") == 1 and not h2.closed
    assert h2.closed and get("registered") == 0

    # a window: sizes exchanged through an all_gather on the communicator, then registered
    ops = get("ops")
    w = c.register_window(buf)
    assert w.window and get("windows") == 1 and get("ops") == ops + 1, get("ops")
    assert get("cumem_held") == 0, "cuMemRetainAllocationHandle without cuMemRelease"
    assert "window 64 bytes" in repr(w)
    w.close()
    assert get("windows") == 0

    # refusals: exact messages, nothing registered, refcounts unchanged
    host = Array([1.0, 2.0, 3.0, 4.0])   # not ncclMemAlloc memory
    empty = Array([])
    other = Tensor([1.0], device=1)
    rows = [
        (c.register_window, host, ValueError, NOT_CUMEM),
        (c.register, empty, ValueError, "register: tensor has no bytes to register (0 elements)"),
        (c.register_window, empty, ValueError, "register_window: tensor has no bytes to register (0 elements)"),
        (c.register, other, ValueError, "register: tensor is on cuda:1 but the communicator (rank 0) is on cuda:0"),
        (c.register, 5, TypeError, None),
        (c.register_window, "x", TypeError, None),
    ]
    before = counts()
    for fn, arg, exc, text in rows:
        n = sys.getrefcount(arg)
        try:
            fn(arg)
        except exc as e:
            assert text is None or str(e) == text, f"{e!s}\n  wanted: {text}"
        else:
            raise AssertionError(f"{fn.__name__}({arg!r}) did not raise")
        assert sys.getrefcount(arg) == n, (fn.__name__, arg)
    after = counts()
    assert (after["registered"], after["windows"]) == (0, 0), after
    assert after["cumem_held"] == 0 and before["reg_calls"] == after["reg_calls"], (before, after)
    type_msgs = {}
    for fn in (c.register, c.register_window):
        try:
            fn(5)
        except TypeError as e:
            type_msgs[fn.__name__] = str(e)

    # during capture of the current stream: refused, nothing exchanged
    put("capturing", 1)
    ops = get("ops")
    expect(RuntimeError, "register: " + CAPTURE, c.register, buf)
    expect(RuntimeError, "register_window: " + CAPTURE, c.register_window, buf)
    put("capturing", 0)
    assert get("ops") == ops and get("registered") == 0
    # inside pyccl.group(): the exchange would only be queued, so refused too
    with pyccl.group():
        for fn in (c.register, c.register_window):
            expect(RuntimeError, f"{fn.__name__}: cannot register memory inside pyccl.group(); register before "
                   "the group", fn, buf)
    assert get("ops") == ops and get("registered") == 0

    # destroy() deregisters every open handle first
    r1, r2, w1 = c.register(buf), c.register(buf), c.register_window(buf)
    assert (get("registered"), get("windows")) == (2, 1)
    c.destroy()
    assert (get("registered"), get("windows")) == (0, 0) and r1.closed and r2.closed and w1.closed
    expect(RuntimeError, "Registration.handle: the registration was closed when its communicator "
           "(rank 0 of 1) was destroyed", getattr, w1, "handle")
    r1.close()  # still idempotent
    expect(RuntimeError, "register: the communicator (rank 0 of 1) has been destroyed", c.register, buf)
    expect(RuntimeError, "register_window: the communicator (rank 0 of 1) has been destroyed",
           c.register_window, buf)

    # abort() forgets them (NCCL's abort frees them): no deregister call on the dead handle
    c2 = comm()
    a1 = c2.register(buf)
    d = get("dereg_calls")
    c2.abort()
    assert a1.closed and get("dereg_calls") == d
    expect(RuntimeError, "Registration.tensor: the registration was closed when its communicator "
           "(rank 0 of 1) was aborted", getattr, a1, "tensor")
    put("registered", 0)  # what the abort freed

    # garbage collection: a dropped handle deregisters; a communicator held only by its
    # handles is destroyed (after them) once they go
    c3 = comm()
    g = c3.register(buf)
    del g
    assert get("registered") == 0
    destroys = get("destroys")
    g1, g2 = c3.register(buf), c3.register_window(buf)
    del c3
    gc.collect()
    assert get("destroys") == destroys and g1.communicator.handle != 0  # alive through its handles
    del g1, g2
    gc.collect()
    assert (get("registered"), get("windows"), get("destroys")) == (0, 0, destroys + 1)

    # a handle in a reference cycle with its tensor is collected, deregistering it
    c4 = comm()
    t = Tensor([1.0, 2.0])
    # Tensor's memory is not ncclMemAlloc's: register() does not care (NCCL decides)
    t.reg = c4.register(t)
    assert get("registered") == 1
    del t
    gc.collect()
    assert get("registered") == 0
    c4.destroy()

    # the buffer: freed with ncclMemFree once the last reference goes
    assert get("nccl_mem_live") == 1
    del buf, h, h2, w, w1, r1, r2, a1
    gc.collect()
    assert get("nccl_mem_live") == 0, get("nccl_mem_live")
    clean()
    return {"type_errors": type_msgs}


def timed():
    """A communicator with timeout= (NCCL non-blocking): ncclInProgress polled, bounded."""
    import time
    buf = _C._nccl_mem_alloc(256, 0)
    c = comm(timeout=5.0)
    put("reg_delay", 0.2)
    t0 = time.monotonic()
    h = c.register(buf)
    took = time.monotonic() - t0
    assert 0.2 <= took < 2, took
    w = c.register_window(buf)   # the exchange (first call: connects, polled) then the window
    assert (get("registered"), get("windows")) == (1, 1)
    h.close()
    w.close()
    assert (get("registered"), get("windows")) == (0, 0)
    # NCCL 2.28.9's window registration says ncclSuccess while the communicator is still in
    # progress: pyccl polls anyway, so the next call does not find it busy (a misuse here)
    put("reg_quiet", 1)
    t0 = time.monotonic()
    w = c.register_window(buf)
    assert time.monotonic() - t0 >= 0.2
    put("reg_quiet", 0)
    h2 = c.register(buf)  # the stand-in counts a call on a communicator still in progress as misuse
    assert get("misuse") == 0
    h2.close()
    w.close()
    r = c.register(buf)
    c.destroy()   # deregisters (polled), then finalizes
    assert r.closed and get("registered") == 0 and get("finalizes") == 1
    # a registration that never completes: the communicator fails after its timeout
    put("reg_delay", 0)
    put("reg_hang", 1)
    c2 = comm(timeout=0.5)
    t0 = time.monotonic()
    e = expect(pyccl.NcclTimeoutError, "register: rank 0 of 1 timed out after 0.5 s waiting for its peers; "
               "the communicator was aborted", c2.register, buf)
    took = time.monotonic() - t0
    assert 0.5 <= took < 1.5 and e.timeout == 0.5, took
    assert c2.destroyed and get("revokes") == 1
    put("reg_hang", 0)
    put("registered", 0)  # the hung one, freed by the abort
    c2.destroy()
    del buf, h, w, r, e
    gc.collect()
    assert get("nccl_mem_live") == 0
    clean()
    return took


def old_nccl():
    """An NCCL without the calls: each use names the call, the version needed and the loaded one."""
    v = int(os.environ["FAKE_VERSION"])
    loaded = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    c = comm()
    if v < 21900:
        expect(RuntimeError, f"empty: needs NCCL >= 2.19 for ncclMemAlloc; the loaded NCCL is {loaded}",
               _C._nccl_mem_alloc, 64, 0)
        expect(RuntimeError, f"mem_pool: needs NCCL >= 2.19 for ncclMemAlloc; the loaded NCCL is {loaded}",
               _C._mem_pool_functions)
        expect(RuntimeError, f"register: needs NCCL >= 2.19 for ncclCommRegister; the loaded NCCL is {loaded}",
               c.register, Array([1.0]))
    else:
        buf = _C._nccl_mem_alloc(64, 0)
        c.register(buf).close()
        assert _C._mem_pool_functions() == ("pyccl_nccl_pool_alloc", "pyccl_nccl_pool_free")
    expect(RuntimeError, f"register_window: needs NCCL >= 2.27 for ncclCommWindowRegister; the loaded NCCL "
           f"is {loaded}", c.register_window, Array([1.0]))
    expect(RuntimeError, f"shrink: needs NCCL >= 2.27 for ncclCommShrink; the loaded NCCL is {loaded}",
           c.shrink, [])
    c.destroy()
    clean()
    return loaded


def allocation_errors():
    """_nccl_mem_alloc's own checks (pyccl.empty checks first, with the same names)."""
    expect(ValueError, "empty: the size must be > 0 bytes, got 0", _C._nccl_mem_alloc, 0, 0)
    expect(ValueError, "empty: the size must be > 0 bytes, got -8", _C._nccl_mem_alloc, -8, 0)
    expect(ValueError, "empty: device 2 does not exist (this process sees 2 GPUs)", _C._nccl_mem_alloc, 8, 2)
    expect(ValueError, "empty: device -2 does not exist (this process sees 2 GPUs)", _C._nccl_mem_alloc, 8, -2)
    # -1: the current device (pyccl.empty's device=None)
    assert fake.cudaSetDevice(1) == 0
    cur = _C._nccl_mem_alloc(8, -1)
    assert cur.device == 1 and get("nccl_mem_live") == 1
    del cur
    assert get("nccl_mem_live") == 0 and fake.cudaSetDevice(0) == 0
    expect(TypeError, "_nccl_mem_alloc(nbytes: int, device: int)", _C._nccl_mem_alloc, 8.0, 0)
    expect(TypeError, "cannot create 'pyccl._C.NcclBuffer' instances", _C.NcclBuffer)
    expect(TypeError, "cannot create 'pyccl.Registration' instances", pyccl.Registration)
    b = _C._nccl_mem_alloc(8, 1)
    assert b.device == 1 and fake.cudaSetDevice(0) == 0
    assert get("nccl_mem_live") == 1
    del b
    assert get("nccl_mem_live") == 0
    clean()
    return "ok"


def window_sizes():
    """Two ranks (processes, FAKE_PEER_MEMORY): the exchange makes every rank raise together."""
    rank = int(os.environ["FAKE_RANK"])
    assert fake.cudaSetDevice(rank) == 0
    c = pyccl.Communicator(2, pyccl.unique_id(), rank, device=rank)
    seen = []
    # different sizes: the same ValueError on both ranks
    buf = _C._nccl_mem_alloc(4096 * (rank + 1), rank)
    e = expect(ValueError, "register_window: every rank must register the same number of bytes; "
               "rank 0: 4096, rank 1: 8192", c.register_window, buf)
    seen.append(str(e))
    same = _C._nccl_mem_alloc(4096, rank)
    w = c.register_window(same)
    assert get("windows") == 1
    # rank 1 gives memory that is not cuMem's: it says what to do, rank 0 says who
    arg = Array([1.0] * 1024) if rank == 1 else same
    if rank == 1:
        e = expect(ValueError, NOT_CUMEM, c.register_window, arg)
    else:
        e = expect(ValueError, "register_window: rank 1 gave memory that was not allocated with cuMem (see the "
                   "error on that rank); nothing was registered", c.register_window, arg)
    seen.append(str(e))
    # rank 0 refuses its argument (no bytes): rank 1 raises too, instead of waiting
    arg = Array([]) if rank == 0 else same
    if rank == 0:
        e = expect(ValueError, "register_window: tensor has no bytes to register (0 elements)",
                   c.register_window, arg)
    else:
        e = expect(RuntimeError, "register_window: rank 0 refused its tensor (see the error on that rank); "
                   "nothing was registered", c.register_window, arg)
    seen.append(str(e))
    assert get("windows") == 1 and get("cumem_held") == 0
    w.close()
    c.destroy()
    clean()
    return seen


if __name__ == "__main__":
    result = globals()[sys.argv[2]]()
    print("RESULT " + json.dumps(result), flush=True)
