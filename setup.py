"""Build pyccl._C: plain C against NCCL's and CUDA's headers only.

Nothing is linked but libdl: pyccl finds NCCL and the CUDA runtime at run time
(the copies torch loaded), so one build works with any torch 2.x.  Headers come
from NCCL_HOME / CUDA_HOME, or from the nvidia-nccl-cu13 / nvidia-cuda-runtime
wheels' include folders.
"""
import glob
import os
import shutil
import subprocess
import sys
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_SRC = "csrc/kernels/allreduce.cu"
# Turing (T4, sm_75) to Blackwell; the PTX of the last is JIT-compiled on newer GPUs.  A GPU
# none of these fits (an older one) fails to load the kernels and uses NCCL, saying why once.
DEFAULT_ARCHS = "75;80;90;100;120"
KERNEL_DEPS = [KERNEL_SRC, "csrc/kernels/ar_abi.h"]


def _nvcc():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


class BuildExt(build_ext):
    """Compile csrc/kernels/*.cu into a fatbin that ar.c embeds
    (.incbin), when nvcc is there.  Without nvcc the extension is built
    without its own kernels (all_reduce then always uses NCCL);
    PYCCL_REQUIRE_KERNELS=1 makes that an error."""

    def build_extensions(self):
        fatbin = self._fatbin()
        if fatbin:
            for e in self.extensions:
                e.define_macros.append(("PYCCL_FATBIN_PATH", f'"{fatbin}"'))
                e.depends.append(fatbin)
        super().build_extensions()

    def _fatbin(self):
        nvcc = _nvcc()
        required = os.environ.get("PYCCL_REQUIRE_KERNELS", "") not in ("", "0")
        if nvcc is None:
            msg = "pyccl build: nvcc not found (CUDA_HOME, /usr/local/cuda, PATH): no own kernels"
            if required:
                sys.exit(msg)
            print(msg, file=sys.stderr)
            return None
        archs = os.environ.get("PYCCL_CUDA_ARCHS", DEFAULT_ARCHS).replace(",", ";").split(";")
        archs = [a.strip() for a in archs if a.strip()]
        # Kept beside the checkout, named by its archs, so that `pip install -e .` (which
        # builds in a fresh temporary folder) and `build_ext --inplace` share one build, and
        # a change of PYCCL_CUDA_ARCHS never reuses a fatbin made for other GPUs.
        out = os.path.join(HERE, "build", "kernels", f"pyccl_allreduce-sm_{'_'.join(archs)}.fatbin")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.exists(out) and all(os.path.getmtime(out) > os.path.getmtime(d) for d in KERNEL_DEPS):
            return out
        cmd = [nvcc, "-O3", "-std=c++17", "-fatbin", "--threads", "0", "-Icsrc/kernels", "-o", out]
        for a in archs:
            cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        # PTX of the newest arch too, so a later GPU can JIT it
        cmd += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}", KERNEL_SRC]
        t0 = time.time()
        print(" ".join(cmd))
        r = subprocess.run(cmd)
        if r.returncode != 0:
            msg = f"pyccl build: nvcc failed ({r.returncode}): no own kernels"
            if required:
                sys.exit(msg)
            print(msg, file=sys.stderr)
            return None
        print(f"pyccl build: kernels for sm_{', sm_'.join(archs)} in {time.time() - t0:.1f} s")
        return out


ext = Extension(
    "pyccl._C",
    sources=sorted(glob.glob("csrc/*.c")),
    depends=["csrc/pyccl.h", "csrc/args.h", "csrc/comm_ops.h", "csrc/watch.h"] + KERNEL_DEPS,
    include_dirs=["csrc", nccl_inc, cuda_inc],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
    libraries=["dl"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
