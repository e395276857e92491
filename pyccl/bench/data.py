"""Verifiable benchmark data: what every rank's buffers hold and what a collective must produce.

Rank r's input element k is a pseudo-random small integer hashed from (r, k, seed), so any rank
can regenerate any peer's input locally and compute the exact expected output without talking
to it. Ranges are chosen per dtype and op so that every partial result is exactly representable
(integer sums and products wrap the same way in NCCL and here), which lets `-c` compare bitwise.
The one exception is avg on floating types: NCCL may pre-multiply by 1/n, so it is checked to a
relative tolerance (avg_tolerance). Works on any torch device; the CPU tests simulate
collectives with it.

The test suite draws its data from the same generator (rank_values and the helpers at the end):
its ranges are per torch dtype, including fp8 and the unsigned types, and capped at 1000 so that
one range serves every op and world size of a test, with signed values where the dtype has them.
"""
import torch

from .sizes import DTYPES, REDUCTIONS, CollCounts

_M32 = 0xFFFFFFFF
# Largest integer N such that 0..N are all exact in the type (and, for ints, the max value).
EXACT = {"int8": 127, "uint8": 255, "int32": 2**31 - 1, "int64": 2**63 - 1,
         "half": 2048, "bfloat16": 256, "float": 2**24, "double": 2**53}
FLOATS = frozenset({"half", "bfloat16", "float", "double"})
_INT_BITS = {"int8": 8, "uint8": 8, "int32": 32, "int64": 64}
_POW2_MAX = {"half": 15, "bfloat16": 127, "float": 127, "double": 1023}  # 2**k stays finite
_CAP = 1 << 20
CHUNK = 1 << 22
_Device = torch.device | str | int


def value_range(dtype: str, op: str, nranks: int, rank: int) -> tuple[int, int]:
    """Inclusive (lo, hi) of rank's input values; op is 'none' for data movement."""
    exact = EXACT[dtype]
    if op in ("sum", "avg"):
        return 0, max(1, min(exact // nranks, _CAP))
    if op == "prod":
        if dtype in FLOATS:  # products of 1s and 2s are exact powers of two
            return (1, 2) if rank < _POW2_MAX[dtype] else (1, 1)
        return 1, 2
    return 0, min(exact, _CAP)


def _hash(rank: int | torch.Tensor, idx: torch.Tensor, seed: int) -> torch.Tensor:
    """32-bit mix of (rank, index, seed); every product stays below 2**63."""
    x = (idx * 0x9E3779B1 + rank * 0x85EBCA77 + seed * 0x27D4EB2F + 0x165667B1) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def gen(rank: int | torch.Tensor, idx: torch.Tensor, seed: int, lo: int, hi: int) -> torch.Tensor:
    """int64 values in [lo, hi] for element indices idx (tensor) of rank (int or tensor)."""
    return lo + _hash(rank, idx, seed) % (hi - lo + 1)


def _range_idx(start: int, stop: int, device: _Device) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64, device=device)


def input_values(coll: str, rank: int, nranks: int, dtype: str, op: str, seed: int, start: int, stop: int,
                 device: _Device = "cpu") -> torch.Tensor:
    """Rank's input buffer elements [start, stop) as int64."""
    lo, hi = value_range(dtype, op if coll in REDUCTIONS else "none", nranks, rank)
    return gen(rank, _range_idx(start, stop, device), seed, lo, hi)


def wrap(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """Reduce int64 results modulo the integer type, as the GPU's fixed-width arithmetic does."""
    bits = _INT_BITS.get(dtype)
    if bits is None or bits == 64:
        return values
    mod = 1 << bits
    values = values % mod
    if dtype.startswith("int"):
        values = torch.where(values >= mod // 2, values - mod, values)
    return values


def _combine(op: str, parts: list[torch.Tensor], dtype: str, nranks: int) -> torch.Tensor:
    stack = torch.stack(parts)
    if op == "sum":
        out = stack.sum(0)
    elif op == "prod":
        out = stack.prod(0)
    elif op == "max":
        out = stack.max(0).values
    elif op == "min":
        out = stack.min(0).values
    elif op == "avg":
        if dtype in FLOATS:
            return stack.sum(0).to(torch.float64) / nranks
        out = stack.sum(0) // nranks  # NCCL: integer sum, then divide (values are >= 0)
    else:
        raise ValueError(f"unknown op {op!r}")
    return wrap(out, dtype)


def expected_values(coll: str, rank: int, nranks: int, count: int, dtype: str, op: str, root: int, seed: int,
                    start: int, stop: int, device: _Device = "cpu") -> torch.Tensor | None:
    """Expected output elements [start, stop) of rank, or None where nothing is defined.

    count is the per-call count (nccl-tests' paramcount); output lengths are count, or
    count * nranks for all_gather and alltoall.
    """
    idx = _range_idx(start, stop, device)
    if coll in REDUCTIONS:
        if coll == "reduce" and rank != root:
            return None
        src = idx + rank * count if coll == "reduce_scatter" else idx
        parts = [gen(r, src, seed, *value_range(dtype, op, nranks, r)) for r in range(nranks)]
        return _combine(op, parts, dtype, nranks)
    lo, hi = value_range(dtype, "none", nranks, rank)
    if coll == "broadcast":
        return gen(root, idx, seed, lo, hi)
    if coll == "sendrecv":
        return gen((rank - 1) % nranks, idx, seed, lo, hi)
    peer, i = idx // max(count, 1), idx % max(count, 1)
    if coll == "all_gather":
        return gen(peer, i, seed, lo, hi)
    if coll == "alltoall":
        return gen(peer, rank * count + i, seed, lo, hi)
    raise ValueError(f"unknown collective {coll!r}")


def avg_tolerance(dtype: str, nranks: int) -> float:
    """Allowed relative error of a floating avg: NCCL may pre-multiply each input by 1/n and round
    it, then round at each of n - 1 additions (each at most half an ulp of the nonnegative
    result); doubled for an implementation that reduces in fp32 and rounds once more."""
    return (nranks + 1) * torch.finfo(getattr(torch, DTYPES[dtype][0])).eps


def fill(buf: torch.Tensor, coll: str, rank: int, nranks: int, dtype: str, op: str, seed: int,
         chunk: int = CHUNK) -> None:
    """Write rank's input values into buf (a 1-D tensor), chunk by chunk to bound scratch memory."""
    n = buf.numel()
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        buf[a:b].copy_(input_values(coll, rank, nranks, dtype, op, seed, a, b, buf.device))


def count_wrong(out: torch.Tensor, coll: str, rank: int, nranks: int, count: int, dtype: str, op: str,
                root: int, seed: int, chunk: int = CHUNK) -> int:
    """Number of elements of out that differ from the expected result (0 where none is defined)."""
    n, wrong = out.numel(), 0
    tol = avg_tolerance(dtype, nranks) if (op == "avg" and dtype in FLOATS) else None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        exp = expected_values(coll, rank, nranks, count, dtype, op, root, seed, a, b, out.device)
        if exp is None:
            return 0
        got = out[a:b]
        if dtype in FLOATS:
            got = got.to(torch.float64)
            if tol is None:
                bad = got != exp
            else:
                exp = exp.to(torch.float64)
                bad = (got - exp).abs() > tol * exp.abs()
            bad = bad | got.isnan()
        else:
            bad = got.to(torch.int64) != exp
        wrong += int(bad.sum())
    return wrong


def views(coll: str, placement: str, send: torch.Tensor, recv: torch.Tensor, counts: CollCounts,
          rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) tensors of one call; in-place slices both out of recv as nccl-tests does."""
    if placement == "out-of-place":
        return send[:counts.sendcount], recv[:counts.recvcount]
    s = counts.send_inplace_offset * rank
    r = counts.recv_inplace_offset * rank
    return recv[s:s + counts.sendcount], recv[r:r + counts.recvcount]


# ---- the test suite's view: torch dtypes, integer op codes, float64 references ------------------

SUM, PROD, MAX, MIN, AVG = range(5)
OP_NAMES = {SUM: "sum", PROD: "prod", MAX: "max", MIN: "min", AVG: "avg"}

# Largest integer each dtype holds exactly (capped: int sums need no more).
_TEST_EXACT = {
    "float8_e5m2": 8, "float8_e4m3fn": 16, "bfloat16": 256, "float16": 2048,
    "int8": 127, "uint8": 255, "float32": 1 << 24, "float64": 1 << 24,
    "int32": 1 << 24, "int64": 1 << 24, "uint32": 1 << 24, "uint64": 1 << 24,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def test_range(dtype: torch.dtype, op: int, world: int) -> tuple[int, int]:
    """Inclusive (lo, hi) of every rank's values for a reduction `op` over `world` ranks of a
    torch dtype: sums, products and averages of `world` such values stay exact."""
    limit = _TEST_EXACT[dtype_name(dtype)]
    if op == PROD:
        m = int(limit ** (1.0 / world))
    else:
        m = limit // world
    # at least -2..2 where the dtype allows it; -1..1 (fp8 over many ranks) where it does not:
    # the hashed values of many ranks can all sit at one end of the range
    m = max(1 if op == PROD or limit // world < 2 else 2, min(m, 1000))
    unsigned = dtype_name(dtype).startswith("uint")
    # Integer AVG divides a non-negative sum, where truncation and floor agree.
    lo = 0 if unsigned or (op == AVG and not dtype.is_floating_point) else -m
    return lo, m


def rank_values(rank: int, count: int, dtype: torch.dtype, op: int, world: int, seed: int = 0) -> torch.Tensor:
    """float64 values of one rank's buffer of `count` elements: gen() over test_range."""
    lo, hi = test_range(dtype, op, world)
    return gen(rank, torch.arange(count, dtype=torch.int64), seed, lo, hi).to(torch.float64)


def to_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point and values.dtype == torch.float64 and dtype.itemsize == 1:
        return values.to(torch.float32).to(dtype)
    return values.to(dtype)


def reduce_ref(values: list[torch.Tensor] | tuple[torch.Tensor, ...], op: int, dtype: torch.dtype) -> torch.Tensor:
    """float64 reference of a reduction over a list of per-rank float64 tensors."""
    stack = torch.stack(values)
    if op == SUM:
        r = stack.sum(0)
    elif op == PROD:
        r = stack.prod(0)
    elif op == MAX:
        r = stack.max(0).values
    elif op == MIN:
        r = stack.min(0).values
    elif op == AVG:
        r = stack.sum(0)
        r = r / len(values) if dtype.is_floating_point else torch.div(r, len(values), rounding_mode="trunc")
    else:
        raise ValueError(op)
    return to_dtype(r, dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of one dtype (works for fp8 too)."""
    a = a.detach().cpu().contiguous()
    b = b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
