"""CPU tier of pyccl.nccl: import, API surface and every bad-input path.

Runs without a GPU.  Checks that must get past torch's "cuda dense" test use
FakeCuda, a torch.Tensor subclass that reports itself as a CUDA tensor through
the same Python attributes pyccl reads (is_cuda, get_device()); its memory is
host memory, so these tests only ever reach the validation, never NCCL.
"""
import inspect
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import pyccl
from pyccl import nccl
from conftest import gpu_count


class FakeCuda(torch.Tensor):
    @staticmethod
    def __new__(cls, data, device=0):
        t = torch.Tensor._make_subclass(cls, data)
        t._fake_device = device
        return t

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return self._fake_device


def fake(n=4, device=0, dtype=torch.float32):
    return FakeCuda(torch.arange(n).to(dtype), device)


def raises(exc, text):
    """pytest.raises for an exact message."""
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


COLLECTIVES = {
    "all_reduce": lambda ins, **kw: nccl.all_reduce(ins, **kw),
    "reduce": lambda ins, **kw: nccl.reduce(ins, **kw),
    "broadcast": lambda ins, **kw: nccl.broadcast(ins, **kw),
    "all_gather": lambda ins, **kw: nccl.all_gather(ins, kw.pop("outputs", [fake(8, d) for d in range(len(ins))]), **kw),
    "reduce_scatter": lambda ins, **kw: nccl.reduce_scatter(ins, kw.pop("outputs", [fake(2, d) for d in range(len(ins))]), **kw),
}


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


def test_version_is_the_loaded_library():
    v = nccl.version()
    assert len(v) in (3, 4) and all(isinstance(x, int) for x in v[:3])
    code = pyccl._C._nccl_version()
    assert code == v[0] * 10000 + v[1] * 100 + v[2]
    path = pyccl._C._library_paths()[0]
    assert os.path.basename(path).startswith("libnccl.so")


def test_unique_id_bytes_and_fresh():
    a, b = nccl.unique_id(), pyccl.unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and len(b) == 128
    assert a != b


def test_is_available():
    assert nccl.is_available([fake(3, 0), fake(3, 1)])
    assert not nccl.is_available([fake(3, 0), fake(3, 0)])
    assert not nccl.is_available([torch.ones(3)])
    assert not nccl.is_available([FakeCuda(torch.ones(4, 4), 0).t()])


# ---------------- torch's error table, exact type and text ----------------

@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_bare_tensor(name):
    with raises(TypeError, "Inputs should be a collection of tensors"):
        COLLECTIVES[name](fake())


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_non_tensor_item(name):
    with raises(TypeError, "expected Tensor at 1 (got int)"):
        COLLECTIVES[name]([fake(), 3])


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_empty_sequence(name):
    with raises(RuntimeError, "input sequence can't be empty"):
        COLLECTIVES[name]([], **({"outputs": []} if name in ("all_gather", "reduce_scatter") else {}))


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_cpu_tensor(name):
    with raises(RuntimeError, "input and output elements have to be cuda dense Tensors"):
        COLLECTIVES[name]([torch.ones(4)])


def test_sparse_tensor():
    with raises(RuntimeError, "input and output elements have to be cuda dense Tensors"):
        nccl.all_reduce([torch.ones(4).to_sparse()])


def test_outputs_of_other_length():
    with raises(RuntimeError, "inputs and outputs sequences have to be of the same length, "
                              "but got input of length 2 and output of length 1"):
        nccl.all_reduce([fake(4, 0), fake(4, 1)], [fake(4, 0)])


def test_mixed_dtypes():
    with raises(RuntimeError, "all inputs and outputs must be of the same Tensor dtype"):
        nccl.all_reduce([fake(4, 0), fake(4, 1, torch.float64)])
    with raises(RuntimeError, "all inputs and outputs must be of the same Tensor dtype"):
        nccl.all_reduce([fake(4, 0)], [fake(4, 0, torch.int32)])


def test_non_contiguous():
    nc = FakeCuda(torch.ones(4, 4), 1).t()
    with raises(RuntimeError, "all inputs and outputs have to be contiguous"):
        nccl.all_reduce([fake(16, 0), nc])


def test_different_sizes():
    with raises(RuntimeError, "all inputs must have the same number of elements"):
        nccl.all_reduce([fake(4, 0), fake(5, 1)])


def test_two_tensors_on_one_device():
    with raises(RuntimeError, "inputs must be on unique devices"):
        nccl.all_reduce([fake(4, 0), fake(4, 0)])


def test_input_output_other_device():
    with raises(RuntimeError, "input and output must be on the same device"):
        nccl.all_reduce([fake(4, 0)], [fake(4, 1)])


def test_wrong_output_size():
    with raises(RuntimeError, "output must be of size input_size * size_multiplier"):
        nccl.all_reduce([fake(4, 0)], [fake(5, 0)])
    with raises(RuntimeError, "output must be of size input_size * size_multiplier"):
        nccl.all_gather([fake(4, 0), fake(4, 1)], [fake(4, 0), fake(4, 1)])
    with raises(RuntimeError, "output must be of size input_size * size_multiplier"):
        nccl.reduce_scatter([fake(4, 0), fake(4, 1)], [fake(4, 0), fake(4, 1)])
    with raises(RuntimeError, "output must be of size input_size * size_multiplier"):
        nccl.reduce([fake(4, 0), fake(4, 1)], fake(3, 0))


@pytest.mark.parametrize("root", [-1, 2, 1 << 20])
def test_bad_root(root):
    with raises(RuntimeError, "invalid root"):
        nccl.reduce([fake(4, 0), fake(4, 1)], root=root)
    with raises(RuntimeError, "invalid root"):
        nccl.broadcast([fake(4, 0), fake(4, 1)], root=root)


def test_root_type_and_overflow():
    with raises(TypeError, "broadcast: root must be an int, got str"):
        nccl.broadcast([fake(4, 0)], root="0")
    with raises(ValueError, "broadcast: root=18446744073709551616 is out of range"):
        nccl.broadcast([fake(4, 0)], root=1 << 64)


def test_streams_of_other_length():
    with raises(RuntimeError, "number of streams is not equal to number of inputs"):
        nccl.all_reduce([fake(4, 0), fake(4, 1)], streams=[None])


def test_comms_of_other_length():
    with raises(RuntimeError, "number of communicators is not equal to number of inputs"):
        nccl.all_reduce([fake(4, 0), fake(4, 1)], comms=[None, None, None])


@pytest.mark.parametrize("n", [0, 1, 127, 129])
def test_uid_wrong_length(n):
    with raises(RuntimeError, f"invalid unique_id (expected 128 bytes, got {n})"):
        nccl.init_rank(1, b"u" * n, 0)


def test_uid_wrong_type():
    with raises(TypeError, "init_rank: unique_id must be bytes (from unique_id()), got str"):
        nccl.init_rank(1, "u" * 128, 0)
    with raises(TypeError, "init_rank: unique_id must be bytes (from unique_id()), got int"):
        nccl.init_rank(1, 5, 0)


def test_init_rank_bad_ranks():
    uid = nccl.unique_id()
    with raises(ValueError, "init_rank: world_size must be >= 1, got 0"):
        nccl.init_rank(0, uid, 0)
    with raises(ValueError, "init_rank: rank 2 is out of range for world_size 2 (ranks are 0..1)"):
        nccl.init_rank(2, uid, 2)
    with raises(TypeError, "init_rank: rank must be an int, got float"):
        nccl.init_rank(2, uid, 1.0)
    with raises(ValueError, "Communicator: device must be >= 0, got -1") if gpu_count() else \
            pytest.raises(pyccl.CudaError):
        pyccl.Communicator(1, uid, 0, device=-1)


@pytest.mark.skipif(gpu_count() > 0, reason="checks the no-GPU message; this machine has a GPU")
def test_init_rank_without_gpu_raises_clearly():
    with pytest.raises(pyccl.CudaError, match=r"^init_rank: no CUDA GPU is available \(cudaGetDeviceCount: "):
        nccl.init_rank(1, nccl.unique_id(), 0)
    # and the process goes on
    assert len(nccl.unique_id()) == 128


@pytest.mark.parametrize("dtype,name", [(torch.complex64, "ComplexFloat"), (torch.int16, "Short"),
                                        (torch.complex128, "ComplexDouble"), (torch.uint16, "UInt16")])
def test_unsupported_dtype(dtype, name):
    for fn in (nccl.all_reduce, lambda ins: nccl.reduce(ins), lambda ins: nccl.reduce_scatter(ins, [fake(4, 0, dtype)])):
        with raises(RuntimeError, f"Unconvertible NCCL type {name}"):
            fn([fake(4, 0, dtype)])


def test_bool_reduction_refused():
    with raises(RuntimeError, "all_reduce: cannot reduce torch.bool tensors (NCCL has no boolean reduction); "
                              "convert to torch.uint8 first"):
        nccl.all_reduce([fake(4, 0, torch.bool)])


@pytest.mark.parametrize("op", [5, 99, -1])
def test_wrong_op_value(op):
    with raises(ValueError, f"all_reduce: op={op} is not a reduction op (SUM=0, PROD=1, MAX=2, MIN=3, AVG=4)"):
        nccl.all_reduce([fake(4, 0)], op=op)
    with raises(ValueError, f"reduce_scatter: op={op} is not a reduction op (SUM=0, PROD=1, MAX=2, MIN=3, AVG=4)"):
        nccl.reduce_scatter([fake(4, 0)], [fake(4, 0)], op=op)


def test_wrong_op_type():
    with raises(TypeError, "all_reduce: op must be an int, got str"):
        nccl.all_reduce([fake(4, 0)], op="sum")
    with raises(TypeError, "reduce: op must be an int, got bool"):
        nccl.reduce([fake(4, 0)], op=True)


def test_non_stream_in_streams():
    with raises(TypeError, "all_reduce: streams[0] must be a torch.cuda.Stream or None, got int"):
        nccl.all_reduce([fake(4, 0)], streams=[7])
    with raises(TypeError, "all_reduce: streams must be a sequence or None, got int"):
        nccl.all_reduce([fake(4, 0)], streams=7)


def test_non_communicator_in_comms():
    with raises(TypeError, "all_reduce: comms[0] must be a pyccl Communicator (from init_rank), got object"):
        nccl.all_reduce([fake(4, 0)], comms=[object()])
    with raises(TypeError, "broadcast: comms[0] must be a pyccl Communicator (from init_rank), got str"):
        nccl.broadcast([fake(4, 0), fake(4, 1)], comms=["c", None])


def test_outputs_not_a_collection():
    with raises(TypeError, "all_gather: outputs should be a collection of tensors, got FakeCuda"):
        nccl.all_gather([fake(4, 0)], fake(4, 0))
    with raises(TypeError, "reduce: output must be a Tensor or None, got int"):
        nccl.reduce([fake(4, 0)], 3)


def test_reduce_output_and_outputs():
    with pytest.raises(ValueError, match="^reduce: give either 'output'"):
        nccl.reduce([fake(4, 0)], fake(4, 0), outputs=[fake(4, 0)])
    with pytest.warns(FutureWarning, match="deprecated"):
        with raises(RuntimeError, "output must be of size input_size * size_multiplier"):
            nccl.reduce([fake(4, 0)], outputs=[fake(3, 0)])


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
        with pytest.raises(TypeError):
            nccl.all_reduce(ins, outs, op="x")
    after = [sys.getrefcount(x) for x in (ins, outs, streams, ins[0], ins[1], outs[0], outs[1])]
    assert before == after


def test_process_usable_after_errors():
    for _ in range(3):
        with pytest.raises(RuntimeError):
            nccl.all_reduce([fake(4, 0), fake(4, 0)])
    assert len(nccl.unique_id()) == 128
    assert nccl.version() == nccl.version()
