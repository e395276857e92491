"""pyccl's benchmark: nccl-tests' sweep, columns and bandwidth formulas, run through pyccl and,
with --compare, through torch.distributed and torch.cuda.nccl. Run `python -m pyccl.bench -h`.

The modules import without a GPU and without pyccl's extension built (CUDA and pyccl are
imported inside the functions that use them); only running a benchmark needs both.  Importing
them changes no environment variable: NCCL's settings are the user's (--no-nvls turns NVLink
SHARP and multicast off for one run).
"""
from .cli import main

__all__ = ["main"]
