"""`pyccl.premul_sum` and `pyccl.group()`: public names written in Python that pyccl's own modules
use too (distributed.py), so they live here, below the package's __init__.py, which re-exports
them.  Their `__module__` is "pyccl", where users find them.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, SupportsFloat, SupportsIndex

from . import _C

if TYPE_CHECKING:
    from collections.abc import Iterator


class premul_sum:
    """Reduction op: multiply each rank's input by `scalar`, then sum (ncclRedOpCreatePreMulSum)."""

    __slots__ = {"premul_scalar": "The factor (a float) each rank's input is multiplied by."}

    premul_scalar: float

    def __init__(self, scalar: SupportsFloat | SupportsIndex) -> None:
        # float() would also take a string such as "2": only numbers here.
        if isinstance(scalar, (str, bytes, bytearray)):
            raise TypeError(f"premul_sum: scalar must be a real number, got {type(scalar).__name__}")
        try:
            self.premul_scalar = float(scalar)
        except (TypeError, ValueError):
            raise TypeError(f"premul_sum: scalar must be a real number, got {type(scalar).__name__}") from None
        except OverflowError:
            raise ValueError(f"premul_sum: scalar {_too_big(scalar)}") from None

    def __repr__(self) -> str:
        return f"pyccl.premul_sum({self.premul_scalar!r})"


def _too_big(x):
    """The end of the message for a number too large for a float.  An int's own decimal text
    may run to thousands of digits (past what str() allows), so its size in bits stands in."""
    room = "a float holds magnitudes up to about 1.8e308 (1024 bits)"
    if isinstance(x, int):
        return f"is {'a negative' if x < 0 else 'an'} int of {abs(x).bit_length()} bits; {room}"
    return f"(a {type(x).__name__}) is too large for a float; {room}"


@contextlib.contextmanager
def group() -> Iterator[None]:
    """Batch the calls inside into one NCCL group (ncclGroupStart/End).

    The group is ended even when the body raises.  Needed for send/recv pairs
    that must progress together and for driving several communicators from
    one thread.
    """
    _C._nccl_group_start()
    try:
        yield
    finally:
        _C._nccl_group_end()


premul_sum.__module__ = group.__module__ = "pyccl"
