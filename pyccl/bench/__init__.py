"""pyccl's benchmark: nccl-tests' sweep, columns and bandwidth formulas, run through pyccl and,
with --compare, through torch.distributed and torch.cuda.nccl. Run `python -m pyccl.bench -h`.

The modules import without a GPU and without pyccl's extension built (CUDA and pyccl are
imported inside the functions that use them); only running a benchmark needs both.
"""
import os

# NVLink SHARP / multicast stays off in every process this package spawns (children inherit it).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)
del _name, _value

from .cli import main  # noqa: E402

__all__ = ["main"]
