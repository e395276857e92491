"""Integer-valued test data whose reductions are exact in every dtype.

Each rank's values come from (index, rank) so ranks differ and positions
differ; the range is chosen per dtype, op and world size so that sums and
products stay exactly representable, which makes a bitwise comparison with a
float64 reference valid.  Never all zeros or ones.
"""
import torch

SUM, PROD, MAX, MIN, AVG = range(5)
OP_NAMES = {SUM: "sum", PROD: "prod", MAX: "max", MIN: "min", AVG: "avg"}

# Largest integer each dtype holds exactly (capped: int sums need no more).
_EXACT = {
    "float8_e5m2": 8, "float8_e4m3fn": 16, "bfloat16": 256, "float16": 2048,
    "int8": 127, "uint8": 255, "float32": 1 << 24, "float64": 1 << 24,
    "int32": 1 << 24, "int64": 1 << 24, "uint32": 1 << 24, "uint64": 1 << 24,
}


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def value_range(dtype, op, world):
    limit = _EXACT[dtype_name(dtype)]
    if op == PROD:
        m = int(limit ** (1.0 / world))
    else:
        m = limit // world
    m = max(2, min(m, 1000)) if op != PROD else max(1, min(m, 1000))
    unsigned = dtype_name(dtype).startswith("uint")
    # Integer AVG divides a non-negative sum, where truncation and floor agree.
    lo = 0 if unsigned or (op == AVG and not dtype.is_floating_point) else -m
    return lo, m


def rank_values(rank, count, dtype, op, world):
    """float64 values of one rank's buffer."""
    lo, hi = value_range(dtype, op, world)
    idx = torch.arange(count, dtype=torch.int64)
    v = (idx * 7 + rank * 13 + 5) % (hi - lo + 1) + lo
    return v.to(torch.float64)


def to_dtype(values, dtype):
    if dtype.is_floating_point and values.dtype == torch.float64 and dtype.itemsize == 1:
        return values.to(torch.float32).to(dtype)
    return values.to(dtype)


def reduce_ref(values, op, dtype):
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


def same_bits(a, b):
    """Bitwise equality of two tensors of one dtype (works for fp8 too)."""
    a = a.detach().cpu().contiguous()
    b = b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
