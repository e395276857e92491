"""CPU tier of pyccl.nccl: import, API surface, ids and versions.

Runs without a GPU.  The bad-input paths, with their exact texts, are in
test_bad_input.py; the tests here that need to get past torch's "cuda dense"
check use FakeCuda (conftest.py), host memory that reports itself as CUDA, so
they only ever reach the validation, never NCCL.
"""
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import pyccl
from pyccl import nccl
from conftest import gpu_count
from _fakes import FakeCuda, fake


# ---------------- import and API surface ----------------

def test_import_without_gpu_in_a_fresh_process():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", "import pyccl, pyccl.nccl; print(pyccl.nccl.version())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"\(2, \d+, \d+\)\n", out.stdout)


def test_public_api_matches_torch_cuda_nccl():
    import torch.cuda.nccl as tn
    assert nccl.__all__ == tn.__all__
    def shape(fn):  # names, kinds and defaults; torch's annotations aside
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in tn.__all__ + ["version", "unique_id", "init_rank", "is_available"]:
        assert shape(getattr(nccl, name)) == shape(getattr(tn, name)), name
    assert nccl.SUM == tn.SUM == 0
    assert (nccl.PROD, nccl.MAX, nccl.MIN, nccl.AVG) == (1, 2, 3, 4)
    assert (pyccl.SUM, pyccl.AVG, pyccl.NCCL_UNIQUE_ID_BYTES) == (0, 4, 128)
    assert issubclass(pyccl.NcclError, RuntimeError) and issubclass(pyccl.CudaError, RuntimeError)


def _library_version_code():
    """ncclGetVersion of the library pyccl loaded, asked through ctypes, not through pyccl."""
    import ctypes
    lib = ctypes.CDLL(pyccl._C._library_paths()[0])
    code = ctypes.c_int(-1)
    assert lib.ncclGetVersion(ctypes.byref(code)) == 0
    return code.value


def test_version_is_the_loaded_library():
    v = nccl.version()
    assert len(v) in (3, 4) and all(isinstance(x, int) for x in v[:3])
    path = pyccl._C._library_paths()[0]
    assert os.path.basename(path).startswith("libnccl.so")
    code = _library_version_code()
    assert code >= 20900  # the 2.9+ encoding below
    assert v[:3] == (code // 10000, code // 100 % 100, code % 100)
    assert pyccl._C._nccl_version() == code
    if gpu_count() > 0:  # torch's own answer for the same library (needs torch with CUDA)
        import torch.cuda.nccl as tn
        assert v[:3] == tuple(tn.version()[:3])


def test_unique_id_bytes_and_fresh():
    a, b = nccl.unique_id(), pyccl.unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and len(b) == 128
    assert a != b


def test_is_available():
    assert nccl.is_available([fake(3, 0), fake(3, 1)])
    assert not nccl.is_available([fake(3, 0), fake(3, 0)])
    assert not nccl.is_available([torch.ones(3)])
    assert not nccl.is_available([FakeCuda(torch.ones(4, 4), 0).t()])


@pytest.mark.skipif(gpu_count() > 0, reason="checks the no-GPU message; this machine has a GPU")
def test_init_rank_without_gpu_raises_clearly():
    with pytest.raises(pyccl.CudaError, match=r"^init_rank: no CUDA GPU is available \(cudaGetDeviceCount: "):
        nccl.init_rank(1, nccl.unique_id(), 0)
    # and the process goes on
    assert len(nccl.unique_id()) == 128


def test_refcounts_unchanged_after_errors():
    ins = [fake(4, 0), fake(4, 0)]
    outs = [fake(4, 0), fake(4, 1)]
    streams = [None, None]
    before = [sys.getrefcount(x) for x in (ins, outs, streams, ins[0], ins[1], outs[0], outs[1])]
    for _ in range(50):
        with pytest.raises(RuntimeError):
            nccl.all_reduce(ins, outs, streams=streams)
        with pytest.raises(RuntimeError):
            nccl.all_gather(ins, outs)
        with pytest.raises(ValueError):
            nccl.all_reduce(ins, outs, op="x")
        with pytest.raises(TypeError):
            nccl.all_reduce(ins, outs, op=1.5)
    after = [sys.getrefcount(x) for x in (ins, outs, streams, ins[0], ins[1], outs[0], outs[1])]
    assert before == after


def test_process_usable_after_errors():
    for _ in range(3):
        with pytest.raises(RuntimeError):
            nccl.all_reduce([fake(4, 0), fake(4, 0)])
    assert len(nccl.unique_id()) == 128
    code = _library_version_code()
    assert nccl.version()[:3] == (code // 10000, code // 100 % 100, code % 100)


def test_sequence_type_error_is_torchs_own_text():
    """Where torch.cuda.nccl's check is plain Python (no GPU needed), the drop-in raises
    the same type and text, asked of torch rather than copied here."""
    import torch.cuda.nccl as tn
    for bad in (torch.ones(3), 5):
        for name in tn.__all__:
            extra = ([fake(3)],) if name in ("all_gather", "reduce_scatter") else ()
            with pytest.raises(Exception) as want:
                getattr(tn, name)(bad, *extra)
            with pytest.raises(Exception) as got:
                getattr(nccl, name)(bad, *extra)
            assert (type(got.value), str(got.value)) == (type(want.value), str(want.value)), (name, bad)
