"""Build pyccl._C: plain C against NCCL's and CUDA's headers only.

Nothing is linked but libdl: pyccl finds NCCL and the CUDA runtime at run time
(the copies torch loaded), so one build works with every supported torch.
Headers come from NCCL_HOME / CUDA_HOME, or from the nvidia-nccl-cu13 /
nvidia-cuda-runtime / nvidia-cuda-crt / nvidia-cuda-cccl wheels' include
folders (an isolated build gets those from pyproject.toml's
build-system.requires).  nvcc, for pyccl's own kernels, comes from CUDA_HOME,
/usr/local/cuda or PATH, else from the nvidia-cuda-nvcc and nvidia-nvvm wheels
(build requirements too), so an isolated build needs no CUDA toolkit.

Release builds carry no debug information and no run path: -g0 and the
linker's -s, and the interpreter's own -rpath (from its LDSHARED) dropped.
CFLAGS with -g (or PYCCL_DEBUG=1) keeps debug information and symbols.
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
    return None


def _include_dirs():
    """NCCL's and CUDA's include folders, or exit naming what to install."""
    # NCCL: the wheel torch loads its libnccl from comes before a system copy.
    nccl_inc = _find_include(
        ["nccl.h"], ["NCCL_HOME", "NCCL_ROOT"], ["nccl/include"], ["/usr/include", "/usr/local/include"],
        wheels_first=True,
    )
    # nccl.h includes cuda_runtime.h, which needs crt/ (nvidia-cuda-crt in pip's CUDA 13 wheels)
    cuda_inc = _find_include(
        ["cuda_runtime.h", "crt/host_config.h"],
        ["CUDA_HOME", "CUDA_PATH"],
        ["cu13/include", "cuda_runtime/include", "cu12/include"],
        ["/usr/local/cuda/include"],
        wheels_first=False,
    )
    missing = []
    # cuda_fp16.h (which nccl.h includes) includes <nv/target>: in a toolkit it sits in include/,
    # in pip's CUDA 13 wheels in include/cccl/ (nvidia-cuda-cccl).
    cccl_inc = None
    if cuda_inc is not None and not _has(cuda_inc, ["nv/target"]):
        cccl_inc = _find_include(["nv/target"], [], ["cu13/include/cccl"], [os.path.join(cuda_inc, "cccl")],
                                 wheels_first=False)
        if cccl_inc is None:
            missing.append(f"nv/target (included by {cuda_inc}/cuda_fp16.h): pip install nvidia-cuda-cccl")
    if nccl_inc is None:
        missing.append("nccl.h: pip install nvidia-nccl-cu13 (or set NCCL_HOME to an NCCL install)")
    if cuda_inc is None:
        missing.append("cuda_runtime.h and crt/host_config.h: pip install nvidia-cuda-runtime nvidia-cuda-crt "
                       "(or set CUDA_HOME to a CUDA toolkit)")
    if missing:
        sys.exit("pyccl build: headers not found.\n  " + "\n  ".join(missing) + "\n"
                 "pip's isolated builds (pip install ., python -m build) install these wheels "
                 "themselves; with --no-build-isolation they must be in the building Python.")
    return [nccl_inc, cuda_inc] + ([cccl_inc] if cccl_inc else [])


def _debug_build():
    flags = os.environ.get("CFLAGS", "").split()
    return os.environ.get("PYCCL_DEBUG", "") not in ("", "0") or any(
        f.startswith("-g") and f != "-g0" for f in flags)


def _interpreter_rpaths():
    """The -rpath options the interpreter's own build put in LDSHARED/LDFLAGS
    (its lib folder): meaningless for pyccl._C, which needs no libpython."""
    import sysconfig

    words = " ".join(sysconfig.get_config_var(v) or "" for v in ("LDSHARED", "LDFLAGS")).split()
    return {w for w in words if w.startswith(("-Wl,-rpath", "-Wl,-R", "-Wl,--rpath"))}


HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_SRC = "csrc/kernels/allreduce.cu"
# Turing (T4, sm_75) to Blackwell; the PTX of the last is JIT-compiled on newer GPUs.  A GPU
# none of these fits (an older one) fails to load the kernels and uses NCCL, saying why once.
DEFAULT_ARCHS = "75;80;90;100;120"
KERNEL_DEPS = [KERNEL_SRC, "csrc/kernels/ar_abi.h"]


def _nvcc():
    """A toolkit's nvcc (CUDA_HOME, CUDA_PATH, /usr/local/cuda, PATH), else the
    nvidia-cuda-nvcc wheel's, whose nvcc.profile finds cicc (nvidia-nvvm) and the
    headers (nvidia-cuda-runtime, -crt, -cccl) in the same nvidia/cu13 folder."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    for base in _nvidia_dirs():
        nvcc = os.path.join(base, "cu13", "bin", "nvcc")
        if os.access(nvcc, os.X_OK) and os.path.isfile(os.path.join(base, "cu13", "nvvm", "bin", "cicc")):
            return nvcc
    return None


class BuildExt(build_ext):
    """Compile csrc/kernels/*.cu into a fatbin that ar_load.c embeds
    (.incbin), when nvcc is there.  Without nvcc the extension is built
    without its own kernels (all_reduce then always uses NCCL);
    PYCCL_REQUIRE_KERNELS=1 makes that an error."""

    def build_extensions(self):
        includes = _include_dirs()
        drop = _interpreter_rpaths()
        for attr in ("linker_so", "linker_so_cxx"):
            cmd = getattr(self.compiler, attr, None)
            if isinstance(cmd, list):
                setattr(self.compiler, attr, [w for w in cmd if w not in drop])
        debug = _debug_build()
        for e in self.extensions:
            e.include_dirs += includes
            if os.environ.get("PYCCL_DEBUG", "") not in ("", "0"):
                # every lock taken checked against the order of csrc/locks.h
                e.define_macros.append(("PYCCL_DEBUG_LOCKS", "1"))
            if not debug:
                e.extra_compile_args.append("-g0")
                e.extra_link_args.append("-s")
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
            msg = ("pyccl build: nvcc not found (CUDA_HOME, /usr/local/cuda, PATH, the nvidia-cuda-nvcc "
                   "and nvidia-nvvm wheels): no own kernels")
            if required:
                sys.exit(msg)
            print(msg, file=sys.stderr)
            return None
        archs = (os.environ.get("PYCCL_CUDA_ARCHS") or DEFAULT_ARCHS).replace(",", ";").split(";")
        archs = [a.strip() for a in archs if a.strip()] or DEFAULT_ARCHS.split(";")  # blank: unset
        # Kept beside the checkout, named by its archs, so that `pip install -e .` (which
        # builds in a fresh temporary folder) and `build_ext --inplace` share one build, and
        # a change of PYCCL_CUDA_ARCHS never reuses a fatbin made for other GPUs.
        out = os.path.join(HERE, "build", "kernels", f"pyccl_allreduce-sm_{'_'.join(archs)}.fatbin")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.exists(out) and all(os.path.getmtime(out) > os.path.getmtime(d) for d in KERNEL_DEPS):
            print(f"pyccl build: kernels for sm_{', sm_'.join(archs)} from an earlier build ({out})")
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
        print(f"pyccl build: kernels for sm_{', sm_'.join(archs)} in {time.time() - t0:.1f} s ({nvcc})")
        return out


# Where docs/ can be read on the web, for the index page's links; empty while
# pyccl has no public address.  README.md's relative links (docs/*.md) would not
# resolve on the package index: the long description gets them absolute under
# this address, or, while it is empty, as their text followed by the file's path
# in the source distribution (which carries docs/).
DOCS_URL = ""


def _long_description():
    import re

    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        text = f.read()

    def fix(m):
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):  # absolute, or an anchor of this page
            return m.group(0)
        if DOCS_URL:
            return f"[{label}]({DOCS_URL.rstrip('/')}/{target})"
        path = target.split("#")[0]
        return label if label.strip("`") == path else f"{label} (`{path}`)"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", fix, text)


ext = Extension(
    "pyccl._C",
    sources=sorted(glob.glob("csrc/*.c")),
    # setup.py: the compile and link flags are written here
    depends=sorted(glob.glob("csrc/*.h")) + KERNEL_DEPS + ["setup.py"],
    include_dirs=["csrc"],
    # a call to an undeclared function is an error with every compiler (clang and zig cc
    # already make it one; older gcc only warns)
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type",
                        "-Werror=implicit-function-declaration"],
    libraries=["dl"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt},
      long_description=_long_description(), long_description_content_type="text/markdown")
