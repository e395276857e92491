"""The bad-input catalogue of both APIs: every argument pyccl refuses, with
its exact exception type and full message, each followed by a correct call in
the same process, which shows the refusal left nothing half done.

Rows are (id, api, call, exception type, message); a message that names
addresses or a GPU count is a function of the row's context.

CPU tier (runs everywhere, CI included).  pyccl.nccl is driven with CPU
tensors, wrong types and FakeCuda tensors (conftest.py: host memory that
reports itself as CUDA; pyccl reads only attributes, so the validation is
reached and nothing past it).  The correct call afterwards is a zero-element
call of every collective, which pyccl.nccl completes without a GPU (there is
nothing to move) and which must leave the memory around it untouched, plus a
fresh unique id; where a GPU is present, also a real all_reduce checked
bitwise.  The Communicator rows of this tier are construction, bootstrap and
group errors, which come before any GPU is touched.

GPU tier.  A Communicator needs a GPU, so the rows of its methods (and of
__cuda_array_interface__ objects, devices, streams, destroyed communicators)
run on a one-rank communicator in this process, where no error can leave a
peer waiting; the correct call afterwards is a premul_sum all_reduce into a
separate output and an all_reduce over up to two GPUs, both checked bitwise.
Rows that need two ranks run in two spawned processes making the same call,
so a missed check shows up as a wrong answer, never as a hang.  Also here:
zero-element calls, the legal in-place forms, and counts past 2^31.
"""
import re
import sys
from typing import Any, Callable, NamedTuple

import pytest
import torch

from conftest import gpu_count, needs_gpus, needs_ranks
from _fakes import FakeCuda, fake
from _data import same_bits

pyccl = pytest.importorskip("pyccl")
from pyccl import nccl  # noqa: E402


def raises(exc, text):
    """pytest.raises for an exact, whole message."""
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


class Case(NamedTuple):
    id: str
    api: str            # "nccl" (the torch.cuda.nccl drop-in) or "comm" (the per-rank API)
    call: Callable      # call(ctx): must raise
    exc: type
    msg: Any            # the full message, or msg(ctx) -> the full message
    gpus: int = 1       # GPU tier: GPUs the row needs


def _ids(cases):
    ids = [f"{c.api}-{c.id}" for c in cases]
    assert len(set(ids)) == len(ids), "duplicate case ids"
    return ids


def _text(case, ctx):
    return case.msg(ctx) if callable(case.msg) else case.msg


# ====================================================================== CPU tier


class Host:
    """Host buffers whose FakeCuda views alias, so overlaps are real overlaps."""

    def __init__(self):
        self.buf = {d: torch.arange(64, dtype=torch.float32) + 100 * d for d in (0, 1)}

    def view(self, dev, start, stop):
        return FakeCuda(self.buf[dev][start:stop], dev)

    def addr(self, dev, elem=0):
        return f"{self.buf[dev].data_ptr() + 4 * elem:#x}"


COLLECTIVES = {
    "all_reduce": lambda ins, **kw: nccl.all_reduce(ins, **kw),
    "reduce": lambda ins, **kw: nccl.reduce(ins, **kw),
    "broadcast": lambda ins, **kw: nccl.broadcast(ins, **kw),
    "all_gather": lambda ins, **kw: nccl.all_gather(
        ins, kw.pop("outputs", [fake(8, d) for d in range(len(ins))]), **kw),
    "reduce_scatter": lambda ins, **kw: nccl.reduce_scatter(
        ins, kw.pop("outputs", [fake(2, d) for d in range(len(ins))]), **kw),
}
OPS = ("SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings ('sum', ...), "
       "or a torch.distributed.ReduceOp")
OP_TEXT = f"is not a reduction op ({OPS})"


def _deprecated_outputs_of_wrong_size():
    with pytest.warns(FutureWarning, match="deprecated"):
        nccl.reduce([fake(4, 0)], outputs=[fake(3, 0)])


def _cpu_cases():
    C = []
    add = lambda *a: C.append(Case(*a))  # noqa: E731
    for name, fn in COLLECTIVES.items():
        add(f"bare_tensor-{name}", "nccl", lambda h, fn=fn: fn(fake()), TypeError,
            "Inputs should be a collection of tensors")
        add(f"non_tensor_item-{name}", "nccl", lambda h, fn=fn: fn([fake(), 3]), TypeError,
            "expected Tensor at 1 (got int)")
        add(f"empty_sequence-{name}", "nccl",
            lambda h, fn=fn, name=name: fn([], **({"outputs": []} if name in ("all_gather", "reduce_scatter") else {})),
            RuntimeError, "input sequence can't be empty")
        add(f"cpu_tensor-{name}", "nccl", lambda h, fn=fn: fn([torch.ones(4)]), RuntimeError,
            "input and output elements have to be cuda dense Tensors")
    add("sparse_tensor", "nccl", lambda h: nccl.all_reduce([torch.ones(4).to_sparse()]), RuntimeError,
        "input and output elements have to be cuda dense Tensors")
    add("outputs_of_other_length", "nccl", lambda h: nccl.all_reduce([fake(4, 0), fake(4, 1)], [fake(4, 0)]),
        RuntimeError, "inputs and outputs sequences have to be of the same length, "
                      "but got input of length 2 and output of length 1")
    add("mixed_input_dtypes", "nccl", lambda h: nccl.all_reduce([fake(4, 0), fake(4, 1, torch.float64)]),
        RuntimeError, "all inputs and outputs must be of the same Tensor dtype")
    add("output_dtype", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], [fake(4, 0, torch.int32)]),
        RuntimeError, "all inputs and outputs must be of the same Tensor dtype")
    add("non_contiguous", "nccl", lambda h: nccl.all_reduce([fake(16, 0), FakeCuda(torch.ones(4, 4), 1).t()]),
        RuntimeError, "all inputs and outputs have to be contiguous")
    add("different_sizes", "nccl", lambda h: nccl.all_reduce([fake(4, 0), fake(5, 1)]), RuntimeError,
        "all inputs must have the same number of elements")
    add("two_tensors_on_one_device", "nccl", lambda h: nccl.all_reduce([fake(4, 0), fake(4, 0)]), RuntimeError,
        "inputs must be on unique devices")
    add("input_output_other_device", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], [fake(4, 1)]), RuntimeError,
        "input and output must be on the same device")
    size_msg = "output must be of size input_size * size_multiplier"
    add("output_size-all_reduce", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], [fake(5, 0)]),
        RuntimeError, size_msg)
    add("output_size-all_gather", "nccl",
        lambda h: nccl.all_gather([fake(4, 0), fake(4, 1)], [fake(4, 0), fake(4, 1)]), RuntimeError, size_msg)
    add("output_size-reduce_scatter", "nccl",
        lambda h: nccl.reduce_scatter([fake(4, 0), fake(4, 1)], [fake(4, 0), fake(4, 1)]), RuntimeError, size_msg)
    add("output_size-reduce", "nccl", lambda h: nccl.reduce([fake(4, 0), fake(4, 1)], fake(3, 0)),
        RuntimeError, size_msg)
    add("deprecated_outputs_of_wrong_size", "nccl", lambda h: _deprecated_outputs_of_wrong_size(),
        RuntimeError, size_msg)
    for root in (-1, 2, 1 << 20):
        add(f"root_{root}-reduce", "nccl", lambda h, root=root: nccl.reduce([fake(4, 0), fake(4, 1)], root=root),
            RuntimeError, "invalid root")
        add(f"root_{root}-broadcast", "nccl",
            lambda h, root=root: nccl.broadcast([fake(4, 0), fake(4, 1)], root=root), RuntimeError, "invalid root")
    add("root_str", "nccl", lambda h: nccl.broadcast([fake(4, 0)], root="0"), TypeError,
        "broadcast: root must be an int, got str")
    add("root_bool", "nccl", lambda h: nccl.reduce([fake(4, 0)], root=True), TypeError,
        "reduce: root must be an int, got bool")
    add("root_2^64", "nccl", lambda h: nccl.broadcast([fake(4, 0)], root=1 << 64), ValueError,
        "broadcast: root=18446744073709551616 is out of range")
    add("streams_of_other_length", "nccl", lambda h: nccl.all_reduce([fake(4, 0), fake(4, 1)], streams=[None]),
        RuntimeError, "number of streams is not equal to number of inputs")
    add("comms_of_other_length", "nccl",
        lambda h: nccl.all_reduce([fake(4, 0), fake(4, 1)], comms=[None, None, None]),
        RuntimeError, "number of communicators is not equal to number of inputs")
    add("non_stream_in_streams", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], streams=[7]), TypeError,
        "all_reduce: streams[0] must be a torch.cuda.Stream or None, got int")
    add("streams_not_a_sequence", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], streams=7), TypeError,
        "all_reduce: streams must be a sequence or None, got int")
    add("non_communicator_in_comms", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], comms=[object()]),
        TypeError, "all_reduce: comms[0] must be a pyccl Communicator (from init_rank), got object")
    add("str_in_comms", "nccl", lambda h: nccl.broadcast([fake(4, 0), fake(4, 1)], comms=["c", None]),
        TypeError, "broadcast: comms[0] must be a pyccl Communicator (from init_rank), got str")
    add("outputs_not_a_collection", "nccl", lambda h: nccl.all_gather([fake(4, 0)], fake(4, 0)), TypeError,
        "all_gather: outputs should be a collection of tensors, got FakeCuda")
    add("outputs_none-all_gather", "nccl", lambda h: nccl.all_gather([fake(4, 0)], None), TypeError,
        "all_gather: outputs is required")
    add("outputs_none-reduce_scatter", "nccl", lambda h: nccl.reduce_scatter([fake(4, 0)], None), TypeError,
        "reduce_scatter: outputs is required")
    add("reduce_output_not_a_tensor", "nccl", lambda h: nccl.reduce([fake(4, 0)], 3), TypeError,
        "reduce: output must be a Tensor or None, got int")
    add("reduce_output_and_outputs", "nccl", lambda h: nccl.reduce([fake(4, 0)], fake(4, 0), outputs=[fake(4, 0)]),
        ValueError, "reduce: give either 'output' (one tensor) or the deprecated 'outputs' (a list), not both")
    # dtypes and ops
    for dtype, name in [(torch.complex64, "ComplexFloat"), (torch.int16, "Short"),
                        (torch.complex128, "ComplexDouble"), (torch.uint16, "UInt16")]:
        for coll, fn in [("all_reduce", nccl.all_reduce), ("reduce", lambda ins: nccl.reduce(ins)),
                         ("reduce_scatter", lambda ins, d=dtype: nccl.reduce_scatter(ins, [fake(4, 0, d)]))]:
            add(f"dtype_{name}-{coll}", "nccl", lambda h, fn=fn, dtype=dtype: fn([fake(4, 0, dtype)]),
                RuntimeError, f"Unconvertible NCCL type {name}")
    bool_msg = "cannot reduce torch.bool tensors (NCCL has no boolean reduction); convert to torch.uint8 first"
    add("bool_reduction-all_reduce", "nccl", lambda h: nccl.all_reduce([fake(4, 0, torch.bool)]), RuntimeError,
        f"all_reduce: {bool_msg}")
    add("bool_reduction-reduce_scatter", "nccl",
        lambda h: nccl.reduce_scatter([fake(4, 0, torch.bool)], [fake(4, 0, torch.bool)]), RuntimeError,
        f"reduce_scatter: {bool_msg}")
    add("bool_reduction_zero_elements", "nccl", lambda h: nccl.reduce([fake(0, 0, torch.bool)]), RuntimeError,
        f"reduce: {bool_msg}")
    for op in (5, 99, -1):
        add(f"op_{op}-all_reduce", "nccl", lambda h, op=op: nccl.all_reduce([fake(4, 0)], op=op), ValueError,
            f"all_reduce: op={op} {OP_TEXT}")
        add(f"op_{op}-reduce_scatter", "nccl", lambda h, op=op: nccl.reduce_scatter([fake(4, 0)], [fake(4, 0)], op=op),
            ValueError, f"reduce_scatter: op={op} {OP_TEXT}")
    add("op_2^40", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], op=1 << 40), ValueError,
        f"all_reduce: op=1099511627776 {OP_TEXT}")
    add("op_str", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], op="xor"), ValueError,
        f"all_reduce: op='xor' {OP_TEXT}")
    add("op_bool", "nccl", lambda h: nccl.reduce([fake(4, 0)], op=True), TypeError,
        f"reduce: op must be a reduction op ({OPS}), got bool")
    add("op_float", "nccl", lambda h: nccl.reduce_scatter([fake(4, 0)], [fake(4, 0)], op=1.0), TypeError,
        f"reduce_scatter: op must be a reduction op ({OPS}), got float")
    add("op_premul_sum", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], op=pyccl.premul_sum(2)), TypeError,
        f"all_reduce: op must be a reduction op ({OPS}), got premul_sum")
    if torch.distributed.is_available():
        R = torch.distributed.ReduceOp
        add("op_ReduceOp_BAND", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], op=R.BAND), ValueError,
            f"all_reduce: op=ReduceOp.BAND has no NCCL reduction ({OPS})")
        add("op_ReduceOp_PREMUL_SUM", "nccl", lambda h: nccl.reduce([fake(4, 0)], op=R.PREMUL_SUM), ValueError,
            "reduce: op=ReduceOp.PREMUL_SUM is not taken here")
    # in-place forms: only NCCL's own (the same buffer, or this rank's slot) may overlap
    add("all_gather_output_overlaps_input", "nccl",
        lambda h: nccl.all_gather([h.view(0, 1, 5)], [h.view(0, 0, 4)]), ValueError,
        lambda h: f"all_gather: inputs[0] (16 bytes at {h.addr(0, 1)}) overlaps outputs[0] (16 bytes at "
                  f"{h.addr(0)}) but is not rank 0's slot of it; in place, inputs[0] must be the 16 bytes at "
                  f"{h.addr(0)}")
    add("all_gather_input_in_other_ranks_slot", "nccl",
        lambda h: nccl.all_gather([h.view(0, 4, 8), h.view(1, 4, 8)], [h.view(0, 0, 8), h.view(1, 0, 8)]),
        ValueError,
        lambda h: f"all_gather: inputs[0] (16 bytes at {h.addr(0, 4)}) overlaps outputs[0] (32 bytes at "
                  f"{h.addr(0)}) but is not rank 0's slot of it; in place, inputs[0] must be the 16 bytes at "
                  f"{h.addr(0)}")
    add("all_gather_second_input_in_rank_0_slot", "nccl",
        lambda h: nccl.all_gather([h.view(0, 0, 4), h.view(1, 0, 4)], [h.view(0, 0, 8), h.view(1, 0, 8)]),
        ValueError,
        lambda h: f"all_gather: inputs[1] (16 bytes at {h.addr(1)}) overlaps outputs[1] (32 bytes at "
                  f"{h.addr(1)}) but is not rank 1's slot of it; in place, inputs[1] must be the 16 bytes at "
                  f"{h.addr(1, 4)}")
    add("reduce_scatter_output_straddles_slots", "nccl",
        lambda h: nccl.reduce_scatter([h.view(0, 0, 8), h.view(1, 0, 8)], [h.view(0, 2, 6), h.view(1, 4, 8)]),
        ValueError,
        lambda h: f"reduce_scatter: outputs[0] (16 bytes at {h.addr(0, 2)}) overlaps inputs[0] (32 bytes at "
                  f"{h.addr(0)}) but is not rank 0's slot of it; in place, outputs[0] must be the 16 bytes at "
                  f"{h.addr(0)}")
    add("all_reduce_output_overlaps_input", "nccl",
        lambda h: nccl.all_reduce([h.view(0, 0, 4)], [h.view(0, 2, 6)]), ValueError,
        lambda h: f"all_reduce: outputs[0] (16 bytes at {h.addr(0, 2)}) overlaps inputs[0] (16 bytes at "
                  f"{h.addr(0)}) but is not the same memory; in place, outputs[0] must be the 16 bytes at "
                  f"{h.addr(0)}")
    add("reduce_output_overlaps_root_input", "nccl",
        lambda h: nccl.reduce([h.view(0, 0, 4), h.view(1, 8, 12)], h.view(1, 7, 11), root=1), ValueError,
        lambda h: f"reduce: output (16 bytes at {h.addr(1, 7)}) overlaps inputs[1] (16 bytes at "
                  f"{h.addr(1, 8)}) but is not the same memory; in place, output must be the 16 bytes at "
                  f"{h.addr(1, 8)}")
    # init_rank: the drop-in's communicator
    for n in (0, 1, 127, 129):
        add(f"unique_id_of_{n}_bytes", "nccl", lambda h, n=n: nccl.init_rank(1, b"u" * n, 0), RuntimeError,
            f"invalid unique_id (expected 128 bytes, got {n})")
    add("unique_id_str", "nccl", lambda h: nccl.init_rank(1, "u" * 128, 0), TypeError,
        "init_rank: unique_id must be bytes (from unique_id()), got str")
    add("unique_id_int", "nccl", lambda h: nccl.init_rank(1, 5, 0), TypeError,
        "init_rank: unique_id must be bytes (from unique_id()), got int")
    add("unique_id_non_contiguous", "nccl", lambda h: nccl.init_rank(1, memoryview(bytes(256))[::2], 0),
        TypeError, "init_rank: unique_id must be bytes (from unique_id()), got a non-contiguous memoryview")
    add("init_rank_world_0", "nccl", lambda h: nccl.init_rank(0, nccl.unique_id(), 0), ValueError,
        "init_rank: world_size must be >= 1, got 0")
    add("init_rank_world_str", "nccl", lambda h: nccl.init_rank("2", nccl.unique_id(), 0), TypeError,
        "init_rank: world_size must be an int, got str")
    add("init_rank_rank_2_of_2", "nccl", lambda h: nccl.init_rank(2, nccl.unique_id(), 2), ValueError,
        "init_rank: rank 2 is out of range for world_size 2 (ranks are 0..1)")
    add("init_rank_rank_float", "nccl", lambda h: nccl.init_rank(2, nccl.unique_id(), 1.0), TypeError,
        "init_rank: rank must be an int, got float")

    # ---- the per-rank API: everything before a GPU is needed
    uid = pyccl.unique_id()
    add("world_size_str", "comm", lambda h: pyccl.Communicator("2", uid, 0), TypeError,
        "Communicator: world_size must be an int, got str")
    add("world_size_0", "comm", lambda h: pyccl.Communicator(0, uid, 0), ValueError,
        "Communicator: world_size must be >= 1, got 0")
    add("rank_-1", "comm", lambda h: pyccl.Communicator(1, uid, -1), ValueError,
        "Communicator: rank -1 is out of range for world_size 1 (ranks are 0..0)")
    add("rank_2_of_2", "comm", lambda h: pyccl.init_rank(2, uid, 2), ValueError,
        "Communicator: rank 2 is out of range for world_size 2 (ranks are 0..1)")
    add("rank_2^40", "comm", lambda h: pyccl.Communicator(2, uid, 1 << 40), ValueError,
        "Communicator: rank=1099511627776 is out of range")
    add("device_str", "comm", lambda h: pyccl.Communicator(1, uid, 0, device="0"), ValueError,
        "Communicator: device must be a CUDA device ('cuda:N'), got '0'")
    add("device_float", "comm", lambda h: pyccl.Communicator(1, uid, 0, device=0.0), TypeError,
        "Communicator: device must be an int, 'cuda:N' or a CUDA torch.device, got float")
    add("device_cpu", "comm", lambda h: pyccl.Communicator(1, uid, 0, device=torch.device("cpu")), ValueError,
        "Communicator: device must be a CUDA device ('cuda:N'), got 'cpu'")
    add("device_negative", "comm", lambda h: pyccl.init_rank(1, uid, 0, device=-2), ValueError,
        "Communicator: device must be >= 0, got -2")
    add("unique_id_short", "comm", lambda h: pyccl.Communicator(1, b"x" * 5, 0), ValueError,
        "Communicator: unique_id has 5 bytes, expected 128 (from unique_id())")
    add("unique_id_of_1_byte", "comm", lambda h: pyccl.init_rank(2, b"x", 0), ValueError,
        "Communicator: unique_id has 1 bytes, expected 128 (from unique_id())")
    add("unique_id_non_contiguous", "comm", lambda h: pyccl.Communicator(1, memoryview(bytes(256))[::2], 0),
        TypeError, "Communicator: unique_id must be bytes (from unique_id()), got a non-contiguous memoryview")
    add("unique_id_str", "comm", lambda h: pyccl.Communicator(1, "u" * 128, 0), TypeError,
        "Communicator: unique_id must be bytes (from unique_id()), got str")
    add("init_ranks_lengths", "comm", lambda h: pyccl.init_ranks(2, uid, [0, 1], [0]), ValueError,
        "init_ranks: ranks and devices must be non-empty and of one length, got 2 and 1")
    add("init_ranks_unique_id", "comm", lambda h: pyccl.init_ranks(2, b"abc", [0], [0]), ValueError,
        "init_ranks: unique_id has 3 bytes, expected 128 (from unique_id())")
    add("init_ranks_rank_twice", "comm", lambda h: pyccl.init_ranks(2, uid, [1, 1], [0, 1]), ValueError,
        "init_ranks: rank 1 is listed twice (ranks[0] and ranks[1])")
    add("init_ranks_rank_out_of_range", "comm", lambda h: pyccl.init_ranks(2, uid, [0, 5], [0, 1]), ValueError,
        "init_ranks: ranks[1]=5 is out of range for world_size 2")
    add("init_ranks_device_str", "comm", lambda h: pyccl.init_ranks(2, uid, [0, 1], ["0", 1]), ValueError,
        "init_ranks: devices[0] must be a CUDA device ('cuda:N'), got '0'")
    add("init_ranks_device_float", "comm", lambda h: pyccl.init_ranks(2, uid, [0, 1], [0, 1.0]), TypeError,
        "init_ranks: devices[1] must be an int, 'cuda:N' or a CUDA torch.device, got float")
    add("init_ranks_device_current", "comm", lambda h: pyccl.init_ranks(2, uid, [0, 1], [0, "cuda"]), ValueError,
        "init_ranks: devices[1] must name its index ('cuda:N'), got 'cuda'")
    add("init_ranks_world_0", "comm", lambda h: pyccl.init_ranks(0, uid, [0], [0]), ValueError,
        "init_ranks: world_size must be >= 1, got 0")
    add("group_end_without_start", "comm", lambda h: pyccl._C._nccl_group_end(), RuntimeError,
        "group end: no pyccl.group() is open on this thread")
    add("premul_sum_str", "comm", lambda h: pyccl.premul_sum("2"), TypeError,
        "premul_sum: scalar must be a real number, got str")
    add("premul_sum_object", "comm", lambda h: pyccl.premul_sum(object()), TypeError,
        "premul_sum: scalar must be a real number, got object")
    add("premul_sum_2^2000", "comm", lambda h: pyccl.premul_sum(2 ** 2000), ValueError,
        "premul_sum: scalar is an int of 2001 bits; a float holds magnitudes up to about 1.8e308 (1024 bits)")
    add("premul_sum_-2^5000", "comm", lambda h: pyccl.premul_sum(-(2 ** 5000)), ValueError,
        "premul_sum: scalar is a negative int of 5001 bits; a float holds magnitudes up to about 1.8e308 "
        "(1024 bits)")
    # pyccl.empty (registered memory): checked before any GPU is touched
    add("empty_negative_dim", "comm", lambda h: pyccl.empty((3, -1)), ValueError,
        "empty: shape must not hold negative sizes, got (3, -1)")
    add("empty_zero_elements", "comm", lambda h: pyccl.empty((3, 0)), ValueError,
        "empty: the tensor must have at least one element, got shape (3, 0)")
    add("empty_shape_str", "comm", lambda h: pyccl.empty("8"), TypeError,
        "empty: shape must be an int or a sequence of ints, got str")
    add("empty_dtype_str", "comm", lambda h: pyccl.empty(8, dtype="float32"), TypeError,
        "empty: dtype must be a torch.dtype, got str")
    add("empty_cpu_device", "comm", lambda h: pyccl.empty(8, device="cpu"), ValueError,
        "empty: device must be a CUDA device ('cuda:N'), got 'cpu'")
    add("empty_cpu_torch_device", "comm", lambda h: pyccl.empty(8, device=torch.device("cpu")), ValueError,
        "empty: device must be a CUDA device ('cuda:N'), got 'cpu'")
    add("empty_bool_device", "comm", lambda h: pyccl.empty(8, device=True), TypeError,
        "empty: device must be an int, 'cuda:N' or a CUDA torch.device, got bool")
    add("empty_negative_device", "comm", lambda h: pyccl.empty(8, device=-1), ValueError,
        "empty: device must be >= 0, got -1")
    _hostile_cpu_cases(add)
    return C


class FreshDtype:
    """A dtype-like object pyccl's table does not know, new on every read."""
    live = 0

    def __init__(self, itemsize=4):
        self.itemsize = itemsize
        FreshDtype.live += 1

    def __del__(self):
        FreshDtype.live -= 1

    def __repr__(self):
        return "FreshDtype"


class Lying(FakeCuda):
    """FakeCuda whose attributes (numel, get_device, data_ptr, dtype) may be
    replaced by a value or by a function of no arguments run on every read:
    user code that lies, returns fresh objects or mutates its container."""

    @staticmethod
    def __new__(cls, data, device=0, **over):
        t = FakeCuda.__new__(cls, data, device)
        t._over = over
        return t

    def _get(self, name, default):
        v = self._over.get(name, default)
        return v() if callable(v) and name in self._over else v

    def numel(self):
        return self._get("numel", super().numel())

    def get_device(self):
        return self._get("get_device", super().get_device())

    def data_ptr(self):
        return self._get("data_ptr", super().data_ptr())

    @property
    def dtype(self):
        return self._get("dtype", super().dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # keep torch from re-wrapping results (and from calling our overrides)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def lying(n=4, device=0, kind=torch.float32, **over):
    return Lying(torch.arange(n).to(kind), device, **over)


def _cleared_list(second):
    """[a, second] where reading a's numel() empties the list (issue #15, item 2)."""
    lst = []
    lst += [lying(4, 0, numel=lambda: (lst.clear(), 4)[1]), second]
    return lst


HUGE = 1 << 62  # numel * 4 or numel * 2 overflows int64


def _hostile_cpu_cases(add):
    """Issue #15: hostile tensor-likes against pyccl.nccl (CPU tier, in process)."""
    # 1. a dtype that is a fresh object on every read: never kept as a borrowed pointer
    add("dtype_fresh_object", "nccl", lambda h: nccl.reduce([lying(dtype=lambda: FreshDtype())]),
        RuntimeError, "Unconvertible NCCL type FreshDtype")
    add("dtype_fresh_object_in_and_out", "nccl", lambda h: nccl.all_reduce([lying(dtype=lambda: FreshDtype())]),
        RuntimeError, "all inputs and outputs must be of the same Tensor dtype")
    add("dtype_fresh_object_twice", "nccl",
        lambda h: nccl.broadcast([lying(0, dtype=lambda: FreshDtype()), lying(1, 1, dtype=lambda: FreshDtype())]),
        RuntimeError, "all inputs and outputs must be of the same Tensor dtype")
    # 2. the list emptied while it is checked: the private tuple still holds both
    add("list_cleared_while_checked", "nccl", lambda h: nccl.all_reduce(_cleared_list(fake(3, 1))),
        RuntimeError, "all inputs must have the same number of elements")
    add("outputs_cleared_while_checked", "nccl",
        lambda h: nccl.all_reduce([fake(4, 0), fake(4, 1)], _cleared_list(fake(3, 1))),
        RuntimeError, "output must be of size input_size * size_multiplier")
    # 4. sizes that overflow 64 bits
    add("numel_times_itemsize_overflows", "nccl", lambda h: nccl.all_reduce([lying(numel=HUGE)]),
        ValueError, "all_reduce: inputs[0] has 4611686018427387904 elements; times the item size 4 "
                    "that overflows a 64-bit count")
    add("numel_times_world_size_overflows", "nccl",
        lambda h: nccl.all_gather([lying(4, 0, torch.int8, numel=HUGE), lying(4, 1, torch.int8, numel=HUGE)],
                                  [lying(8, 0, torch.int8, numel=HUGE), lying(8, 1, torch.int8, numel=HUGE)]),
        ValueError, "all_gather: inputs[0] has 4611686018427387904 elements; times the world size 2 "
                    "that overflows a 64-bit count")
    add("output_times_world_size_overflows", "nccl",
        lambda h: nccl.reduce_scatter([fake(8, 0, torch.int8), fake(8, 1, torch.int8)],
                                      [lying(4, 0, torch.int8, numel=HUGE), lying(4, 1, torch.int8, numel=HUGE)]),
        ValueError, "reduce_scatter: outputs[0] has 4611686018427387904 elements; times the world size 2 "
                    "that overflows a 64-bit count")
    # 5. nonsense sizes, devices, pointers and item sizes
    add("numel_negative", "nccl", lambda h: nccl.all_reduce([lying(numel=-3)]),
        ValueError, "all_reduce: inputs[0].numel() is -3, expected 0 or more")
    add("numel_minus_one_output", "nccl", lambda h: nccl.all_reduce([fake(4, 0)], [lying(numel=-1)]),
        ValueError, "all_reduce: outputs[0].numel() is -1, expected 0 or more")
    add("numel_past_int64", "nccl", lambda h: nccl.broadcast([lying(numel=1 << 64)]),
        ValueError, "broadcast: inputs[0].numel() is 18446744073709551616, expected 0 or more")
    add("numel_not_an_int", "nccl", lambda h: nccl.broadcast([lying(numel="4")]),
        TypeError, "broadcast: inputs[0].numel() returned str, expected an int")
    add("device_past_int", "nccl", lambda h: nccl.all_reduce([lying(get_device=1 << 32)]),
        ValueError, "all_reduce: inputs[0].get_device() is 4294967296, expected a CUDA device index "
                    "(0 to 2147483647)")
    add("device_negative", "nccl", lambda h: nccl.reduce([lying(get_device=-1)], root=0),
        ValueError, "reduce: inputs[0].get_device() is -1, expected a CUDA device index (0 to 2147483647)")
    add("device_negative_reduce_output", "nccl",
        lambda h: nccl.reduce([fake(4, 0)], lying(get_device=-1), root=0),
        ValueError, "reduce: output.get_device() is -1, expected a CUDA device index (0 to 2147483647)")
    add("data_ptr_negative", "nccl", lambda h: nccl.all_reduce([lying(data_ptr=-8)]),
        ValueError, "all_reduce: inputs[0].data_ptr() is -8, expected an address (0 to 2**64-1)")
    add("data_ptr_null", "nccl", lambda h: nccl.all_reduce([lying(data_ptr=0)]),
        ValueError, "all_reduce: inputs[0] has a null data pointer")
    add("data_ptr_wraps", "nccl", lambda h: nccl.all_reduce([lying(data_ptr=(1 << 64) - 8)]),
        ValueError, "all_reduce: inputs[0] (16 bytes at 0xfffffffffffffff8) runs past the end of the "
                    "address space")
    add("itemsize_negative", "nccl", lambda h: nccl.broadcast([lying(dtype=FreshDtype(-4))]),
        ValueError, "broadcast: inputs[0].dtype.itemsize is -4, expected 1, 2, 4, 8 or 16")
    add("itemsize_three", "nccl", lambda h: nccl.broadcast([lying(dtype=FreshDtype(3))]),
        ValueError, "broadcast: inputs[0].dtype.itemsize is 3, expected 1, 2, 4, 8 or 16")
    add("numel_raises", "nccl", lambda h: nccl.all_reduce([lying(numel=_raise)]),
        LookupError, "numel says no")


def _raise():
    raise LookupError("numel says no")


CPU_CASES = _cpu_cases()


def _real_all_reduce():
    """An all_reduce over up to two GPUs into separate outputs, checked bitwise."""
    devs = list(range(min(2, gpu_count())))
    ins = [torch.arange(1, 8, dtype=torch.float32, device=f"cuda:{d}") * (d + 2) for d in devs]
    outs = [torch.full_like(t, 3) for t in ins]
    nccl.all_reduce(ins, outs)
    for d in devs:
        torch.cuda.synchronize(d)
    want = torch.arange(1, 8, dtype=torch.float32) * sum(d + 2 for d in devs)
    assert all(same_bits(o, want) for o in outs)


def _usable_without_gpu(h):
    """Every collective with zero elements completes and writes nothing."""
    before = {d: b.clone() for d, b in h.buf.items()}
    z = lambda d, at: h.view(d, at, at)  # noqa: E731  (zero elements inside a buffer)
    assert nccl.all_reduce([z(0, 3), z(1, 5)], [z(0, 9), z(1, 9)]) is None
    nccl.broadcast([z(0, 3), z(1, 5)], root=1)
    nccl.reduce([z(0, 3), z(1, 5)], z(1, 7), root=1, op=nccl.MAX)
    nccl.all_gather([z(0, 3), z(1, 5)], [z(0, 11), z(1, 11)])
    nccl.reduce_scatter([z(0, 3), z(1, 5)], [z(0, 11), z(1, 11)], op=nccl.PROD)
    nccl.all_reduce([z(0, 3), z(1, 5)], op="Min")  # the other spellings of an op
    if torch.distributed.is_available():
        nccl.reduce_scatter([z(0, 3), z(1, 5)], [z(0, 11), z(1, 11)], op=torch.distributed.ReduceOp.AVG)
    for d in before:
        assert same_bits(h.buf[d], before[d])
    uid = pyccl.unique_id()
    assert len(uid) == 128 and uid != pyccl.unique_id()
    if gpu_count() >= 1:
        _real_all_reduce()


@pytest.fixture
def host():
    return Host()


@pytest.mark.parametrize("case", CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_tier(case, host):
    with raises(case.exc, _text(case, host)):
        case.call(host)
    _usable_without_gpu(host)


def test_cpu_tier_covers_both_apis():
    apis = {c.api for c in CPU_CASES}
    assert apis == {"nccl", "comm"} and len(CPU_CASES) >= 40


def test_zero_elements_need_no_gpu(host):
    """Zero elements: the whole call is validated, then nothing is moved."""
    _usable_without_gpu(host)
    # still validated: a zero-element call with a bad argument fails
    with raises(RuntimeError, "all inputs must have the same number of elements"):
        nccl.all_reduce([host.view(0, 3, 3), host.view(1, 3, 4)])
    with raises(RuntimeError, "invalid root"):
        nccl.broadcast([host.view(0, 3, 3)], root=1)


def test_refcounts_unchanged_after_overlap_errors(host):
    ins, outs = [host.view(0, 1, 5)], [host.view(0, 0, 4)]
    before = [sys.getrefcount(x) for x in (ins, outs, ins[0], outs[0])]
    for _ in range(50):
        with pytest.raises(ValueError):
            nccl.all_gather(ins, outs)
        with pytest.raises(ValueError):
            nccl.all_reduce(outs, ins)
    assert [sys.getrefcount(x) for x in (ins, outs, ins[0], outs[0])] == before


def test_refcounts_unchanged_after_hostile_rows():
    """Issue #15's drop-in rows leave no reference behind: arguments, their
    items, and the fresh dtype objects (none may be kept alive)."""
    import gc
    live_dtypes = lambda: FreshDtype.live  # noqa: E731
    fresh = lying(dtype=lambda: FreshDtype())
    cases = [
        (lambda: nccl.reduce([fresh]), [fresh], RuntimeError),
        (lambda: nccl.all_reduce([fresh]), [fresh], RuntimeError),
        (lambda: nccl.all_reduce([lying(numel=-3)]), [], ValueError),
        (lambda: nccl.all_reduce([lying(numel=HUGE)]), [], ValueError),
        (lambda: nccl.all_reduce([lying(get_device=1 << 32)]), [], ValueError),
    ]
    a, b = fake(4, 0), fake(4, 1)
    ins, outs = [a, b], [fake(4, 0), fake(3, 1)]
    cases.append((lambda: nccl.all_reduce(ins, outs), [ins, outs, a, b] + outs, RuntimeError))
    gc.collect()
    dtypes_before = live_dtypes()
    for call, objs, exc in cases:
        before = [sys.getrefcount(o) for o in objs]
        for _ in range(20):
            with pytest.raises(exc):
                call()
        assert [sys.getrefcount(o) for o in objs] == before
    # a list emptied while checked: each item loses just the list's reference
    x, y = lying(4, 0), fake(3, 1)
    rx, ry = sys.getrefcount(x), sys.getrefcount(y)
    lst = [x, y]
    x._over["numel"] = lambda: (lst.clear(), 4)[1]
    with pytest.raises(RuntimeError):
        nccl.all_reduce(lst)
    assert lst == [] and (sys.getrefcount(x), sys.getrefcount(y)) == (rx, ry)
    del x._over["numel"]
    gc.collect()
    assert live_dtypes() == dtypes_before


# ------------------------------------------- CPU tier on the stand-in GPU library
#
# Communicator methods and pyccl.nccl with comms= driven through
# tests/fakegpu/fakegpu.c (a stand-in libnccl/libcudart) under a stub torch,
# in one child process (tests/child_fakegpu.py, scenario bad_input).  Each row's
# code runs there with the names of tests/_hostile.py and `c`, a fresh
# untimed 2-rank communicator (rank 0, cuda:0); it sets fn, args (and maybe
# kw).  The child reports the exception, whether the refcounts of the
# arguments and of their items are unchanged (an item a row removed from its
# list loses just that list's reference), and whether correct calls work
# afterwards (on a fresh communicator, and on c if it is alive).


class StandIn(NamedTuple):
    id: str
    api: str
    code: str
    exc: Any            # exception class name, or None: the call must succeed
    msg: Any
    notes: tuple = ()   # the exception's PEP 678 notes (pyccl's note on a user exception it passes on)


GONE = "the communicator (rank 0 of 2) has been destroyed"
NO_REDUCE = "which NCCL cannot reduce (the moves, such as broadcast and all_gather, take any dtype)"
STREAM_HANDLE = "expected a CUDA stream handle (0 to 2**64-1)"
ABORTED = "the communicator (rank 0 of 2) has been aborted"
HUGE_F32 = "has 4611686018427387904 elements; times the item size 4 that overflows a 64-bit count"
HUGE_N = "has 4611686018427387904 elements; times the world size 2 that overflows a 64-bit count"
DEV = "expected a CUDA device index (0 to 2147483647)"
STAND_IN_CASES = [
    # 1. a dtype object that is new on every read
    StandIn("dtype_fresh-all_reduce", "comm", "fn, args = c.all_reduce, (T(dtype=fresh_dtype()),)",
            "TypeError", f"all_reduce: tensor has dtype FreshDtype, {NO_REDUCE}"),
    StandIn("dtype_fresh-broadcast_out", "comm",
            "fn, args, kw = c.broadcast, (T(dtype=fresh_dtype()), 0), {'out': T(dtype=fresh_dtype(8))}",
            "TypeError", "broadcast: out has dtype FreshDtype but tensor has FreshDtype"),
    StandIn("dtype_fresh-moves", "comm", "fn, args = c.broadcast, (T(dtype=fresh_dtype()), 0)", None, None),
    StandIn("dtype_fresh-comms", "nccl", "fn, args, kw = nccl.broadcast, ([T(dtype=fresh_dtype())],), {'comms': [c]}",
            None, None),
    # 1b. dtypes NCCL cannot reduce: the method and the argument named (the drop-in keeps torch's text)
    StandIn("dtype_int16-all_reduce", "comm", "fn, args = c.all_reduce, (T(dtype=torch.int16),)",
            "TypeError", f"all_reduce: tensor has dtype torch.int16, {NO_REDUCE}"),
    StandIn("dtype_complex64-reduce", "comm", "fn, args = c.reduce, (T(dtype=torch.complex64), 0)",
            "TypeError", f"reduce: tensor has dtype torch.complex64, {NO_REDUCE}"),
    StandIn("dtype_uint16-reduce_scatter", "comm",
            "fn, args = c.reduce_scatter, (T(8, dtype=torch.uint16), T(dtype=torch.uint16))",
            "TypeError", f"reduce_scatter: output has dtype torch.uint16, {NO_REDUCE}"),
    StandIn("dtype_int16-all_reduce_coalesced", "comm",
            "fn, args = c.all_reduce_coalesced, ([T(dtype=torch.int16), T(dtype=torch.int16)],)",
            "TypeError", f"all_reduce_coalesced: tensors[0] has dtype torch.int16, {NO_REDUCE}"),
    # 1b'. a valid list reaches torch's pack as one sequence (a tuple passed as the argument tuple
    #      would spread it into one argument per tensor)
    StandIn("pack_one_sequence-all_reduce_coalesced", "comm",
            "fn, args = c.all_reduce_coalesced, ([T(), T(), T()],)",
            "RuntimeError", "stub torch runs no kernels (flatten_dense_tensors of 3 tensors)"),
    StandIn("dtype_int16_moves-broadcast", "comm", "fn, args = c.broadcast, (T(dtype=torch.int16), 0)", None, None),
    StandIn("dtype_int16-comms", "nccl", "fn, args, kw = nccl.all_reduce, ([T(dtype=torch.int16)],), {'comms': [c]}",
            "RuntimeError", "Unconvertible NCCL type Short"),
    # 1c. stream objects whose attributes raise, are missing, or hold no int or one out of range
    StandIn("stream_cuda_stream_raises-all_reduce", "comm",
            "fn, args, kw = c.all_reduce, (T(),), {'stream': BadStream(cuda_stream=raising('cuda_stream'))}",
            "HostileError", "cuda_stream", ("all_reduce: raised while reading stream.cuda_stream",)),
    StandIn("stream_device_index_raises-comms", "nccl",
            "fn, args, kw = nccl.broadcast, ([T()],), {'comms': [c], 'streams': [BadStream(device_index=raising())]}",
            "HostileError", "attribute", ("broadcast: raised while reading streams[0].device_index",)),
    StandIn("stream_cuda_stream_str-all_reduce", "comm",
            "fn, args, kw = c.all_reduce, (T(),), {'stream': BadStream(cuda_stream='0x5555')}",
            "TypeError", "all_reduce: stream.cuda_stream is a str, expected an int"),
    StandIn("stream_cuda_stream_2_80-send", "comm",
            "fn, args, kw = c.send, (T(), 1), {'stream': BadStream(cuda_stream=1 << 80)}",
            "ValueError", f"send: stream.cuda_stream is 1208925819614629174706176, {STREAM_HANDLE}"),
    StandIn("stream_cuda_stream_negative-broadcast", "comm",
            "fn, args, kw = c.broadcast, (T(), 0), {'stream': BadStream(cuda_stream=-5)}",
            "ValueError", f"broadcast: stream.cuda_stream is -5, {STREAM_HANDLE}"),
    StandIn("stream_cuda_stream_float-barrier", "comm",
            "fn, args, kw = c.barrier, (), {'stream': BadStream(cuda_stream=1.0)}",
            "TypeError", "barrier: stream.cuda_stream is a float, expected an int"),
    StandIn("stream_no_cuda_stream-all_gather", "comm",
            "fn, args, kw = c.all_gather, (T(2), T()), {'stream': BadStream(cuda_stream=None)}",
            "TypeError", "all_gather: stream (a BadStream) has no attribute cuda_stream, which a "
                         "torch.cuda.Stream has"),
    StandIn("stream_device_index_str-all_reduce", "comm",
            "fn, args, kw = c.all_reduce, (T(),), {'stream': BadStream(device_index='0')}",
            "TypeError", "all_reduce: stream.device_index is a str, expected an int"),
    StandIn("stream_device_index_2_70-all_reduce", "comm",
            "fn, args, kw = c.all_reduce, (T(),), {'stream': BadStream(device_index=1 << 70)}",
            "ValueError", "all_reduce: stream.device_index is 1180591620717411303424, " + DEV),
    StandIn("stream_device_index_negative-all_reduce", "comm",
            "fn, args, kw = c.all_reduce, (T(),), {'stream': BadStream(device_index=-1)}",
            "ValueError", "all_reduce: stream.device_index is -1, " + DEV),
    StandIn("stream_cuda_stream_2_64-comms", "nccl",
            "fn, args, kw = nccl.all_reduce, ([T()],), {'comms': [c], 'streams': [BadStream(cuda_stream=1 << 64)]}",
            "ValueError", f"all_reduce: streams[0].cuda_stream is 18446744073709551616, {STREAM_HANDLE}"),
    StandIn("stream_cuda_stream_2_64_minus_1-all_reduce", "comm",
            "fn, args, kw = c.all_reduce, (T(),), {'stream': BadStream(cuda_stream=(1 << 64) - 1)}", None, None),
    # 1d. a premul_sum-like op whose scalar is no float
    StandIn("premul_scalar_2_2000-all_reduce", "comm", "fn, args = c.all_reduce, (T(), HostileOp(int, 2 ** 2000))",
            "ValueError", "all_reduce: op.premul_scalar is an int of 2001 bits, too large for a float"),
    StandIn("premul_scalar_str-all_reduce", "comm", "fn, args = c.all_reduce, (T(), HostileOp(int, '2'))",
            "TypeError", "all_reduce: op.premul_scalar must be a real number, got str"),
    # 1e. shrink(): exclude read by iteration, never sized by a len() that lies
    StandIn("shrink_len_2_62", "comm", "fn, args = c.shrink, (LyingLen([], 1 << 62),)", None, None),
    StandIn("shrink_len_2_62_self", "comm", "fn, args = c.shrink, (LyingLen([0], 1 << 62),)",
            "ValueError", "shrink: this rank (0) is in exclude; only the ranks that remain call shrink()"),
    StandIn("shrink_endless", "comm", "import itertools\nfn, args = c.shrink, (itertools.repeat(1),)",
            "ValueError", "shrink: rank 1 is in exclude twice"),
    StandIn("shrink_int", "comm", "fn, args = c.shrink, (5,)",
            "TypeError", "shrink: exclude must be a sequence of ranks, got int"),
    # 2. the list emptied while it is checked (by an item's numel() or __cuda_array_interface__)
    StandIn("list_cleared-all_gather", "comm",
            "lst = []\nlst += [T(numel=then(lst.clear, 4)), T(3)]\nfn, args = c.all_gather, (T(), lst)",
            "ValueError", "all_gather: output[1] has 3 elements, expected 4 (one chunk per rank)"),
    StandIn("list_cleared_by_cai-reduce_scatter", "comm",
            "lst = []\nlst += [A(4, on_read=lst.clear), A(3)]\nfn, args = c.reduce_scatter, (lst, T())",
            "ValueError", "reduce_scatter: input[1] has 3 elements, expected 4 (one chunk per rank)"),
    StandIn("list_cleared-all_to_all_first", "comm",
            "lst = []\nlst += [T(numel=then(lst.clear, 4)), T(3)]\nfn, args = c.all_to_all, (lst, T(8))",
            "ValueError", "all_to_all: input[1] has 3 elements, expected 4 (one chunk per rank)"),
    StandIn("list_cleared-gather", "comm",
            "lst = []\nlst += [T(numel=then(lst.clear, 4)), T(3)]\nfn, args = c.gather, (T(), lst, 0)",
            "ValueError", "gather: outputs[1] has 3 elements, expected 4 (one chunk per rank)"),
    StandIn("list_cleared-all_reduce_coalesced", "comm",
            "lst = []\nlst += [T(numel=then(lst.clear, 4)), T(dtype=torch.int32)]\n"
            "fn, args = c.all_reduce_coalesced, (lst,)",
            "TypeError", "all_reduce_coalesced: tensors[1] has dtype torch.int32 but tensors[0] has torch.float32"),
    StandIn("list_cleared-comms", "nccl",
            "lst = []\nlst += [T(numel=then(lst.clear, 4)), T(3, 1)]\n"
            "c1 = comm(device=1)\nfn, args, kw = nccl.all_reduce, (lst,), {'comms': [c, c1]}",
            "RuntimeError", "all inputs must have the same number of elements"),
    # 3. all_to_all_single: len() raising, lying, or absent (__cuda_array_interface__ only)
    StandIn("len_raises-all_to_all_single", "comm",
            "fn, args = c.all_to_all_single, (T(4, len=raising('len')), T(4, len=raising('len')))",
            "HostileError", "len"),
    StandIn("len_lies-all_to_all_single", "comm", "fn, args = c.all_to_all_single, (T(6, len=4), T(6))",
            "ValueError", "all_to_all_single: input has 6 elements, which do not make 4 rows (dim 0) of equal size"),
    StandIn("cai_only-all_to_all_single", "comm",
            "fn, args = c.all_to_all_single, (A(4, shape=(2, 2)), A(4, shape=(2, 2)))", None, None),
    StandIn("cai_only_odd_rows-all_to_all_single", "comm",
            "fn, args = c.all_to_all_single, (A(3), A(3))",
            "ValueError", "all_to_all_single: input_splits is None but dim 0 (3) is not a multiple of the world "
                          "size 2"),
    # 4. sizes that overflow 64 bits
    StandIn("cai_shape_2_62-all_reduce", "comm", "fn, args = c.all_reduce, (A(4, shape=(1 << 62,)),)",
            "ValueError", "all_reduce: tensor " + HUGE_F32),
    StandIn("numel_2_62-broadcast", "comm", "fn, args = c.broadcast, (T(numel=1 << 62), 0)",
            "ValueError", "broadcast: tensor " + HUGE_F32),
    StandIn("world_size_overflow-all_gather", "comm",
            "fn, args = c.all_gather, (A(4, shape=(1 << 62,), typestr='|i1'), A(4, shape=(1 << 62,), typestr='|i1'))",
            "ValueError", "all_gather: input " + HUGE_N),
    StandIn("world_size_overflow-reduce_scatter", "comm",
            "fn, args = c.reduce_scatter, (A(4, shape=(1 << 62,), typestr='|i1'), "
            "A(4, shape=(1 << 62,), typestr='|i1'))",
            "ValueError", "reduce_scatter: output " + HUGE_N),
    StandIn("world_size_overflow-gather", "comm",
            "fn, args = c.gather, (A(4, shape=(1 << 62,), typestr='|i1'), A(4, shape=(1 << 62,), typestr='|i1'), 0)",
            "ValueError", "gather: tensor " + HUGE_N),
    StandIn("world_size_overflow-scatter", "comm",
            "fn, args = c.scatter, (A(4, shape=(1 << 62,), typestr='|i1'), A(4, shape=(1 << 62,), typestr='|i1'), 0)",
            "ValueError", "scatter: tensor " + HUGE_N),
    # 5. nonsense sizes, devices, pointers, item sizes
    StandIn("numel_negative-all_reduce", "comm", "fn, args = c.all_reduce, (T(numel=-3),)",
            "ValueError", "all_reduce: tensor.numel() is -3, expected 0 or more"),
    StandIn("numel_minus_one-broadcast", "comm", "fn, args = c.broadcast, (T(numel=-1), 0)",
            "ValueError", "broadcast: tensor.numel() is -1, expected 0 or more"),
    StandIn("itemsize_negative-broadcast", "comm", "fn, args = c.broadcast, (T(dtype=FreshDtype(-4)), 0)",
            "ValueError", "broadcast: tensor.dtype.itemsize is -4, expected 1, 2, 4, 8 or 16"),
    StandIn("device_2_32-all_reduce", "comm", "fn, args = c.all_reduce, (T(get_device=1 << 32),)",
            "ValueError", "all_reduce: tensor.get_device() is 4294967296, " + DEV),
    StandIn("device_2_32-comms", "nccl", "fn, args, kw = nccl.all_reduce, ([T(get_device=1 << 32)],), {'comms': [c]}",
            "ValueError", "all_reduce: inputs[0].get_device() is 4294967296, " + DEV),
    StandIn("device_out_of_range-clique", "nccl", "fn, args = nccl.all_reduce, ([T(get_device=7)],)",
            "RuntimeError", "all_reduce: inputs[0] is on cuda:7 but this process has 2 CUDA devices"),
    StandIn("data_ptr_negative-send", "comm", "fn, args = c.send, (T(data_ptr=-4096), 1)",
            "ValueError", "send: tensor.data_ptr() is -4096, expected an address (0 to 2**64-1)"),
    StandIn("data_ptr_null-recv", "comm", "fn, args = c.recv, (T(data_ptr=0), 1)",
            "ValueError", "recv: tensor has a null data pointer"),
    # 6. the communicator destroyed or aborted by user code during the checks
    StandIn("destroyed_by_numel-all_reduce", "comm", "fn, args = c.all_reduce, (T(numel=then(c.destroy, 4)),)",
            "RuntimeError", "all_reduce: " + GONE),
    StandIn("destroyed_by_cai-all_gather", "comm",
            "fn, args = c.all_gather, (A(2), A(4, on_read=c.destroy))", "RuntimeError", "all_gather: " + GONE),
    StandIn("destroyed_by_stream-broadcast", "comm",
            "fn, args, kw = c.broadcast, (T(), 0), {'stream': HostileStream(c.destroy)}",
            "RuntimeError", "broadcast: " + GONE),
    StandIn("destroyed_by_stream-barrier", "comm", "fn, args, kw = c.barrier, (), {'stream': HostileStream(c.destroy)}",
            "RuntimeError", "barrier: " + GONE),
    StandIn("destroyed_by_premul-all_reduce", "comm", "fn, args = c.all_reduce, (T(), HostileOp(c.destroy))",
            "RuntimeError", "all_reduce: " + GONE),
    StandIn("aborted_by_numel-reduce_scatter", "comm",
            "fn, args = c.reduce_scatter, (T(8), T(numel=then(c.abort, 4)))", "RuntimeError", "reduce_scatter: " + ABORTED),
    StandIn("destroyed_by_numel-comms", "nccl",
            "fn, args, kw = nccl.all_reduce, ([T(numel=then(c.destroy, 4))],), {'comms': [c]}",
            "RuntimeError", "all_reduce: " + GONE),
    StandIn("destroyed_by_stream-comms", "nccl",
            "fn, args, kw = nccl.broadcast, ([T()],), {'comms': [c], 'streams': [HostileStream(c.destroy)]}",
            "RuntimeError", "broadcast: " + GONE),
    # 7. registration (the stand-in's registrations are counted; none may be left)
    StandIn("destroyed_by_numel-register", "comm", "fn, args = c.register, (T(numel=then(c.destroy, 4)),)",
            "RuntimeError", "register: " + GONE),
    StandIn("destroyed_by_numel-register_window", "comm",
            "fn, args = c.register_window, (T(numel=then(c.destroy, 4)),)", "RuntimeError", "register_window: " + GONE),
    StandIn("aborted-register", "comm", "c.abort()\nfn, args = c.register, (T(),)",
            "RuntimeError", "register: " + ABORTED),
    StandIn("data_ptr_null-register", "comm", "fn, args = c.register, (T(data_ptr=0),)",
            "ValueError", "register: tensor has a null data pointer"),
    StandIn("device_1-register", "comm", "fn, args = c.register, (T(get_device=1),)",
            "ValueError", "register: tensor is on cuda:1 but the communicator (rank 0) is on cuda:0"),
    StandIn("timed_destroyed_by_numel-all_reduce", "comm",
            "ct = comm(timeout=5)\nfn, args = ct.all_reduce, (T(numel=then(ct.destroy, 4)),)",
            "RuntimeError", "all_reduce: " + GONE),
]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    import json
    from _fakes import run_stand_in
    rows = [{"id": f"{c.api}-{c.id}", "code": c.code} for c in STAND_IN_CASES]
    return run_stand_in(tmp_path_factory.mktemp("fakegpu"), "bad_input", stdin=json.dumps(rows))


@pytest.mark.parametrize("case", STAND_IN_CASES, ids=_ids(STAND_IN_CASES))
def test_stand_in_tier(case, stand_in):
    got = stand_in[f"{case.api}-{case.id}"]
    want = None if case.exc is None else [case.exc, case.msg, *case.notes]
    assert got["exc"] == want
    assert got["refs_ok"], got["refs"]
    assert got["usable"] == "ok"


def _build_lib(out_dir, name, source):
    """A one-file shared library built with Python's C compiler; None without one."""
    import shlex
    import shutil
    import subprocess
    import sysconfig
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        return None
    src, lib = out_dir / f"{name}.c", out_dir / f"lib{name}.so"
    src.write_text(source)
    r = subprocess.run(cc + ["-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return str(lib)


def test_loader_messages(tmp_path):
    """The first GPU use names what it looked for and where, and tells a library that is not
    NCCL (a wrong PYCCL_NCCL_LIBRARY) from an NCCL too old; all RuntimeError, as torch's own
    failures to reach CUDA at first use are."""
    import json
    import os
    from _fakes import run_stand_in
    not_nccl = _build_lib(tmp_path, "notnccl", "int not_nccl(void) { return 1; }\n")
    old = _build_lib(tmp_path, "oldnccl", "int ncclGetVersion(int *v) { *v = 20603; return 0; }\n")
    if not_nccl is None:
        pytest.skip("no C compiler to build the stand-in libraries")
    (tmp_path / "fakegpu").mkdir()
    got = run_stand_in(tmp_path / "fakegpu", "loader_messages", stdin=json.dumps({"not_nccl": not_nccl, "old": old}))
    assert got["not_nccl"] == ["RuntimeError", f"unique_id: {not_nccl} is not NCCL: it has no ncclGetVersion "
                                               "(set PYCCL_NCCL_LIBRARY to a libnccl.so.2, or unset it)"]
    assert got["old"] == ["RuntimeError", f"unique_id: the NCCL at {old} (2.6.3) lacks ncclGetUniqueId; "
                                          "pyccl needs NCCL >= 2.7"]
    if got["missing"] is None:
        # the dynamic loader's search path holds an NCCL here (a GPU machine's): it was loaded,
        # nothing is missing to report
        assert got["then"] is None
        return
    assert got["then"] == 128
    ld = os.environ.get("LD_LIBRARY_PATH") or "unset"
    head, tried = got["missing"][1].split(" Tried: ")
    assert got["missing"][0] == "RuntimeError"
    assert head == ("unique_id: cannot load NCCL (install nvidia-nccl-cu13 or set PYCCL_NCCL_LIBRARY). Looked "
                    "for libnccl.so.2, libnccl.so among the libraries already loaded (torch's), at the candidate "
                    f"paths (none), then through the dynamic loader's search path (LD_LIBRARY_PATH={ld}, "
                    "ld.so.cache).")
    assert [t.split(":")[0] for t in tried.split("; ")] == ["libnccl.so.2", "libnccl.so"], tried


# ====================================================================== GPU tier

F = dict(device="cuda:0")


class CAI:
    """An array known only by its __cuda_array_interface__ (no torch, no GPU call)."""

    def __init__(self, shape, ptr, strides=None, typestr="<f4", **extra):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3, **extra}


class RawCAI:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


class Gpu:
    """One-rank communicators on cuda:0 (a live one and a destroyed one) and a buffer to take views of."""

    def __init__(self, comm, dead):
        self.comm, self.dead = comm, dead
        self.buf = torch.arange(1, 65, dtype=torch.float32, device="cuda:0")
        self.host = torch.arange(8, dtype=torch.float32)  # host memory behind a CAI pointer

    def addr(self, elem=0):
        return f"{self.buf.data_ptr() + 4 * elem:#x}"


OPS_PREMUL = ("SUM=0, PROD=1, MAX=2, MIN=3, AVG=4, their names as strings ('sum', ...), "
              "a torch.distributed.ReduceOp, or pyccl.premul_sum(x)")
NOT_OP = f"is not a reduction op ({OPS_PREMUL})"
BOOL = "cannot reduce torch.bool tensors (NCCL has no boolean reduction); convert to torch.uint8 first"
INT64_RANGE = "from -9223372036854775808 to 9223372036854775807"
ON_1 = "is on cuda:1 but the communicator (rank 0) is on cuda:0"
STREAM_1 = "is a stream of cuda:1 but the communicator (rank 0) is on cuda:0"


def _gpu_cases():
    C = []
    add = lambda *a: C.append(Case(*a))  # noqa: E731
    ones = lambda n, **kw: torch.ones(n, **F, **kw)  # noqa: E731
    # ---- parsing
    add("missing_tensor", "comm", lambda g: g.comm.all_reduce(), TypeError,
        "all_reduce() missing required argument 'tensor'")
    add("too_many_positional", "comm", lambda g: g.comm.all_reduce(ones(2), 0, None, None, 5), TypeError,
        "all_reduce() takes at most 2 positional arguments (5 given)")
    add("unknown_keyword", "comm", lambda g: g.comm.all_reduce(ones(2), bogus=1), TypeError,
        "all_reduce() got an unexpected keyword argument 'bogus'")
    add("op_twice", "comm", lambda g: g.comm.all_reduce(ones(2), 0, op=0), TypeError,
        "all_reduce() got multiple values for argument 'op'")
    add("missing_root", "comm", lambda g: g.comm.broadcast(ones(2)), TypeError,
        "broadcast() missing required argument 'root'")
    add("missing_peer", "comm", lambda g: g.comm.recv(ones(2)), TypeError, "recv() missing required argument 'peer'")
    add("barrier_positional", "comm", lambda g: g.comm.barrier(1), TypeError,
        "barrier() takes at most 0 positional arguments (1 given)")
    # ---- what a tensor may be
    add("int_tensor", "comm", lambda g: g.comm.all_reduce(3), TypeError,
        "all_reduce: tensor must be a torch.Tensor or an array with __cuda_array_interface__, got int")
    add("cpu_tensor", "comm", lambda g: g.comm.all_reduce(torch.ones(2)), ValueError,
        "all_reduce: tensor must be a CUDA tensor, got one on cpu")
    add("cpu_out", "comm", lambda g: g.comm.broadcast(ones(2), 0, out=torch.ones(2)), ValueError,
        "broadcast: out must be a CUDA tensor, got one on cpu")
    add("non_contiguous", "comm", lambda g: g.comm.all_reduce(torch.ones(4, 4, **F).t()), ValueError,
        "all_reduce: tensor must be contiguous")
    add("non_contiguous_output", "comm", lambda g: g.comm.all_gather(ones(4), torch.ones(2, 2, **F).t()),
        ValueError, "all_gather: output must be contiguous")
    add("sparse", "comm", lambda g: g.comm.all_reduce(torch.ones(4, **F).to_sparse()), ValueError,
        "all_reduce: tensor must be a dense (strided) tensor, got layout torch.sparse_coo")
    # ---- sizes and dtypes
    add("out_size", "comm", lambda g: g.comm.all_reduce(ones(2), out=ones(3)), ValueError,
        "all_reduce: out has 3 elements, expected 2 (same as tensor)")
    add("out_dtype", "comm", lambda g: g.comm.all_reduce(ones(2), out=ones(2, dtype=torch.float16)), TypeError,
        "all_reduce: out has dtype torch.float16 but tensor has torch.float32")
    add("broadcast_out_size", "comm", lambda g: g.comm.broadcast(ones(2), 0, out=ones(1)), ValueError,
        "broadcast: out has 1 elements, expected 2 (same as tensor)")
    add("all_gather_output_size", "comm", lambda g: g.comm.all_gather(ones(2), ones(3)), ValueError,
        "all_gather: output has 3 elements, expected 2 (input size x world size)")
    add("all_gather_list_length", "comm", lambda g: g.comm.all_gather(ones(2), [ones(2)] * 2), ValueError,
        "all_gather: output has 2 tensors, expected 1 (one per rank)")
    add("all_gather_list_item_size", "comm", lambda g: g.comm.all_gather(ones(2), [ones(3)]), ValueError,
        "all_gather: output[0] has 3 elements, expected 2 (one chunk per rank)")
    add("all_gather_list_item_dtype", "comm",
        lambda g: g.comm.all_gather(ones(2), [ones(2, dtype=torch.int32)]), TypeError,
        "all_gather: output[0] has dtype torch.int32 but input has torch.float32")
    add("all_gather_output_dtype", "comm", lambda g: g.comm.all_gather(ones(2), ones(2, dtype=torch.float64)),
        TypeError, "all_gather: output has dtype torch.float64 but input has torch.float32")
    add("reduce_scatter_input_size", "comm", lambda g: g.comm.reduce_scatter(ones(3), ones(2)), ValueError,
        "reduce_scatter: input has 3 elements, expected 2 (output size x world size)")
    add("reduce_scatter_list_item_size", "comm", lambda g: g.comm.reduce_scatter([ones(2)], ones(3)), ValueError,
        "reduce_scatter: input[0] has 2 elements, expected 3 (one chunk per rank)")
    add("all_to_all_output_size", "comm", lambda g: g.comm.all_to_all(ones(2), ones(3)), ValueError,
        "all_to_all: output has 3 elements, expected 2 (one chunk per rank)")
    add("all_to_all_empty_list", "comm", lambda g: g.comm.all_to_all([], ones(3)), ValueError,
        "all_to_all: input has 0 tensors, expected 1 (one per rank)")
    add("splits_sum", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), [3], [4]), ValueError,
        "all_to_all_single: input_splits sum to 3 rows but dim 0 has 4")
    add("splits_length", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), [4, 0], None), ValueError,
        "all_to_all_single: input_splits must be a list of 1 row counts")
    add("splits_negative", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), [-4], None), ValueError,
        "all_to_all_single: input_splits[0]=-4 is negative")
    add("splits_str", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), ["4"], None), TypeError,
        "all_to_all_single: input_splits[0] must be an int, got str")
    add("splits_float", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), None, [4.0]), TypeError,
        "all_to_all_single: output_splits[0] must be an int, got float")
    add("splits_2^70", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), [1 << 70], None), ValueError,
        "all_to_all_single: input_splits sum to more than the 4 rows of dim 0")
    add("splits_-2^70", "comm", lambda g: g.comm.all_to_all_single(ones(4), ones(4), [-(1 << 70)], None),
        ValueError, "all_to_all_single: input_splits[0]=-1180591620717411303424 is negative")
    add("row_sizes", "comm", lambda g: g.comm.all_to_all_single(torch.ones(4, 2, **F), torch.ones(4, 3, **F)),
        ValueError, "all_to_all_single: input rows have 2 elements but output rows have 3")
    # ---- ranks
    rng = "is out of range for a communicator of size 1 (ranks are 0..0)"
    add("broadcast_root_1", "comm", lambda g: g.comm.broadcast(ones(2), 1), ValueError, f"broadcast: root=1 {rng}")
    add("broadcast_root_-1", "comm", lambda g: g.comm.broadcast(ones(2), -1), ValueError, f"broadcast: root=-1 {rng}")
    add("broadcast_root_str", "comm", lambda g: g.comm.broadcast(ones(2), "0"), TypeError,
        "broadcast: root must be an int, got str")
    add("reduce_root_3", "comm", lambda g: g.comm.reduce(ones(2), 3), ValueError, f"reduce: root=3 {rng}")
    add("reduce_root_2^70", "comm", lambda g: g.comm.reduce(ones(2), 1 << 70), ValueError,
        f"reduce: root=1180591620717411303424 {rng}")
    add("send_peer_1", "comm", lambda g: g.comm.send(ones(2), 1), ValueError, f"send: peer=1 {rng}")
    add("recv_peer_bool", "comm", lambda g: g.comm.recv(ones(2), True), TypeError, "recv: peer must be an int, got bool")
    add("gather_root_2", "comm", lambda g: g.comm.gather(ones(2), [ones(2)], 2), ValueError, f"gather: root=2 {rng}")
    add("scatter_root_-3", "comm", lambda g: g.comm.scatter([ones(2)], ones(2), -3), ValueError,
        f"scatter: root=-3 {rng}")
    add("gather_no_outputs_on_root", "comm", lambda g: g.comm.gather(ones(2), None, 0), ValueError,
        "gather: outputs is required on the root (rank 0)")
    add("scatter_no_inputs_on_root", "comm", lambda g: g.comm.scatter(None, ones(2), 0), ValueError,
        "scatter: inputs is required on the root (rank 0)")
    add("split_color_str", "comm", lambda g: g.comm.split("a"), TypeError, "split: color must be an int, got str")
    add("split_key_float", "comm", lambda g: g.comm.split(0, key=1.5), TypeError, "split: key must be an int, got float")
    add("split_color_2^31", "comm", lambda g: g.comm.split(1 << 31), ValueError,
        "split: color=2147483648 is out of range")
    add("split_color_2^70", "comm", lambda g: g.comm.split(1 << 70), ValueError,
        "split: color=1180591620717411303424 is out of range")
    add("split_key_2^40", "comm", lambda g: g.comm.split(0, key=1 << 40), ValueError,
        "split: key=1099511627776 is out of range")
    # ---- ops and dtypes
    add("op_9", "comm", lambda g: g.comm.all_reduce(ones(2), op=9), ValueError, f"all_reduce: op=9 {NOT_OP}")
    add("op_-1", "comm", lambda g: g.comm.reduce_scatter(ones(2), ones(2), op=-1), ValueError,
        f"reduce_scatter: op=-1 {NOT_OP}")
    add("op_2^70", "comm", lambda g: g.comm.all_reduce(ones(2), op=1 << 70), ValueError,
        f"all_reduce: op=1180591620717411303424 {NOT_OP}")
    add("reduce_op_17", "comm", lambda g: g.comm.reduce(ones(2), 0, 17), ValueError, f"reduce: op=17 {NOT_OP}")
    add("op_str", "comm", lambda g: g.comm.all_reduce(ones(2), op="bitwise_or"), ValueError,
        f"all_reduce: op='bitwise_or' {NOT_OP}")
    add("op_float", "comm", lambda g: g.comm.all_reduce(ones(2), op=2.0), TypeError,
        f"all_reduce: op must be a reduction op ({OPS_PREMUL}), got float")
    add("op_ReduceOp_BOR", "comm", lambda g: g.comm.reduce(ones(2), 0, torch.distributed.ReduceOp.BOR), ValueError,
        f"reduce: op=ReduceOp.BOR has no NCCL reduction ({OPS_PREMUL})")
    add("bool-all_reduce", "comm", lambda g: g.comm.all_reduce(ones(2, dtype=torch.bool)), RuntimeError,
        f"all_reduce: {BOOL}")
    add("bool-reduce", "comm", lambda g: g.comm.reduce(ones(2, dtype=torch.bool), 0), RuntimeError, f"reduce: {BOOL}")
    add("bool-reduce_scatter", "comm",
        lambda g: g.comm.reduce_scatter(ones(2, dtype=torch.bool), ones(2, dtype=torch.bool)), RuntimeError,
        f"reduce_scatter: {BOOL}")
    add("complex64", "comm", lambda g: g.comm.all_reduce(ones(2, dtype=torch.complex64)), TypeError,
        f"all_reduce: tensor has dtype torch.complex64, {NO_REDUCE}")
    add("int16", "comm", lambda g: g.comm.reduce(ones(2, dtype=torch.int16), 0), TypeError,
        f"reduce: tensor has dtype torch.int16, {NO_REDUCE}")
    add("premul_sum_fp8", "comm",
        lambda g: g.comm.all_reduce(ones(2, dtype=torch.float8_e5m2), op=pyccl.premul_sum(2)), TypeError,
        "all_reduce: premul_sum does not support torch.float8_e5m2")
    add("premul_sum_0.5_int32", "comm",
        lambda g: g.comm.all_reduce(ones(2, dtype=torch.int32), op=pyccl.premul_sum(0.5)), ValueError,
        "all_reduce: pyccl.premul_sum(0.5) needs a whole-number scalar from -2147483648 to 2147483647 for torch.int32")
    add("premul_sum_300_int8", "comm",
        lambda g: g.comm.reduce(ones(2, dtype=torch.int8), 0, pyccl.premul_sum(300)), ValueError,
        "reduce: pyccl.premul_sum(300.0) needs a whole-number scalar from -128 to 127 for torch.int8")
    add("premul_sum_-1_uint8", "comm",
        lambda g: g.comm.reduce_scatter(ones(2, dtype=torch.uint8), ones(2, dtype=torch.uint8),
                                        pyccl.premul_sum(-1)), ValueError,
        "reduce_scatter: pyccl.premul_sum(-1.0) needs a whole-number scalar from 0 to 255 for torch.uint8")
    add("premul_sum_2^32_uint32", "comm",
        lambda g: g.comm.all_reduce(torch.empty(2, dtype=torch.uint32, **F), op=pyccl.premul_sum(1 << 32)),
        ValueError,
        "all_reduce: pyccl.premul_sum(4294967296.0) needs a whole-number scalar from 0 to 4294967295 for torch.uint32")
    add("premul_sum_nan_int64", "comm",
        lambda g: g.comm.all_reduce(ones(2, dtype=torch.int64), op=pyccl.premul_sum(float("nan"))), ValueError,
        f"all_reduce: pyccl.premul_sum(nan) needs a whole-number scalar {INT64_RANGE} for torch.int64")
    add("premul_sum_inf_int64", "comm",
        lambda g: g.comm.all_reduce(ones(2, dtype=torch.int64), op=pyccl.premul_sum(float("-inf"))), ValueError,
        f"all_reduce: pyccl.premul_sum(-inf) needs a whole-number scalar {INT64_RANGE} for torch.int64")
    # ---- overlapping buffers: only NCCL's in-place forms may share memory
    add("all_gather_output_overlaps_input", "comm", lambda g: g.comm.all_gather(g.buf[1:5], g.buf[0:4]), ValueError,
        lambda g: f"all_gather: input (16 bytes at {g.addr(1)}) overlaps output (16 bytes at {g.addr(0)}) but is "
                  f"not rank 0's slot of it; in place, input must be the 16 bytes at {g.addr(0)}")
    add("all_gather_list_overlaps_input", "comm", lambda g: g.comm.all_gather(g.buf[1:5], [g.buf[0:4]]), ValueError,
        lambda g: f"all_gather: input (16 bytes at {g.addr(1)}) overlaps output[0] (16 bytes at {g.addr(0)}) but "
                  f"is not the same memory; in place, input must be the 16 bytes at {g.addr(0)}")
    add("reduce_scatter_output_overlaps_input", "comm",
        lambda g: g.comm.reduce_scatter(g.buf[0:4], g.buf[1:5]), ValueError,
        lambda g: f"reduce_scatter: output (16 bytes at {g.addr(1)}) overlaps input (16 bytes at {g.addr(0)}) but "
                  f"is not rank 0's slot of it; in place, output must be the 16 bytes at {g.addr(0)}")
    add("reduce_scatter_list_overlaps_output", "comm",
        lambda g: g.comm.reduce_scatter([g.buf[0:4]], g.buf[2:6]), ValueError,
        lambda g: f"reduce_scatter: output (16 bytes at {g.addr(2)}) overlaps input[0] (16 bytes at {g.addr(0)}) "
                  f"but is not the same memory; in place, output must be the 16 bytes at {g.addr(0)}")
    add("all_reduce_out_overlaps_tensor", "comm", lambda g: g.comm.all_reduce(g.buf[0:4], out=g.buf[2:6]),
        ValueError,
        lambda g: f"all_reduce: out (16 bytes at {g.addr(2)}) overlaps tensor (16 bytes at {g.addr(0)}) but is "
                  f"not the same memory; in place, out must be the 16 bytes at {g.addr(0)}")
    add("broadcast_out_overlaps_tensor", "comm", lambda g: g.comm.broadcast(g.buf[0:4], 0, out=g.buf[3:7]),
        ValueError,
        lambda g: f"broadcast: out (16 bytes at {g.addr(3)}) overlaps tensor (16 bytes at {g.addr(0)}) but is "
                  f"not the same memory; in place, out must be the 16 bytes at {g.addr(0)}")
    add("reduce_out_overlaps_tensor", "comm", lambda g: g.comm.reduce(g.buf[4:8], 0, out=g.buf[1:5]), ValueError,
        lambda g: f"reduce: out (16 bytes at {g.addr(1)}) overlaps tensor (16 bytes at {g.addr(4)}) but is not "
                  f"the same memory; in place, out must be the 16 bytes at {g.addr(4)}")
    # ---- __cuda_array_interface__ objects (read without torch)
    mal = "all_reduce: tensor has a malformed __cuda_array_interface__"
    add("cai_negative_shape", "comm", lambda g: g.comm.all_reduce(CAI((-4,), 0)), ValueError,
        "all_reduce: tensor has an invalid shape (-4,)")
    add("cai_shape_overflow", "comm", lambda g: g.comm.all_reduce(CAI((1 << 40, 1 << 40), g.buf.data_ptr())),
        ValueError, "all_reduce: tensor has an invalid shape (1099511627776, 1099511627776)")
    add("cai_shape_2^70", "comm", lambda g: g.comm.all_reduce(CAI((1 << 70,), g.buf.data_ptr())), ValueError,
        "all_reduce: tensor has an invalid shape (1180591620717411303424,)")
    add("cai_shape_str", "comm", lambda g: g.comm.all_reduce(CAI(("4",), g.buf.data_ptr())), TypeError,
        f"{mal} (shape)")
    add("cai_null_pointer", "comm", lambda g: g.comm.all_reduce(CAI((4,), 0)), ValueError,
        "all_reduce: tensor has a null data pointer")
    add("cai_negative_pointer", "comm", lambda g: g.comm.all_reduce(CAI((4,), -1)), TypeError, f"{mal} (data)")
    add("cai_str_pointer", "comm", lambda g: g.comm.all_reduce(CAI((4,), "0x10")), TypeError, f"{mal} (data)")
    add("cai_host_pointer", "comm", lambda g: g.comm.all_reduce(CAI((4,), g.host.data_ptr())), ValueError,
        "all_reduce: tensor must be in CUDA device memory")
    add("cai_strides_length", "comm", lambda g: g.comm.all_reduce(CAI((2, 2), 0, strides=(8,))), TypeError,
        f"{mal} (strides)")
    add("cai_strides_str", "comm", lambda g: g.comm.all_reduce(CAI((4,), g.buf.data_ptr(), strides=("4",))),
        TypeError, f"{mal} (strides)")
    add("cai_non_contiguous", "comm",
        lambda g: g.comm.all_reduce(CAI((2, 2), g.buf.data_ptr(), strides=(4, 8))), ValueError,
        "all_reduce: tensor must be contiguous")
    add("cai_typestr_f16", "comm", lambda g: g.comm.all_reduce(CAI((4,), 0, typestr="<f16")), TypeError,
        "all_reduce: tensor has element type '<f16', which pyccl cannot map to a torch dtype")
    add("cai_big_endian", "comm", lambda g: g.comm.all_reduce(CAI((4,), g.buf.data_ptr(), typestr=">f4")),
        TypeError, "all_reduce: tensor has element type '>f4', which pyccl cannot map to a torch dtype")
    add("cai_not_a_dict", "comm", lambda g: g.comm.all_reduce(RawCAI([(4,), "<f4"])), TypeError, mal)
    add("cai_no_typestr", "comm", lambda g: g.comm.all_reduce(RawCAI({"shape": (4,), "data": (1, False)})),
        TypeError, mal)
    add("cai_mask", "comm",
        lambda g: g.comm.all_reduce(CAI((4,), g.buf.data_ptr(), mask=CAI((4,), g.buf.data_ptr(), typestr="|b1"))),
        ValueError, "all_reduce: tensor is a masked array (its __cuda_array_interface__ has a mask), "
                    "which NCCL cannot honour")
    add("cai_out_dtype", "comm",
        lambda g: g.comm.all_reduce(CAI((2,), g.buf.data_ptr()), out=ones(2, dtype=torch.int32)), TypeError,
        "all_reduce: out has dtype torch.int32 but tensor has torch.float32")
    # ---- streams
    add("stream_int", "comm", lambda g: g.comm.all_reduce(ones(2), stream=5), TypeError,
        "all_reduce: stream must be a torch.cuda.Stream or None, got int")
    # ---- construction that needs the GPU count
    add("device_99", "comm", lambda g: pyccl.Communicator(1, pyccl.unique_id(), 0, device=99), ValueError,
        lambda g: "Communicator: device 99 does not exist (this process sees %d GPUs)" % gpu_count())
    add("device_-1", "comm", lambda g: pyccl.Communicator(1, pyccl.unique_id(), 0, device=-1), ValueError,
        "Communicator: device must be >= 0, got -1")
    # ---- a destroyed communicator: every method
    dead = "the communicator (rank 0 of 1) has been destroyed"
    for name, call in [
            ("all_reduce", lambda c: c.all_reduce(ones(2))),
            ("broadcast", lambda c: c.broadcast(ones(2), 0)),
            ("reduce", lambda c: c.reduce(ones(2), 0)),
            ("all_gather", lambda c: c.all_gather(ones(2), ones(2))),
            ("reduce_scatter", lambda c: c.reduce_scatter(ones(2), ones(2))),
            ("send", lambda c: c.send(ones(2), 0)),
            ("recv", lambda c: c.recv(ones(2), 0)),
            ("all_to_all", lambda c: c.all_to_all(ones(2), ones(2))),
            ("all_to_all_single", lambda c: c.all_to_all_single(ones(2), ones(2))),
            ("gather", lambda c: c.gather(ones(2), [ones(2)], 0)),
            ("scatter", lambda c: c.scatter([ones(2)], ones(2), 0)),
            ("barrier", lambda c: c.barrier()),
            ("split", lambda c: c.split(0))]:
        add(f"destroyed-{name}", "comm", lambda g, call=call: call(g.dead), RuntimeError, f"{name}: {dead}")
    add("destroyed-comms", "nccl", lambda g: nccl.all_reduce([ones(2)], comms=[g.dead]), RuntimeError,
        f"all_reduce: {dead}")
    add("root_past_comm_size", "nccl", lambda g: nccl.broadcast([ones(2)], root=1, comms=[g.comm]), RuntimeError,
        "invalid root")
    add("reduce_root_past_comm_size", "nccl", lambda g: nccl.reduce([ones(2)], root=-1, comms=[g.comm]),
        RuntimeError, "invalid root")
    # ---- another device, another device's stream (2 GPUs)
    one = dict(device="cuda:1")
    add("tensor_on_cuda1", "comm", lambda g: g.comm.all_reduce(torch.ones(2, **one)), ValueError,
        f"all_reduce: tensor {ON_1}", 2)
    add("out_on_cuda1", "comm", lambda g: g.comm.all_reduce(ones(2), out=torch.ones(2, **one)), ValueError,
        f"all_reduce: out {ON_1}", 2)
    add("output_on_cuda1", "comm", lambda g: g.comm.all_gather(ones(2), torch.ones(2, **one)), ValueError,
        f"all_gather: output {ON_1}", 2)
    add("output_item_on_cuda1", "comm", lambda g: g.comm.all_gather(ones(2), [torch.ones(2, **one)]), ValueError,
        f"all_gather: output[0] {ON_1}", 2)
    add("cai_on_cuda1", "comm",
        lambda g: g.comm.all_reduce(CAI((2,), g.keep(torch.ones(2, **one)).data_ptr())), ValueError,
        f"all_reduce: tensor {ON_1}", 2)
    add("stream_of_cuda1", "comm", lambda g: g.comm.all_reduce(ones(2), stream=torch.cuda.Stream(device=1)),
        ValueError, f"all_reduce: stream {STREAM_1}", 2)
    add("barrier_stream_of_cuda1", "comm", lambda g: g.comm.barrier(stream=torch.cuda.Stream(device=1)),
        ValueError, f"barrier: stream {STREAM_1}", 2)
    add("send_stream_of_cuda1", "comm", lambda g: g.comm.send(ones(2), 0, stream=torch.cuda.Stream(device=1)),
        ValueError, f"send: stream {STREAM_1}", 2)
    add("inputs_on_other_device_than_comms", "nccl", lambda g: nccl.all_reduce([torch.ones(2, **one)], comms=[g.comm]),
        RuntimeError, "all_reduce: inputs[0] is on cuda:1 but comms[0] (rank 0) is on cuda:0", 2)
    add("stream_of_other_device", "nccl",
        lambda g: nccl.all_reduce([ones(4), torch.ones(4, **one)], streams=[torch.cuda.Stream(device=1)] * 2),
        ValueError, "all_reduce: streams[0] is a stream of cuda:1 but its tensor is on cuda:0", 2)
    add("zero_elements_stream_still_checked", "nccl",
        lambda g: nccl.all_reduce([ones(0), torch.ones(0, **one)], streams=[None, torch.cuda.Stream(device=0)]),
        ValueError, "all_reduce: streams[1] is a stream of cuda:0 but its tensor is on cuda:1", 2)
    # ---- registered memory (a one-rank communicator: a window's exchange has no peer to wait for)
    add("register_cpu_tensor", "comm", lambda g: g.comm.register(torch.ones(2)), ValueError,
        "register: tensor must be a CUDA tensor, got one on cpu")
    add("register_window_cpu_tensor", "comm", lambda g: g.comm.register_window(torch.ones(2)), ValueError,
        "register_window: tensor must be a CUDA tensor, got one on cpu")
    add("register_non_contiguous", "comm", lambda g: g.comm.register(torch.ones(4, 4, **F).t()), ValueError,
        "register: tensor must be contiguous")
    add("register_zero_elements", "comm", lambda g: g.comm.register(ones(0)), ValueError,
        "register: tensor has no bytes to register (0 elements)")
    add("register_window_caching_allocator", "comm", lambda g: g.comm.register_window(ones(1024)), ValueError,
        "register_window: the tensor's memory was not allocated with cuMem (torch's default caching allocator "
        "uses cudaMalloc); allocate it with pyccl.empty() or inside torch.cuda.use_mem_pool(pyccl.mem_pool())")
    add("register_destroyed", "comm", lambda g: g.dead.register(ones(2)), RuntimeError,
        "register: the communicator (rank 0 of 1) has been destroyed")
    add("register_window_destroyed", "comm", lambda g: g.dead.register_window(ones(2)), RuntimeError,
        "register_window: the communicator (rank 0 of 1) has been destroyed")
    add("register_on_cuda1", "comm", lambda g: g.comm.register(torch.ones(2, device="cuda:1")), ValueError,
        f"register: tensor {ON_1}", 2)
    add("register_window_on_cuda1", "comm", lambda g: g.comm.register_window(torch.ones(2, device="cuda:1")),
        ValueError, f"register_window: tensor {ON_1}", 2)
    add("empty_device_out_of_range", "comm", lambda g: pyccl.empty(8, device=gpu_count()), ValueError,
        lambda g: f"empty: device {gpu_count()} does not exist (this process sees {gpu_count()} GPUs)")
    return C


GPU_CASES = _gpu_cases()


@pytest.fixture(scope="module")
def gpu():
    if gpu_count() < 1:
        pytest.skip("needs 1 CUDA GPU")
    torch.cuda.set_device(0)
    comm = pyccl.Communicator(1, pyccl.unique_id(), 0)
    dead = pyccl.Communicator(1, pyccl.unique_id(), 0)
    dead.destroy()
    g = Gpu(comm, dead)
    kept = []
    g.keep = lambda t: kept.append(t) or t  # memory a CAI row points at, alive for the test
    yield g
    comm.destroy()


def _usable_on_gpu(g):
    """A premul_sum all_reduce (a real NCCL reduction even on one rank) into a
    separate output, and an all_reduce over up to two GPUs, both bitwise."""
    t = torch.arange(1, 6, dtype=torch.float32, device="cuda:0")
    out = torch.full_like(t, 3)
    g.comm.all_reduce(t, op=pyccl.premul_sum(3), out=out)
    torch.cuda.synchronize(0)
    assert same_bits(out, torch.arange(1, 6, dtype=torch.float32) * 3)
    assert same_bits(t, torch.arange(1, 6, dtype=torch.float32))
    assert same_bits(g.buf, torch.arange(1, 65, dtype=torch.float32))  # no refused call wrote
    _real_all_reduce()


@needs_gpus(1)
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids(GPU_CASES))
def test_gpu_tier(case, gpu):
    if gpu_count() < case.gpus:
        pytest.skip(f"needs {case.gpus} CUDA GPUs, this machine has {gpu_count()}")
    gpu.buf = torch.arange(1, 65, dtype=torch.float32, device="cuda:0")  # fresh: a row may point into it
    with raises(case.exc, _text(case, gpu)):
        case.call(gpu)
    _usable_on_gpu(gpu)


def test_catalogue_size():
    assert len(CPU_CASES) + len(GPU_CASES) >= 40
    assert {c.api for c in GPU_CASES} == {"nccl", "comm"}


@needs_gpus(1)
def test_refcounts_after_errors(gpu):
    t, o, i = torch.ones(2, **F), torch.ones(3, **F), torch.ones(2, dtype=torch.int32, **F)
    before = (sys.getrefcount(t), sys.getrefcount(o), sys.getrefcount(gpu.comm))
    for _ in range(100):
        with pytest.raises(ValueError):
            gpu.comm.all_reduce(t, out=o)
        with pytest.raises(ValueError):
            gpu.comm.all_gather(t, [o, o])
        with pytest.raises(ValueError):
            gpu.comm.all_gather(gpu.buf[1:3], gpu.buf[0:2])
        with pytest.raises(ValueError):
            gpu.comm.all_reduce(i, op=pyccl.premul_sum(0.5))
    assert (sys.getrefcount(t), sys.getrefcount(o), sys.getrefcount(gpu.comm)) == before


@needs_gpus(1)
def test_premul_and_avg_on_one_rank(gpu):
    t = torch.arange(6, dtype=torch.float16, device="cuda:0")
    gpu.comm.all_reduce(t, op=pyccl.premul_sum(3))
    i = torch.arange(6, dtype=torch.int32, device="cuda:0")
    gpu.comm.all_reduce(i, op=pyccl.AVG)
    # whole-number scalars in range are taken for integer dtypes, negative ones too
    j = torch.arange(6, dtype=torch.int8, device="cuda:0")
    gpu.comm.all_reduce(j, op=pyccl.premul_sum(-2))
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(6, dtype=torch.float16) * 3)
    assert torch.equal(i.cpu(), torch.arange(6, dtype=torch.int32))
    assert torch.equal(j.cpu(), torch.arange(6, dtype=torch.int8) * -2)


# ---------------- the legal in-place forms (one rank here; two in the spawned rows)

@needs_gpus(1)
def test_in_place_forms_one_rank(gpu):
    c = gpu.comm
    b = torch.arange(1, 13, dtype=torch.float32, device="cuda:0")
    c.all_gather(b[0:4], b[0:4])                     # input is rank 0's slot of output
    c.all_gather(b[4:8], [b[4:8]])                   # input is output[rank]
    c.reduce_scatter(b[8:12], b[8:12], op=pyccl.premul_sum(2))   # output is rank 0's slot of input
    c.reduce_scatter([b[0:2]], b[0:2], op=pyccl.premul_sum(3))   # output is input[rank]
    c.all_reduce(b[4:6], op=pyccl.premul_sum(5), out=b[4:6])
    c.broadcast(b[6:8], 0, out=b[6:8])
    torch.cuda.synchronize(0)
    want = torch.arange(1, 13, dtype=torch.float32)
    want[8:12] *= 2
    want[0:2] *= 3
    want[4:6] *= 5
    assert same_bits(b, want)


# ---------------- zero elements: work, and do nothing

@needs_gpus(1)
def test_zero_elements_every_method(gpu):
    c = gpu.comm
    b = torch.arange(1, 33, dtype=torch.float32, device="cuda:0")
    z = lambda at: b[at:at]  # noqa: E731  (zero elements inside a buffer)
    calls = [
        lambda: c.all_reduce(z(3)), lambda: c.all_reduce(z(3), out=z(9)),
        lambda: c.all_reduce(z(3), op=pyccl.premul_sum(2)),
        lambda: c.broadcast(z(3), 0), lambda: c.reduce(z(3), 0, out=z(7)),
        lambda: c.all_gather(z(3), z(5)), lambda: c.all_gather(z(3), [z(5)]),
        lambda: c.reduce_scatter(z(3), z(5)), lambda: c.reduce_scatter([z(3)], z(5), op=pyccl.MAX),
        lambda: c.send(z(3), 0), lambda: c.recv(z(3), 0),
        lambda: c.all_to_all(z(3), z(5)), lambda: c.all_to_all([z(3)], [z(5)]),
        lambda: c.all_to_all_single(b[3:3].view(0, 1), b[5:5].view(0, 1)),
        lambda: c.gather(z(3), [z(5)], 0), lambda: c.gather(z(3), z(5), 0),
        lambda: c.scatter([z(5)], z(3), 0), lambda: c.scatter(z(5), z(3), 0),
        lambda: c.all_reduce(CAI((0,), 0)), lambda: c.all_reduce(CAI((0, 4), 0)),
    ]
    for call in calls:
        assert call() is None
    torch.cuda.synchronize(0)
    assert same_bits(b, torch.arange(1, 33, dtype=torch.float32))
    _usable_on_gpu(gpu)


@needs_gpus(2, "one process drives two GPUs (the drop-in's list form)")
def test_zero_elements_nccl_api(gpu):
    bufs = [torch.arange(1, 17, dtype=torch.float32, device=f"cuda:{d}") * (d + 1) for d in range(2)]
    z = lambda d, at: bufs[d][at:at]  # noqa: E731
    nccl.all_reduce([z(0, 1), z(1, 2)])
    nccl.all_reduce([z(0, 1), z(1, 2)], [z(0, 4), z(1, 4)], op=nccl.MAX)
    nccl.broadcast([z(0, 1), z(1, 2)], root=1)
    nccl.reduce([z(0, 1), z(1, 2)], z(0, 6), root=0)
    nccl.all_gather([z(0, 1), z(1, 2)], [z(0, 3), z(1, 3)])
    nccl.reduce_scatter([z(0, 1), z(1, 2)], [z(0, 3), z(1, 3)])
    nccl.all_reduce([z(0, 5)], comms=[gpu.comm])
    for d in range(2):
        torch.cuda.synchronize(d)
        assert same_bits(bufs[d], torch.arange(1, 17, dtype=torch.float32) * (d + 1))
    _usable_on_gpu(gpu)


# ---------------- two ranks: rows whose message needs a second rank

def _two_rank_table(comm):
    """(id, call, exception type, message) rows for this rank of `comm`."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    o = (r + 1) % W                           # another rank
    c = 4
    a = lambda t: f"{t.data_ptr():#x}"        # noqa: E731
    big = torch.arange(1, 1 + W * c, dtype=torch.float32, device=dev) + 100 * r
    outs = [torch.zeros(c, device=dev) for _ in range(W)]
    ext = torch.arange(1, 2 + W * c, dtype=torch.float32, device=dev)   # one element more than W chunks
    chunks = list(ext[:W * c].chunk(W))
    rng = f"is out of range for a communicator of size {W} (ranks are 0..{W - 1})"
    rows = [
        ("broadcast_root_W", lambda: comm.broadcast(big, W), ValueError, f"broadcast: root={W} {rng}"),
        ("reduce_root_-1", lambda: comm.reduce(big, -1), ValueError, f"reduce: root=-1 {rng}"),
        ("send_peer_W", lambda: comm.send(big, W), ValueError, f"send: peer={W} {rng}"),
        ("recv_peer_-1", lambda: comm.recv(big, -1), ValueError, f"recv: peer=-1 {rng}"),
        ("gather_root_W", lambda: comm.gather(big[:c], None, W), ValueError, f"gather: root={W} {rng}"),
        ("all_gather_output_size", lambda: comm.all_gather(big[:c], big[:c]), ValueError,
         f"all_gather: output has {c} elements, expected {W * c} (input size x world size)"),
        ("all_gather_list_length", lambda: comm.all_gather(big[:c], outs[:1]), ValueError,
         f"all_gather: output has 1 tensors, expected {W} (one per rank)"),
        ("reduce_scatter_input_size", lambda: comm.reduce_scatter(big[:c], outs[0]), ValueError,
         f"reduce_scatter: input has {c} elements, expected {W * c} (output size x world size)"),
        ("all_to_all_single_splits", lambda: comm.all_to_all_single(big, big.clone(), [W * c]), ValueError,
         f"all_to_all_single: input_splits must be a list of {W} row counts"),
        ("all_gather_input_in_other_slot", lambda: comm.all_gather(big[o * c:(o + 1) * c], big), ValueError,
         f"all_gather: input ({4 * c} bytes at {a(big[o * c:])}) overlaps output ({4 * W * c} bytes at {a(big)}) "
         f"but is not rank {r}'s slot of it; in place, input must be the {4 * c} bytes at {a(big[r * c:])}"),
        ("all_gather_input_is_other_output", lambda: comm.all_gather(outs[o], outs), ValueError,
         f"all_gather: input ({4 * c} bytes at {a(outs[o])}) overlaps output[{o}] ({4 * c} bytes at {a(outs[o])}); "
         f"only output[{r}] may share memory with input (in place)"),
        ("all_gather_input_straddles", lambda: comm.all_gather(ext[r * c + 1:(r + 1) * c + 1], chunks), ValueError,
         f"all_gather: input ({4 * c} bytes at {a(ext[r * c + 1:])}) overlaps output[{r}] ({4 * c} bytes at "
         f"{a(chunks[r])}) but is not the same memory; in place, input must be the {4 * c} bytes at {a(chunks[r])}"),
        ("reduce_scatter_output_in_other_slot", lambda: comm.reduce_scatter(big, big[o * c:(o + 1) * c]), ValueError,
         f"reduce_scatter: output ({4 * c} bytes at {a(big[o * c:])}) overlaps input ({4 * W * c} bytes at "
         f"{a(big)}) but is not rank {r}'s slot of it; in place, output must be the {4 * c} bytes at "
         f"{a(big[r * c:])}"),
        ("reduce_scatter_output_is_other_input", lambda: comm.reduce_scatter(chunks, chunks[o]), ValueError,
         f"reduce_scatter: output ({4 * c} bytes at {a(chunks[o])}) overlaps input[{o}] ({4 * c} bytes at "
         f"{a(chunks[o])}); only input[{r}] may share memory with output (in place)"),
    ]
    return rows


def _two_rank_rows(comm):
    """Runs in each spawned rank.  Both ranks make the same (wrong) call, so a
    missed check leaves them matched, never waiting on each other.  Returns
    the rows that went wrong, as text."""
    W, r, dev = comm.size, comm.rank, f"cuda:{comm.device}"
    c = 4
    failed = []
    for k, (rid, call, exc, msg) in enumerate(_two_rank_table(comm)):
        try:
            call()
        except exc as e:
            if str(e) != msg:
                failed.append(f"rank {r} {rid}: message\n  got  {e}\n  want {msg}")
        except BaseException as e:  # noqa: BLE001 - reported
            failed.append(f"rank {r} {rid}: {type(e).__name__}: {e}")
        else:
            failed.append(f"rank {r} {rid}: did not raise")
        # a correct collective after each row, checked bitwise
        t = torch.arange(1, 1 + 1000, dtype=torch.float32, device=dev) * (r + 1 + k)
        comm.all_reduce(t)
        torch.cuda.synchronize()
        want = torch.arange(1, 1 + 1000, dtype=torch.float32) * sum(q + 1 + k for q in range(W))
        if not same_bits(t, want):
            failed.append(f"rank {r} {rid}: the all_reduce after it is wrong")
    # The legal in-place forms, with W ranks: results checked bitwise.
    vals = [torch.arange(1, 1 + c, dtype=torch.float32) * (q + 2) for q in range(W)]
    g = torch.zeros(W * c, device=dev)
    g[r * c:(r + 1) * c] = vals[r].to(dev)
    comm.all_gather(g[r * c:(r + 1) * c], g)
    lst = [torch.zeros(c, device=dev) for _ in range(W)]
    lst[r].copy_(vals[r])
    comm.all_gather(lst[r], lst)
    rs = torch.cat(vals).to(dev) * (r + 1)
    comm.reduce_scatter(rs, rs[r * c:(r + 1) * c])
    rl = [v.to(dev) * (r + 1) for v in vals]
    comm.reduce_scatter(rl, rl[r])
    torch.cuda.synchronize()
    tri = sum(q + 1 for q in range(W))
    checks = [("all_gather in place", g, torch.cat(vals)),
              ("all_gather list in place", torch.cat([t.cpu() for t in lst]), torch.cat(vals)),
              ("reduce_scatter in place", rs[r * c:(r + 1) * c], vals[r] * tri),
              ("reduce_scatter list in place", rl[r], vals[r] * tri)]
    for what, got, want in checks:
        if not same_bits(got, want):
            failed.append(f"rank {r} {what}: wrong result")
    return failed


@needs_ranks(2)
def test_two_rank_rows():
    from _ranks import run_ranks

    res = run_ranks(_two_rank_rows, 2, timeout=180)
    failed = [f for r in sorted(res) for f in res[r]]
    assert not failed, "\n".join(failed)


# ---------------- counts past 2^31 elements: NCCL takes size_t, so must pyccl

BIG = (1 << 31) + 7
MARKS = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, BIG - 2, BIG - 1]


def _big_int8(dev, rank):
    """int8 of BIG elements: rank + 3 everywhere but at MARKS, where values differ per rank and position."""
    t = torch.full((BIG,), rank + 3, dtype=torch.int8, device=dev)
    t[torch.tensor(MARKS, device=dev)] = torch.tensor(_marks(rank), dtype=torch.int8, device=dev)
    return t


def _marks(rank):
    return [(k * 5 + rank * 11) % 50 + 10 for k in range(len(MARKS))]


def _check_big(t, background, marks):
    """Bitwise over all 2^31+7 elements: background everywhere but at MARKS."""
    idx = torch.tensor(MARKS, device=t.device)
    assert t.numel() == BIG
    assert t[idx].cpu().tolist() == marks
    assert int((t != background).sum()) == len(MARKS)


@needs_gpus(2, "one process drives two GPUs (the drop-in's list form)")
def test_all_reduce_past_2_31_elements_nccl_api():
    ts = [_big_int8(f"cuda:{d}", d) for d in range(2)]
    nccl.all_reduce(ts)
    for d in range(2):
        torch.cuda.synchronize(d)
    sums = [a + b for a, b in zip(_marks(0), _marks(1))]
    for t in ts:
        _check_big(t, 3 + 4, sums)
    del ts
    torch.cuda.empty_cache()


def _big_broadcast(comm):
    t = _big_int8(f"cuda:{comm.device}", comm.rank)
    comm.broadcast(t, 1)
    torch.cuda.synchronize()
    _check_big(t, 1 + 3, _marks(1))
    comm.destroy()
    return "ok"


@needs_ranks(2)
def test_broadcast_past_2_31_elements_communicator():
    from _ranks import run_ranks

    assert run_ranks(_big_broadcast, 2, timeout=300) == {0: "ok", 1: "ok"}

