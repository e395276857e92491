"""Build pyccl._C: plain C against NCCL's and CUDA's headers only.

Nothing is linked but libdl: pyccl finds NCCL and the CUDA runtime at run time
(the copies torch loaded), so one build works with any torch 2.x.  Headers come
from NCCL_HOME / CUDA_HOME, or from the nvidia-nccl-cu13 / nvidia-cuda-runtime
wheels' include folders.
"""
import glob
import os
import sys

from setuptools import Extension, setup


def _nvidia_dirs():
    """Folders of the `nvidia` namespace package (pip's CUDA wheels)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations) if spec else []


def _has(d, headers):
    return all(os.path.isfile(os.path.join(d, h)) for h in headers)


def _find_include(headers, env_vars, wheel_globs, system, wheels_first):
    """First folder holding all `headers`: env roots, then pip wheels and the
    system folders in the order asked for."""
    candidates = []
    for var in env_vars:
        root = os.environ.get(var)
        if root:
            candidates.append(os.path.join(root, "include"))
    wheels = []
    for base in _nvidia_dirs():
        for pattern in wheel_globs:
            wheels += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    candidates += wheels + system if wheels_first else system + wheels
    for d in candidates:
        if _has(d, headers):
            return d
    sys.exit(
        f"pyccl build: cannot find {' and '.join(headers)}; looked in {candidates}. "
        f"Set {env_vars[0]} or pip install the nvidia wheel that ships it."
    )


# NCCL: the wheel torch loads its libnccl from comes before a system copy.
nccl_inc = _find_include(
    ["nccl.h"], ["NCCL_HOME", "NCCL_ROOT"], ["nccl/include"], ["/usr/include", "/usr/local/include"],
    wheels_first=True,
)
cuda_inc = _find_include(
    # nccl.h includes cuda_runtime.h, which needs crt/ (nvidia-cuda-crt in pip's CUDA 13 wheels)
    ["cuda_runtime.h", "crt/host_config.h"],
    ["CUDA_HOME", "CUDA_PATH"],
    ["cu13/include", "cuda_runtime/include", "cu12/include"],
    ["/usr/local/cuda/include"],
    wheels_first=False,
)

ext = Extension(
    "pyccl._C",
    sources=sorted(glob.glob("csrc/*.c")),
    depends=["csrc/pyccl.h"],
    include_dirs=["csrc", nccl_inc, cuda_inc],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
    libraries=["dl"],
)

setup(ext_modules=[ext])
