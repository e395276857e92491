"""Sizes, element counts and bandwidth factors of the benchmark, following nccl-tests.

Pure functions with no torch or CUDA dependency: the size sweep (-b/-e/-i/-f), what "size" and
"count" mean for each collective, and the algorithm/bus bandwidth formulas of nccl-tests'
`*GetCollByteCount` and `*GetBw` (see nccl-tests doc/PERFORMANCE.md for why busbw is defined so).
"""
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

COLLS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv",
         "alltoall")
REDUCTIONS = frozenset({"all_reduce", "reduce_scatter", "reduce"})
ROOTED = frozenset({"broadcast", "reduce"})
# Position is the NCCL enum value (ncclSum=0 ... ncclAvg=4); pyccl and torch.cuda.nccl take it raw.
OPS = ("sum", "prod", "max", "min", "avg")
# nccl-tests type name -> (torch dtype attribute, bytes per element)
DTYPES = {
    "int8": ("int8", 1), "uint8": ("uint8", 1), "int32": ("int32", 4), "int64": ("int64", 8),
    "half": ("float16", 2), "float": ("float32", 4), "double": ("float64", 8),
    "bfloat16": ("bfloat16", 2),
}
_DTYPE_ALIASES = {
    "char": "int8", "ncclint8": "int8", "ncclchar": "int8", "nccluint8": "uint8",
    "ncclint32": "int32", "int": "int32", "ncclint": "int32", "ncclint64": "int64",
    "float16": "half", "fp16": "half", "f16": "half", "ncclfloat16": "half", "ncclhalf": "half",
    "float32": "float", "fp32": "float", "f32": "float", "ncclfloat32": "float",
    "ncclfloat": "float", "float64": "double", "fp64": "double", "f64": "double",
    "ncclfloat64": "double", "nccldouble": "double", "bf16": "bfloat16", "ncclbfloat16": "bfloat16",
}
_COLL_ALIASES = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
    "bcast": "broadcast", "send_recv": "sendrecv", "all_to_all": "alltoall",
}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# nccl-tests reads "%lf %1s": a number, then K/M/G in either case; we also allow a trailing B/iB.
_SIZE_RE = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*")
MAX_SIZES = 100_000


def parse_size(text: str | int, what: str = "size") -> int:
    """'8', '64K', '1.5M', '2G' -> bytes (powers of 1024, fraction truncated as nccl-tests)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise ValueError(f"invalid {what} {text!r}: expected a number of bytes with an "
                             "optional K, M or G suffix (powers of 1024), e.g. 8, 64K, 1M")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError(f"invalid {what} {text!r}: must not be negative")
    return value


def size_list(minbytes: int, maxbytes: int, stepbytes: int = 1 << 20, stepfactor: int = 1) -> list[int]:
    """The sweep of nccl-tests' TimeTest: multiply by stepfactor if it is > 1, else add stepbytes."""
    if minbytes > maxbytes:
        raise ValueError(f"invalid sizes for 'minbytes' and 'maxbytes': {minbytes} > {maxbytes}")
    if stepfactor < 0:
        raise ValueError(f"invalid stepfactor {stepfactor}: must be >= 1 (or 0/1 to use stepbytes)")
    if stepfactor > 1:
        if minbytes == 0:
            raise ValueError("minbytes 0 with stepfactor > 1 would never grow: use -b >= 1")
        step: Callable[[int], int] = lambda s: s * stepfactor  # noqa: E731
    else:
        if stepbytes <= 0 and minbytes < maxbytes:
            raise ValueError(f"invalid stepbytes {stepbytes}: must be > 0 when minbytes < maxbytes")
        step = lambda s: s + stepbytes  # noqa: E731
    sizes: list[int] = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        if len(sizes) > MAX_SIZES:
            raise ValueError(f"the sweep {minbytes}..{maxbytes} has more than {MAX_SIZES} sizes: "
                             "use a larger -i/--stepbytes or a -f/--stepfactor")
        if minbytes == maxbytes:
            break
        size = step(size)
    return sizes


def _parse_list(text: str, allowed: Sequence[str], aliases: Mapping[str, str], what: str) -> list[str]:
    out: list[str] = []
    for item in str(text).split(","):
        key = item.strip().lower().replace("-", "_")
        if key == "all":
            out.extend(x for x in allowed if x not in out)
            continue
        key = aliases.get(key, aliases.get(key.replace("_", ""), key))
        if key not in allowed:
            raise ValueError(f"unknown {what} {item.strip()!r}: choose from "
                             f"{', '.join(allowed)} or all")
        if key not in out:
            out.append(key)
    return out


def parse_colls(text: str) -> list[str]:
    return _parse_list(text, COLLS, _COLL_ALIASES, "collective")


def parse_ops(text: str) -> list[str]:
    return _parse_list(text, OPS, {}, "op")


def parse_dtypes(text: str) -> list[str]:
    return _parse_list(text, tuple(DTYPES), _DTYPE_ALIASES, "datatype")


def elem_size(dtype: str) -> int:
    return DTYPES[dtype][1]


def ops_for(coll: str, ops: Iterable[str]) -> list[str]:
    """Reduction ops run for a collective; nccl-tests prints 'none' for data movement."""
    return list(ops) if coll in REDUCTIONS else ["none"]


def root_for(coll: str, root: int) -> int:
    """The root column: the root for broadcast/reduce, -1 otherwise (as nccl-tests prints)."""
    return root if coll in ROOTED else -1


class CollCounts(NamedTuple):
    """Element counts of nccl-tests' getCollByteCount; offsets are per rank, for in-place."""
    sendcount: int
    recvcount: int
    count: int  # the count passed to NCCL and printed in the 'count' column
    send_inplace_offset: int
    recv_inplace_offset: int


def coll_counts(coll: str, size: int, elsize: int, nranks: int) -> CollCounts:
    """Counts for a nominal size in bytes; the 'size' column is max(send, recv) bytes."""
    count = size // elsize
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        # nccl-tests keeps each rank's slice a whole number of 16-byte lines.
        base = (count // nranks) & -(16 // elsize)
        if coll == "all_gather":
            return CollCounts(base, base * nranks, base, base, 0)
        if coll == "reduce_scatter":
            return CollCounts(base * nranks, base, base, 0, base)
        return CollCounts(base * nranks, base * nranks, base, 0, 0)
    if coll not in COLLS:
        raise ValueError(f"unknown collective {coll!r}")
    return CollCounts(count, count, count, 0, 0)


def size_bytes(coll: str, size: int, elsize: int, nranks: int) -> int:
    c = coll_counts(coll, size, elsize, nranks)
    return max(c.sendcount, c.recvcount) * elsize


def bus_factor(coll: str, nranks: int) -> float:
    """busbw = algbw * factor: the share of the data each rank's link must carry."""
    if coll == "all_reduce":
        return 2.0 * (nranks - 1) / nranks
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        return (nranks - 1) / nranks
    if coll in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {coll!r}")


def alg_bytes(coll: str, count: int, elsize: int, nranks: int) -> int:
    """Bytes that algbw is computed from: count*size, times nranks where count is per rank."""
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        return count * elsize * nranks
    return count * elsize


def bandwidths(coll: str, count: int, elsize: int, nranks: int, seconds: float | None) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s), as nccl-tests' *GetBw."""
    if not seconds or seconds <= 0:
        return 0.0, 0.0
    algbw = alg_bytes(coll, count, elsize, nranks) / 1.0e9 / seconds
    return algbw, algbw * bus_factor(coll, nranks)
