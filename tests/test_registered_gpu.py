"""GPU tier of registered memory: pyccl.empty, pyccl.mem_pool, Communicator.register and
register_window on real NCCL (>= 2.27 for windows).

One rank: in this process.  Two or more ranks: one spawned process per rank
(tests/_registered.py's scenarios, through the one spawn harness), sharing GPUs where ranks
outnumber them.
"""
import gc
import re

import pytest
import torch

import _registered as rg
from _data import same_bits
from _ranks import run_ranks
from conftest import gpu_count, needs_gpus, needs_ranks

pyccl = pytest.importorskip("pyccl")

W = max(2, min(gpu_count(), 8))
NOT_CUMEM = ("register_window: the tensor's memory was not allocated with cuMem (torch's default caching "
             "allocator uses cudaMalloc); allocate it with pyccl.empty() or inside "
             "torch.cuda.use_mem_pool(pyccl.mem_pool())")
CAPTURE = "cannot register memory during CUDA graph capture; register before capturing"


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def needs_windows():
    if gpu_count() >= 1 and pyccl.nccl.version() < (2, 27, 0):
        pytest.skip(f"windows need NCCL >= 2.27, this is {pyccl.nccl.version()}")


@pytest.fixture
def comm():
    torch.cuda.set_device(0)
    c = pyccl.Communicator(1, pyccl.unique_id(), 0)
    yield c
    c.destroy()


# ---------------------------------------------------------------- pyccl.empty

@needs_gpus(1)
@pytest.mark.parametrize("shape,dtype", [((7,), torch.float32), ((3, 5), torch.bfloat16), ((1023,), torch.int32),
                                         ((2, 3, 4), torch.float16), ((), torch.float64), ((9,), torch.uint8),
                                         ((5,), torch.float8_e4m3fn), ((4, 1), torch.complex64),
                                         (((1 << 20) + 3,), torch.int8)])
def test_empty_shape_dtype_device_and_data(shape, dtype):
    torch.cuda.set_device(0)
    t = pyccl.empty(shape, dtype=dtype)
    assert tuple(t.shape) == shape and t.dtype == dtype and t.device == torch.device("cuda", 0)
    assert t.is_contiguous() and t.data_ptr() != 0 and t.data_ptr() % 256 == 0
    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 100, shape, generator=g).float().to(dtype)  # whole numbers; fp8 rounds some
    t.copy_(src.to("cuda:0"))
    torch.cuda.synchronize()
    # as bytes, flat: a 0-dim tensor has no uint8 view of its own
    assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8))


@needs_gpus(2, "memory on a second GPU")
def test_empty_on_another_device_keeps_the_current_one():
    torch.cuda.set_device(0)
    t = pyccl.empty(1000, device=1)
    assert t.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
    t.fill_(5)
    assert int(t.sum().item()) == 5000
    u = pyccl.empty(10, device="cuda:1")
    assert u.device.index == 1


@needs_gpus(1)
def test_empty_freed_with_the_last_view():
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    gc.collect()
    free0 = torch.cuda.mem_get_info(0)[0]
    n = 512 << 20
    t = pyccl.empty(n, dtype=torch.uint8)
    free1 = torch.cuda.mem_get_info(0)[0]
    assert free0 - free1 >= n, (free0, free1)
    view = t[1:].view(-1)   # keeps the memory, as a view of the storage
    del t
    gc.collect()
    assert torch.cuda.mem_get_info(0)[0] <= free1 + (64 << 20)
    view[0] = 3
    assert view[0].item() == 3
    del view
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info(0)[0] >= free0 - (64 << 20), "ncclMemFree did not run"


# ---------------------------------------------------------------- register

@needs_gpus(1)
def test_register_lifecycle(comm):
    t = torch.arange(4096, dtype=torch.float32, device="cuda:0")
    h = comm.register(t)
    assert (h.closed, h.window, h.nbytes, h.data_ptr) == (False, False, 4 * 4096, t.data_ptr())
    assert h.tensor is t and h.communicator is comm and h.handle != 0
    comm.all_reduce(t, algo="nccl")
    torch.cuda.synchronize()
    assert same_bits(t, torch.arange(4096, dtype=torch.float32, device="cuda:0"))
    h.close()
    h.close()
    assert h.closed
    with raises(RuntimeError, "Registration.handle: the registration is closed"):
        h.handle
    with comm.register(t) as h2:
        assert not h2.closed
    assert h2.closed
    keep = [comm.register(t), comm.register(pyccl.empty(100))]
    comm.destroy()
    assert all(k.closed for k in keep)
    with raises(RuntimeError, "Registration.tensor: the registration was closed when its communicator "
                              "(rank 0 of 1) was destroyed"):
        keep[0].tensor


@needs_gpus(1)
def test_window_all_reduce_one_rank(comm):
    needs_windows()
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for count in (1, 7, 1023, (1 << 20) + 3):
            t = pyccl.empty(count, dtype=dtype)
            src = (torch.arange(count, device="cuda:0") % 251).to(dtype)
            t.copy_(src)
            with comm.register_window(t) as w:
                assert w.window and w.nbytes == count * t.element_size()
                comm.all_reduce(t, algo="nccl")
                torch.cuda.synchronize()
                assert same_bits(t, src), (dtype, count)


@needs_gpus(1)
def test_window_all_reduce_in_a_cuda_graph(comm):
    needs_windows()
    n = 65536 + 5
    a, out = pyccl.empty(n, dtype=torch.int32), pyccl.empty(n, dtype=torch.int32)
    wa, wo = comm.register_window(a), comm.register_window(out)
    a.copy_(torch.arange(n, dtype=torch.int32, device="cuda:0"))
    comm.all_reduce(a, out=out, algo="nccl")   # eager first
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        comm.all_reduce(a, out=out, algo="nccl")
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    for k in range(5):
        want = torch.arange(n, dtype=torch.int32, device="cuda:0") * (k + 2) - k
        a.copy_(want)        # rewritten between replays
        out.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(out, want), k
    del g
    wa.close()
    wo.close()


@needs_gpus(1)
def test_window_on_caching_allocator_memory_refused(comm):
    needs_windows()
    t = torch.empty(4096, device="cuda:0")
    with raises(ValueError, NOT_CUMEM):
        comm.register_window(t)
    comm.all_reduce(t, algo="nccl")   # still usable


@needs_gpus(1)
def test_registration_during_capture_refused(comm):
    t = pyccl.empty(4096)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    errors = []
    with torch.cuda.stream(s):
        g.capture_begin()
        for fn in (comm.register, comm.register_window):
            try:
                fn(t)
            except RuntimeError as e:
                errors.append(str(e))
        g.capture_end()
    assert errors == ["register: " + CAPTURE, "register_window: " + CAPTURE]
    del g
    with comm.register(t):   # fine outside the capture
        pass


@needs_gpus(1)
def test_mem_pool_tensors_can_be_windows(comm):
    needs_windows()
    pool = pyccl.mem_pool()
    assert pool is pyccl.mem_pool() and isinstance(pool, torch.cuda.MemPool)
    with torch.cuda.use_mem_pool(pool):
        t = torch.arange(100_000, dtype=torch.float32, device="cuda:0")
        big = torch.ones(3 << 20, dtype=torch.float32, device="cuda:0")  # a large-pool segment
    for x in (t, big):
        want = x.clone()
        with comm.register_window(x):
            comm.all_reduce(x, algo="nccl")
            torch.cuda.synchronize()
            assert same_bits(x, want)
    # plain allocations outside the block still come from torch's allocator
    with raises(ValueError, NOT_CUMEM):
        comm.register_window(torch.empty(4096, device="cuda:0"))


@needs_gpus(1)
def test_non_blocking_communicator_and_abort():
    """timeout= (NCCL non-blocking): registration polled to completion; abort() forgets the
    handles (NCCL frees them with the communicator), which then say why they are closed."""
    needs_windows()
    torch.cuda.set_device(0)
    c = pyccl.Communicator(1, pyccl.unique_id(), 0, timeout=60)
    t = pyccl.empty(8192, dtype=torch.int32)
    t.copy_(torch.arange(8192, dtype=torch.int32))
    r, w = c.register(t), c.register_window(t)
    c.all_reduce(t, algo="nccl")
    c.wait()
    assert same_bits(t, torch.arange(8192, dtype=torch.int32, device="cuda:0"))
    r.close()
    c.abort()
    assert w.closed
    with raises(RuntimeError, "Registration.handle: the registration was closed when its communicator "
                              "(rank 0 of 1) was aborted"):
        w.handle
    w.close()  # nothing left to do
    c.destroy()


# ---------------------------------------------------------------- 2+ ranks

@needs_ranks(2)
def test_windows_of_different_sizes_refused_on_every_rank():
    needs_windows()
    res = run_ranks(rg.sizes_differ, W)
    assert len(set(res.values())) == 1, res


@needs_ranks(2)
def test_windows_bitwise_equal_to_plain_memory():
    needs_windows()
    res = run_ranks(rg.windows_match_plain_memory, W, timeout=400)
    assert all(n == len(rg.DTYPES) * len(rg.COUNTS) * 3 for n in res.values()), res


@needs_ranks(2)
def test_windows_random_data_within_float32_tolerance():
    needs_windows()
    res = run_ranks(rg.random_data, W)
    assert len(res) == W


@needs_ranks(2)
def test_10000_calls_on_a_window():
    needs_windows()
    res = run_ranks(rg.many_calls, W, timeout=400)
    assert all(n == 10_000 // 97 + 2 for n in res.values()), res
