"""pyccl's own all-reduce kernels at 2, 3, 4 and 8 ranks on ONE GPU (tests/_ar_sim.py): the
kernels as compiled into pyccl._C, each rank a region and a stream of one GPU.

Oracles: integer-valued data against the float64 reference, bitwise; random data against the
kernels' stated order (csrc/kernels/allreduce.cu: every rank sums in rank order 0..n-1, 16-bit
types accumulated in float32 and rounded once), bitwise, and every rank equal to every other.
NCCL is the oracle where there are GPUs for it (test_ar_gpu.py); here there is one.
"""
import time

import pytest
import torch

import _ar_sim as sim
import pyccl
from _data import MAX, MIN, OP_NAMES, SUM, rank_values, reduce_ref, same_bits, to_dtype
from conftest import needs_gpus

pytestmark = [
    needs_gpus(1),
    pytest.mark.skipif(not pyccl._C._ar_built(), reason="pyccl was built without nvcc: no own kernels"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32]
OPS = [SUM, MAX, MIN]
RANKS = [2, 3, 4, 8]
# element counts: 16-byte multiples and not (tails), one block's worth and many
COUNTS = {"ll": [1, 3, 7, 8, 9, 1023, 4097],
          "oneshot": [1, 7, 9, 1023, 65536 + 5, (1 << 18) + 3],
          "twoshot": [1, 7, 9, 1023, 65536 + 5, (1 << 18) + 3]}
HALF, LL_MAX = 2 << 20, 64 << 10


@pytest.fixture(scope="module")
def kernels():
    if torch.cuda.get_device_capability()[0] < 7:
        pytest.skip("the kernels need sm_70 or newer")
    return sim.Kernels()


def _run(group, vals, op, variant, dtype, *, in_place=False, offset=0, skew_ns=0):
    """One call over the group: rank r reduces vals[r]; returns each rank's output."""
    ins, outs = [], []
    for v in vals:
        big = torch.empty(v.numel() + offset, dtype=dtype, device="cuda")
        big[offset:] = to_dtype(v, dtype).cuda()
        x = big[offset:]
        ins.append(x)
        outs.append(x if in_place else torch.full_like(x, 3))
    group.all_reduce(ins, outs, op, variant, skew_ns=skew_ns)
    torch.cuda.synchronize()
    for r in range(group.n):
        assert group.deverr(r) == 0, ("a wait gave up", r, variant)
    return outs


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("variant", ["ll", "oneshot", "twoshot"])
def test_exact_every_dtype_op_size(kernels, nranks, variant):
    """Integer-valued data: bitwise the float64 reference on every rank, out of place, in place
    and one element in (not 16-byte aligned); one group for all, so the calls cycle through both
    halves and both flag parities many times."""
    g = sim.Group(kernels, nranks, half=HALF, ll_max=LL_MAX, blocks=8)
    calls = 0
    for dtype in DTYPES:
        for op in OPS:
            for count in COUNTS[variant]:
                vals = [rank_values(r, count, dtype, op, nranks, seed=calls) for r in range(nranks)]
                ref = to_dtype(reduce_ref(vals, op, dtype), dtype)
                for how in ({}, {"in_place": True}, {"offset": 1}):
                    outs = _run(g, vals, op, variant, dtype, **how)
                    calls += 1
                    for r in range(nranks):
                        assert same_bits(outs[r], ref), (variant, nranks, r, dtype, OP_NAMES[op],
                                                         count, how)
    # every block ended every call: its counter is the number of calls
    for r in range(nranks):
        assert (g.counters(r)[:g.blocks] == calls).all(), g.counters(r)[:g.blocks]


@pytest.mark.parametrize("variant", ["oneshot", "twoshot"])
def test_exact_with_late_blocks(kernels, variant):
    """Block b of every rank starts b x 20 us late (the kernels' skew_ns, for testing): a block
    that relied on another block's work without a barrier would read stale data."""
    g = sim.Group(kernels, 3, half=HALF, ll_max=LL_MAX, blocks=8)
    for i, count in enumerate([9, 65536 + 5, (1 << 18) + 3] * 2):
        vals = [rank_values(r, count, torch.float32, SUM, 3, seed=i) for r in range(3)]
        ref = to_dtype(reduce_ref(vals, SUM, torch.float32), torch.float32)
        outs = _run(g, vals, SUM, variant, torch.float32, in_place=i % 2 == 1, skew_ns=20000)
        for r in range(3):
            assert same_bits(outs[r], ref), (variant, r, count)


@pytest.mark.parametrize("start", [(1 << 31) - 5, (1 << 32) - 5])
def test_exact_across_the_epoch_wrap(kernels, start):
    """Every block's counter starts just below 2^31 (where the 31-bit flag value wraps) or 2^32
    (where the counter does): calls on both sides stay exact and the counters keep counting."""
    n = 3
    g = sim.Group(kernels, n, half=HALF, ll_max=LL_MAX, blocks=8)
    for r in range(n):
        g.counters(r)[:] = torch.tensor(start, dtype=torch.int64).to(torch.int32)
    calls = 0
    for i in range(12):
        variant = ("ll", "oneshot", "twoshot")[i % 3]
        count = (1023, 65536 + 5, 4097)[i % 3]
        vals = [rank_values(r, count, torch.float32, SUM, n, seed=i) for r in range(n)]
        ref = to_dtype(reduce_ref(vals, SUM, torch.float32), torch.float32)
        outs = _run(g, vals, SUM, variant, torch.float32)
        calls += 1
        for r in range(n):
            assert same_bits(outs[r], ref), (start, i, variant, r)
    want = torch.tensor((start + calls) % (1 << 32), dtype=torch.int64).to(torch.int32)
    for r in range(n):
        assert (g.counters(r)[:g.blocks] == want).all(), (g.counters(r)[:g.blocks], want)


@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("variant", ["ll", "oneshot", "twoshot"])
def test_chained_calls_read_what_the_last_one_wrote(kernels, nranks, variant):
    """Calls back to back on each rank's stream, nothing between them, each in place on what the
    one before wrote (int32 SUM: every call multiplies by the number of ranks, wrapping), launched
    with programmatic dependent launch as ar.c launches them on sm_90 and newer: a kernel is
    scheduled while the one before it still runs, and must not read before that one is done."""
    pdl = torch.cuda.get_device_capability()[0] >= 9
    g = sim.Group(kernels, nranks, half=HALF, ll_max=LL_MAX, blocks=8)
    count = 1000 if variant == "ll" else 100003
    L = 12 // (nranks.bit_length() - 1)  # nranks^L <= 2^12
    first = [(torch.arange(count, dtype=torch.int64) * 7 + r * 13 + 1) % 127 + 1
             for r in range(nranks)]
    ts = [v.to(torch.int32).cuda() for v in first]
    g.all_reduce(ts, ts, SUM, variant, pdl=pdl, chain=L)
    torch.cuda.synchronize()
    v = (sum(first) * nranks ** (L - 1)) & 0xFFFFFFFF
    want = torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)
    for r in range(nranks):
        assert g.deverr(r) == 0, ("a wait gave up", r)
        assert torch.equal(ts[r].cpu(), want), (variant, nranks, r, ts[r][:4], want[:4])


def _rank_order_sum(vals, dtype):
    acc_type = torch.int32 if dtype == torch.int32 else torch.float32
    acc = vals[0].to(acc_type)
    for v in vals[1:]:
        acc = acc + v.to(acc_type)
    return acc.to(dtype)


@pytest.mark.parametrize("nranks", [3, 8])
@pytest.mark.parametrize("variant", ["ll", "oneshot", "twoshot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_data_sums_in_rank_order(kernels, nranks, variant, dtype):
    """Random data, where the order of additions shows in the bits: each rank's result equals the
    rank-order float32 sum rounded once (an order that differs on one rank, or 16-bit
    accumulation, changes bits), every rank the same; and within float32 rounding of the float64
    sum."""
    g = sim.Group(kernels, nranks, half=HALF, ll_max=LL_MAX, blocks=8)
    gen = torch.Generator().manual_seed(1234 + nranks)
    for count in (5, 4099, 30001) if variant == "ll" else (5, 4099, 200003):
        if count * dtype.itemsize > (LL_MAX if variant == "ll" else HALF):
            continue
        vals = [(torch.rand(count, generator=gen, dtype=torch.float64) - 0.5) * 8
                for _ in range(nranks)]
        vals = [to_dtype(v, dtype).cuda() for v in vals]  # the inputs as the GPU holds them
        outs = _run(g, [v.double().cpu() for v in vals], SUM, variant, dtype)
        want = _rank_order_sum(vals, dtype)
        f64 = torch.stack([v.double() for v in vals]).sum(0)
        for r in range(nranks):
            assert same_bits(outs[r], want), (variant, nranks, r, dtype, count,
                                              (outs[r].double() - want.double()).abs().max())
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert torch.allclose(outs[0].double(), f64, rtol=tol, atol=tol * 8), (variant, dtype)


def test_a_rank_that_never_comes_makes_the_others_give_up(kernels):
    """Rank 1 never launches: rank 0's waits end after the kernel timeout, it marks its region
    (later calls return at once) and the host word, and its output is not claimed done."""
    g = sim.Group(kernels, 2, half=HALF, ll_max=LL_MAX, blocks=4, timeout_s=0.2)
    for variant in ("ll", "oneshot", "twoshot"):
        x = torch.arange(1, 1001, dtype=torch.float32, device="cuda")
        ins = [x, x.clone()]
        t0 = time.monotonic()
        g.all_reduce(ins, [i.clone() for i in ins], SUM, variant, ranks=[0])
        torch.cuda.synchronize()
        took = time.monotonic() - t0
        assert 0.15 < took < 10, (variant, took)
        assert g.deverr(0) == 1 and g.host_error[0].item() == 1, variant
        g = sim.Group(kernels, 2, half=HALF, ll_max=LL_MAX, blocks=4, timeout_s=0.2)
    # a rank that gave up returns at once from later calls, without writing its output (the
    # host has failed the communicator by then; its peer is not asserted on: it may find the
    # flags the gone call left and finish)
    g.all_reduce(ins, [i.clone() for i in ins], SUM, "oneshot", ranks=[0])
    torch.cuda.synchronize()
    out = [torch.full_like(x, 3), torch.full_like(x, 3)]
    for _ in range(3):
        t0 = time.monotonic()
        g.all_reduce(ins, out, SUM, "oneshot", ranks=[0])
        torch.cuda.synchronize()
        assert time.monotonic() - t0 < 0.1, "a rank that gave up waited again"
    assert g.deverr(0) == 1
    assert (out[0] == 3).all(), "a rank that gave up must not write its output"


def test_the_host_stop_word_ends_a_wait_at_once(kernels):
    """abort() sets the host word to 2 (ar.c pyccl_ar_stop): a kernel waiting for a peer that
    never comes (timeout 60 s) leaves within a few seconds and keeps the 2."""
    g = sim.Group(kernels, 2, half=HALF, ll_max=LL_MAX, blocks=4, timeout_s=60)
    x = torch.ones(4096, dtype=torch.float32, device="cuda")
    g.all_reduce([x, x], [x.clone(), x.clone()], SUM, "twoshot", ranks=[0])
    time.sleep(0.2)
    side = torch.cuda.Stream()
    t0 = time.monotonic()
    with torch.cuda.stream(side):
        g.host_error[0].fill_(2)
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 10
    assert g.host_error[0].item() == 2 and g.deverr(0) == 1
