"""The tests' names for the one exact-data generator, pyccl/bench/data.py (shared with
pyccl.bench): rank_values(rank, count, dtype, op, world) are integer-valued float64 data whose
reductions over `world` ranks are exact in every dtype, reduce_ref the float64 reference,
same_bits a bitwise comparison."""
from pyccl.bench.data import (  # noqa: F401
    AVG, MAX, MIN, OP_NAMES, PROD, SUM, dtype_name, rank_values, reduce_ref, same_bits,
    test_range as value_range, to_dtype)
