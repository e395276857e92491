"""Where pyccl looks for NCCL and the CUDA runtime when torch has not loaded them.

The C side first takes the copies already in the process (torch's), so these
paths matter only for a CPU-only torch or a script that uses pyccl before
torch has touched CUDA.  Order: explicit override, pip's nvidia wheels,
NCCL_HOME / CUDA_HOME, then the loader's own search path (tried by the C side).
"""
from __future__ import annotations

import importlib.util
import os
import warnings


def _nvidia_dirs() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    # (a plain module named nvidia, which has no search locations, holds no libraries)
    return list(spec.submodule_search_locations or ()) if spec else []


def _existing(paths: list[str | None]) -> list[str]:
    return [p for p in paths if p and os.path.isfile(p)]


def _override(var: str) -> str | None:
    """The library `var` names (blank is unset), or None with a warning where it names no file:
    the search goes on without it rather than failing an import that may never need it."""
    path = os.environ.get(var)
    if path and not os.path.isfile(path):
        warnings.warn(f"pyccl: {var}={path!r} is not a file; looking for the library elsewhere",
                      RuntimeWarning, stacklevel=3)
        return None
    return path or None


def nccl_candidates() -> list[str]:
    paths: list[str | None] = [_override("PYCCL_NCCL_LIBRARY")]
    paths += [os.path.join(d, "nccl", "lib", "libnccl.so.2") for d in _nvidia_dirs()]
    for var in ("NCCL_HOME", "NCCL_ROOT"):
        root = os.environ.get(var)
        if root:
            paths.append(os.path.join(root, "lib", "libnccl.so.2"))
    return _existing(paths)


def cudart_candidates() -> list[str]:
    paths: list[str | None] = [_override("PYCCL_CUDART_LIBRARY")]
    for d in _nvidia_dirs():
        paths.append(os.path.join(d, "cu13", "lib", "libcudart.so.13"))
        paths.append(os.path.join(d, "cuda_runtime", "lib", "libcudart.so.12"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            paths += [os.path.join(root, "lib64", n) for n in ("libcudart.so.13", "libcudart.so.12", "libcudart.so")]
    paths += [os.path.join("/usr/local/cuda/lib64", n) for n in ("libcudart.so.13", "libcudart.so.12")]
    return _existing(paths)
