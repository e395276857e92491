"""CPU tier of registered memory: pyccl.empty, pyccl.mem_pool, Communicator.register and
register_window (csrc/memory.c, csrc/registration.c, pyccl/memory.py).

The API surface and empty()'s argument checks need nothing; the rest runs against the
stand-in GPU library tests/fakegpu/fakegpu.c (tests/child_registered.py's scenarios, each in
its own process), which counts registrations, windows and ncclMemAlloc memory, answers the
driver's cuMemRetainAllocationHandle for its own allocations (linked as libcuda.so.1), and is
built three more ways: as NCCL 2.18 and 2.19 (calls missing), and with FAKE_PEER_MEMORY, where
two processes are the two ranks of one communicator.
"""
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

import pyccl

HERE = os.path.dirname(os.path.abspath(__file__))


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


# ---------------------------------------------------------------- surface

def test_api_surface():
    for name in ("empty", "mem_pool", "Registration"):
        assert name in pyccl.__all__ and hasattr(pyccl, name), name
    assert pyccl.Registration is pyccl._C.Registration
    assert pyccl.Registration.__module__ == "pyccl"
    sig = inspect.signature(pyccl.empty)
    assert [(p.name, p.default) for p in sig.parameters.values()] == \
        [("shape", inspect.Parameter.empty), ("dtype", torch.float32), ("device", None)]
    assert "Tensor" in str(sig.return_annotation)
    assert str(inspect.signature(pyccl.Communicator.register)) == "(self, tensor, /)"
    assert str(inspect.signature(pyccl.Communicator.register_window)) == "(self, tensor, /)"
    for name in ("register", "register_window"):
        doc = getattr(pyccl.Communicator, name).__doc__
        assert "capture" in doc and "NCCL >=" in doc, name
    for name in ("close", "handle", "closed", "window", "nbytes", "data_ptr", "tensor", "communicator"):
        assert getattr(pyccl.Registration, name).__doc__, name
    assert "ncclMemAlloc" in pyccl.empty.__doc__ and "use_mem_pool" in pyccl.mem_pool.__doc__


def test_allocator_functions_are_exported():
    """torch's CUDAPluggableAllocator finds them with dlsym in _C's shared object."""
    import ctypes
    lib = ctypes.CDLL(pyccl._C.__file__)
    for name in ("pyccl_nccl_pool_alloc", "pyccl_nccl_pool_free"):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value, name
    nm = shutil.which("nm")
    if nm:
        out = subprocess.run([nm, "-D", "--defined-only", pyccl._C.__file__], capture_output=True,
                             text=True).stdout
        for name in ("pyccl_nccl_pool_alloc", "pyccl_nccl_pool_free"):
            assert re.search(rf" T {name}$", out, re.M), name


BAD_EMPTY = [
    ((-1,), {}, ValueError, "empty: shape must not hold negative sizes, got (-1,)"),
    (((2, -3),), {}, ValueError, "empty: shape must not hold negative sizes, got (2, -3)"),
    (((4, 0),), {}, ValueError, "empty: the tensor must have at least one element, got shape (4, 0)"),
    ((0,), {}, ValueError, "empty: the tensor must have at least one element, got shape (0,)"),
    (("4",), {}, TypeError, "empty: shape must be an int or a sequence of ints, got str"),
    ((4.0,), {}, TypeError, "empty: shape must be an int or a sequence of ints, got float"),
    ((True,), {}, TypeError, "empty: shape must be an int or a sequence of ints, got True"),
    (((2, 2.5),), {}, TypeError, "empty: shape must hold ints, got float in (2, 2.5)"),
    (((2, None),), {}, TypeError, "empty: shape must hold ints, got NoneType in (2, None)"),
    ((4,), {"dtype": "float32"}, TypeError, "empty: dtype must be a torch.dtype, got str"),
    ((4,), {"dtype": float}, TypeError, "empty: dtype must be a torch.dtype, got type"),
    ((4,), {"device": "cpu"}, ValueError, "empty: device must be a CUDA device ('cuda:N'), got 'cpu'"),
    ((4,), {"device": torch.device("cpu")}, ValueError,
     "empty: device must be a CUDA device ('cuda:N'), got 'cpu'"),
    ((4,), {"device": "gpu0"}, ValueError, "empty: device must be a CUDA device ('cuda:N'), got 'gpu0'"),
    ((4,), {"device": -1}, ValueError, "empty: device must be >= 0, got -1"),
    ((4,), {"device": 1.0}, TypeError, "empty: device must be an int, 'cuda:N' or a CUDA torch.device, got float"),
    ((4,), {"device": True}, TypeError,
     "empty: device must be an int, 'cuda:N' or a CUDA torch.device, got bool"),
    (((1 << 40, 1 << 40),), {}, ValueError,
     "empty: 4835703278458516698824704 bytes (shape (1099511627776, 1099511627776), torch.float32) is too large"),
]


@pytest.mark.parametrize("args,kw,exc,text", BAD_EMPTY, ids=[t for *_, t in BAD_EMPTY])
def test_empty_refuses_before_any_gpu(args, kw, exc, text):
    with raises(exc, text):
        pyccl.empty(*args, **kw)
    objs = [a for a in list(args) + list(kw.values()) if not isinstance(a, (int, str, type))]
    refs = [sys.getrefcount(a) for a in objs]
    for _ in range(3):
        try:
            pyccl.empty(*args, **kw)
        except exc:
            pass  # the exception and its frames go at the end of this block
    assert refs == [sys.getrefcount(a) for a in objs]


# ---------------------------------------------------------------- the fake GPU

def _cc():
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]}) to build the fake GPU library")
    return cc


def _build(d, name, *defines):
    out = str(d / name)
    r = subprocess.run(_cc() + ["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", *defines, "-o", out,
                                os.path.join(HERE, "fakegpu", "fakegpu.c"), "-lpthread", "-lm"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    os.symlink(out, d / "libcuda.so.1")  # the driver (cuMemRetainAllocationHandle), by LD_LIBRARY_PATH
    return out


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    libs = {}
    for key, defines in {"plain": [], "peer": ["-DFAKE_PEER_MEMORY"], "2.18": ["-DFAKE_NCCL_VERSION=21806"],
                         "2.19": ["-DFAKE_NCCL_VERSION=21903"]}.items():
        libs[key] = _build(tmp_path_factory.mktemp("fake" + key.replace(".", "_")), "libfakegpu.so", *defines)
    return libs


def _env(lib, **extra):
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(lib) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
               **extra)
    env.pop("PYTHONPATH", None)
    return env


def _result(rc, out, err, what):
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    at_exit = [json.loads(line[8:]) for line in out.splitlines() if line.startswith("AT_EXIT ")]
    assert rc == 0 and results, f"{what} failed (rc {rc}):\n{out[-3000:]}\n{err[-3000:]}"
    assert at_exit and at_exit[0]["misuse"] == 0 and at_exit[0]["concurrent"] == 0, at_exit
    return results[0]


def run(lib, scenario, timeout=60, **env):
    r = subprocess.run([sys.executable, os.path.join(HERE, "child_registered.py"), lib, scenario],
                       capture_output=True, text=True, timeout=timeout, env=_env(lib, **env))
    return _result(r.returncode, r.stdout, r.stderr, scenario)


def test_lifecycle_and_refusals(fakes):
    res = run(fakes["plain"], "lifecycle")
    assert res["type_errors"]["register"].startswith("register: tensor must be"), res
    assert res["type_errors"]["register_window"].startswith("register_window: tensor must be"), res


def test_non_blocking_communicator(fakes):
    took = run(fakes["plain"], "timed")
    assert 0.5 <= took < 1.5


def test_allocation_errors(fakes):
    run(fakes["plain"], "allocation_errors")


@pytest.mark.parametrize("version", ["2.18", "2.19"])
def test_nccl_too_old(fakes, version):
    code = {"2.18": "21806", "2.19": "21903"}[version]
    assert run(fakes[version], "old_nccl", FAKE_VERSION=code) == f"{version}.{int(code) % 100}"


def test_window_sizes_agree_on_every_rank(fakes, tmp_path):
    lib = fakes["peer"]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "child_registered.py"), lib, "window_sizes"],
                              env=_env(lib, FAKE_XPROC_DIR=str(tmp_path), FAKE_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    seen = [_result(*o, f"rank {r}") for r, o in enumerate(outs)]
    # the size mismatch: one message, the same on both ranks
    assert seen[0][0] == seen[1][0]


def test_empty_wraps_the_buffer_zero_copy(monkeypatch):
    """empty() hands the buffer object itself to torch.as_tensor on its device (torch then
    holds it in the tensor's deleter: tensor_from_cuda_array_interface INCREFs the object and
    the from_blob deleter DECREFs it) and only views the bytes: no copy, no other reference."""
    import pyccl.memory as mem

    class Buf:
        def __init__(self, nbytes, device):
            self.nbytes, self.device = nbytes, device

    seen = []

    class FakeC:
        _read_device = staticmethod(pyccl._C._read_device)

        @staticmethod
        def _nccl_mem_alloc(nbytes, device):
            b = Buf(nbytes, device)
            seen.append(b)
            return b

    def as_tensor(obj, device=None):
        seen.append((obj, device))
        return torch.zeros(obj.nbytes, dtype=torch.uint8)  # a host stand-in for the CUDA bytes

    monkeypatch.setattr(mem, "_C", FakeC)
    monkeypatch.setattr(mem, "need_gpu", lambda op: 4)  # a machine with 4 GPUs
    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    for shape, dtype, dev in [((3, 5), torch.float32, 1), (7, torch.bfloat16, 0), ((), torch.float64, 2),
                              ((2, 3, 4), torch.int8, 0), ([4, 1], torch.complex64, 1), (3, torch.bool, 0)]:
        seen.clear()
        t = pyccl.empty(shape, dtype=dtype, device=dev)
        want = (shape,) if isinstance(shape, int) else tuple(shape)
        assert t.dtype == dtype and tuple(t.shape) == want
        buf, (obj, device) = seen
        assert obj is buf and device == torch.device("cuda", dev)
        assert buf.nbytes == t.numel() * dtype.itemsize and buf.device == dev
    seen.clear()
    pyccl.empty(4, device="cuda:3")
    assert seen[0].device == 3


def test_empty_without_numpy_says_so_before_allocating(monkeypatch):
    import pyccl.memory as mem
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy raises ImportError

    class NoAlloc:
        _read_device = staticmethod(pyccl._C._read_device)

        @staticmethod
        def _nccl_mem_alloc(nbytes, device):
            raise AssertionError("allocated")
    monkeypatch.setattr(mem, "_C", NoAlloc)
    monkeypatch.setattr(mem, "need_gpu", lambda op: 1)  # a machine with a GPU
    with raises(RuntimeError, "empty: torch.as_tensor needs NumPy to wrap the memory (__cuda_array_interface__); "
                              "pip install numpy"):
        pyccl.empty(4, device=0)
