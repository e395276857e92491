"""Every argument error of every Communicator method: exact type and message,
then a correct call in the same process (GPU tier: a Communicator needs a GPU;
one rank in this process is enough)."""
import re
import sys

import pytest
import torch

from conftest import gpu_count, needs_gpus

pyccl = pytest.importorskip("pyccl")

pytestmark = needs_gpus(1)


@pytest.fixture(scope="module")
def comm():
    if gpu_count() < 1:
        pytest.skip("needs 1 CUDA GPU")
    torch.cuda.set_device(0)
    c = pyccl.Communicator(1, pyccl.unique_id(), 0)
    yield c
    c.destroy()


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def still_works(comm):
    t = torch.arange(5, dtype=torch.float32, device="cuda:0")
    comm.all_reduce(t)
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(5, dtype=torch.float32))


F = dict(device="cuda:0")

class CAI:
    """An array known only by its __cuda_array_interface__ (shape, typestr, data, strides)."""

    def __init__(self, shape, ptr, strides=None, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


CASES = [
    # (callable(comm), exception, message)
    (lambda c: c.all_reduce(), TypeError, "all_reduce() missing required argument 'tensor'"),
    (lambda c: c.all_reduce(torch.ones(2, **F), 0, None, None, 5), TypeError,
     "all_reduce() takes at most 2 positional arguments (5 given)"),
    (lambda c: c.all_reduce(torch.ones(2, **F), bogus=1), TypeError,
     "all_reduce() got an unexpected keyword argument 'bogus'"),
    (lambda c: c.all_reduce(torch.ones(2, **F), 0, op=0), TypeError,
     "all_reduce() got multiple values for argument 'op'"),
    (lambda c: c.all_reduce(3), TypeError,
     "all_reduce: tensor must be a torch.Tensor or an array with __cuda_array_interface__, got int"),
    (lambda c: c.all_reduce(torch.ones(2)), ValueError, "all_reduce: tensor must be a CUDA tensor, got one on cpu"),
    (lambda c: c.all_reduce(torch.ones(4, 4, **F).t()), ValueError, "all_reduce: tensor must be contiguous"),
    (lambda c: c.all_reduce(torch.ones(4, **F).to_sparse()), ValueError,
     "all_reduce: tensor must be a dense (strided) tensor, got layout torch.sparse_coo"),
    (lambda c: c.all_reduce(torch.ones(2, **F), op=9), ValueError,
     "all_reduce: op=9 is not a reduction op (SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, or pyccl.premul_sum(x))"),
    (lambda c: c.all_reduce(torch.ones(2, **F), op="sum"), TypeError,
     "all_reduce: op must be pyccl.SUM/PROD/MAX/MIN/AVG or pyccl.premul_sum(x), got str"),
    (lambda c: c.all_reduce(torch.ones(2, **F), out=torch.ones(3, **F)), ValueError,
     "all_reduce: out has 3 elements, expected 2 (same as tensor)"),
    (lambda c: c.all_reduce(torch.ones(2, **F), out=torch.ones(2, dtype=torch.float16, **F)), TypeError,
     "all_reduce: out has dtype torch.float16 but tensor has torch.float32"),
    (lambda c: c.all_reduce(torch.ones(2, dtype=torch.bool, **F)), RuntimeError,
     "all_reduce: cannot reduce torch.bool tensors (NCCL has no boolean reduction); convert to torch.uint8 first"),
    (lambda c: c.all_reduce(torch.ones(2, dtype=torch.complex64, **F)), RuntimeError,
     "Unconvertible NCCL type ComplexFloat"),
    (lambda c: c.all_reduce(torch.ones(2, **F), stream=5), TypeError,
     "all_reduce: stream must be a torch.cuda.Stream or None, got int"),
    (lambda c: c.all_reduce(torch.ones(2, dtype=torch.float8_e5m2, **F), op=pyccl.premul_sum(2)), TypeError,
     "all_reduce: premul_sum does not support torch.float8_e5m2"),
    (lambda c: c.broadcast(torch.ones(2, **F)), TypeError, "broadcast() missing required argument 'root'"),
    (lambda c: c.broadcast(torch.ones(2, **F), 1), ValueError,
     "broadcast: root=1 is out of range for a communicator of size 1 (ranks are 0..0)"),
    (lambda c: c.broadcast(torch.ones(2, **F), -1), ValueError,
     "broadcast: root=-1 is out of range for a communicator of size 1 (ranks are 0..0)"),
    (lambda c: c.broadcast(torch.ones(2, **F), "0"), TypeError, "broadcast: root must be an int, got str"),
    (lambda c: c.broadcast(torch.ones(2, **F), 0, out=torch.ones(1, **F)), ValueError,
     "broadcast: out has 1 elements, expected 2 (same as tensor)"),
    (lambda c: c.reduce(torch.ones(2, **F), 3), ValueError,
     "reduce: root=3 is out of range for a communicator of size 1 (ranks are 0..0)"),
    (lambda c: c.reduce(torch.ones(2, **F), 0, 17), ValueError,
     "reduce: op=17 is not a reduction op (SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, or pyccl.premul_sum(x))"),
    (lambda c: c.all_gather(torch.ones(2, **F), torch.ones(3, **F)), ValueError,
     "all_gather: output has 3 elements, expected 2 (input size x world size)"),
    (lambda c: c.all_gather(torch.ones(2, **F), [torch.ones(2, **F)] * 2), ValueError,
     "all_gather: output has 2 tensors, expected 1 (one per rank)"),
    (lambda c: c.all_gather(torch.ones(2, **F), [torch.ones(3, **F)]), ValueError,
     "all_gather: output[0] has 3 elements, expected 2 (one chunk per rank)"),
    (lambda c: c.all_gather(torch.ones(2, **F), [torch.ones(2, dtype=torch.int32, **F)]), TypeError,
     "all_gather: output[0] has dtype torch.int32 but input has torch.float32"),
    (lambda c: c.all_gather(torch.ones(2, **F), torch.ones(2, dtype=torch.float64, **F)), TypeError,
     "all_gather: output has dtype torch.float64 but input has torch.float32"),
    (lambda c: c.reduce_scatter(torch.ones(3, **F), torch.ones(2, **F)), ValueError,
     "reduce_scatter: input has 3 elements, expected 2 (output size x world size)"),
    (lambda c: c.reduce_scatter([torch.ones(2, **F)], torch.ones(3, **F)), ValueError,
     "reduce_scatter: input[0] has 2 elements, expected 3 (one chunk per rank)"),
    (lambda c: c.send(torch.ones(2, **F), 1), ValueError,
     "send: peer=1 is out of range for a communicator of size 1 (ranks are 0..0)"),
    (lambda c: c.recv(torch.ones(2, **F), True), TypeError, "recv: peer must be an int, got bool"),
    (lambda c: c.recv(torch.ones(2, **F)), TypeError, "recv() missing required argument 'peer'"),
    (lambda c: c.all_to_all(torch.ones(2, **F), torch.ones(3, **F)), ValueError,
     "all_to_all: output has 3 elements, expected 2 (one chunk per rank)"),
    (lambda c: c.all_to_all([], torch.ones(3, **F)), ValueError,
     "all_to_all: input has 0 tensors, expected 1 (one per rank)"),
    (lambda c: c.all_to_all_single(torch.ones(4, **F), torch.ones(4, **F), [3], [4]), ValueError,
     "all_to_all_single: input_splits sum to 3 rows but dim 0 has 4"),
    (lambda c: c.all_to_all_single(torch.ones(4, **F), torch.ones(4, **F), [4, 0], None), ValueError,
     "all_to_all_single: input_splits must be a list of 1 row counts"),
    (lambda c: c.all_to_all_single(torch.ones(4, **F), torch.ones(4, **F), [-4], None), ValueError,
     "all_to_all_single: input_splits[0]=-4 is negative"),
    (lambda c: c.all_to_all_single(torch.ones(4, 2, **F), torch.ones(4, 3, **F)), ValueError,
     "all_to_all_single: input rows have 2 elements but output rows have 3"),
    (lambda c: c.gather(torch.ones(2, **F), None, 0), ValueError, "gather: outputs is required on the root (rank 0)"),
    (lambda c: c.scatter(None, torch.ones(2, **F), 0), ValueError, "scatter: inputs is required on the root (rank 0)"),
    (lambda c: c.gather(torch.ones(2, **F), [torch.ones(2, **F)], 2), ValueError,
     "gather: root=2 is out of range for a communicator of size 1 (ranks are 0..0)"),
    (lambda c: c.barrier(1), TypeError, "barrier() takes at most 0 positional arguments (1 given)"),
    (lambda c: c.split("a"), TypeError, "split: color must be an int, got str"),
    (lambda c: c.all_reduce(CAI((-4,), 0)), ValueError, "all_reduce: tensor has an invalid shape (-4,)"),
    (lambda c: c.all_reduce(CAI((4,), 0)), ValueError, "all_reduce: tensor has a null data pointer"),
    (lambda c: c.all_reduce(CAI((2, 2), 0, strides=(8,))), TypeError,
     "all_reduce: tensor has a malformed __cuda_array_interface__ (strides)"),
    (lambda c: c.all_reduce(CAI((4,), 0, typestr="<f16")), TypeError,
     "all_reduce: tensor has element type '<f16', which pyccl cannot map to a torch dtype"),
    (lambda c: c.split(0, key=1.5), TypeError, "split: key must be an int, got float"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_argument_error(comm, case):
    fn, exc, text = CASES[case]
    with raises(exc, text):
        fn(comm)
    still_works(comm)


@needs_gpus(2)
def test_tensor_on_another_device(comm):
    with raises(ValueError, "all_reduce: tensor is on cuda:1 but the communicator (rank 0) is on cuda:0"):
        comm.all_reduce(torch.ones(2, device="cuda:1"))
    with raises(ValueError, "all_reduce: stream is a stream of cuda:1 but the communicator (rank 0) is on cuda:0"):
        comm.all_reduce(torch.ones(2, **F), stream=torch.cuda.Stream(device=1))
    still_works(comm)


def test_refcounts_after_errors(comm):
    t, o = torch.ones(2, **F), torch.ones(3, **F)
    before = (sys.getrefcount(t), sys.getrefcount(o))
    for _ in range(100):
        with pytest.raises(ValueError):
            comm.all_reduce(t, out=o)
        with pytest.raises(ValueError):
            comm.all_gather(t, [o, o])
    assert (sys.getrefcount(t), sys.getrefcount(o)) == before


def test_constructor_errors():
    uid = pyccl.unique_id()
    with raises(ValueError, "Communicator: device 99 does not exist (this process sees %d GPUs)" % gpu_count()):
        pyccl.Communicator(1, uid, 0, device=99)
    with raises(ValueError, "Communicator: rank -1 is out of range for world_size 1 (ranks are 0..0)"):
        pyccl.Communicator(1, uid, -1)
    with raises(TypeError, "Communicator: world_size must be an int, got str"):
        pyccl.Communicator("2", uid, 0)


def test_premul_and_avg_on_one_rank(comm):
    t = torch.arange(6, dtype=torch.float16, device="cuda:0")
    comm.all_reduce(t, op=pyccl.premul_sum(3))
    i = torch.arange(6, dtype=torch.int32, device="cuda:0")
    comm.all_reduce(i, op=pyccl.AVG)
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(6, dtype=torch.float16) * 3)
    assert torch.equal(i.cpu(), torch.arange(6, dtype=torch.int32))
