#!/usr/bin/env bash
# Make this checkout usable: install what is missing (only that), build
# pyccl._C in place, and install pyccl into this Python as an editable package
# (once), so `import pyccl` works from any folder: examples/, python -m
# pyccl.bench, torchrun, a user's own script.  Safe to run again; needs no
# network when everything is already there (as on the GPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

missing=()
$PY -c "import torch" 2>/dev/null || missing+=("${PYCCL_TORCH_SPEC:-torch}")
$PY -c "import pytest" 2>/dev/null || missing+=(pytest)
# pyproject.toml's license expression needs setuptools 77 (pip's editable install, PEP 660,
# needs 64; before 70.1 also the wheel package)
$PY -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null \
  || missing+=("setuptools>=77")
$PY -c "import setuptools, sys; v = tuple(map(int, setuptools.__version__.split('.')[:2])); v >= (70, 1) or __import__('wheel')" \
  2>/dev/null || missing+=(wheel)
# Headers for the build: NCCL's and the CUDA runtime's (setup.py says where it looks).
if ! $PY - <<'PYEOF' 2>/dev/null
import glob, importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
dirs = list(spec.submodule_search_locations) if spec else []
roots = [os.environ.get(v) for v in ("NCCL_HOME", "NCCL_ROOT")]
ok = any(os.path.isfile(os.path.join(r, "include", "nccl.h")) for r in roots if r) \
    or any(os.path.isfile(os.path.join(d, "nccl", "include", "nccl.h")) for d in dirs) \
    or os.path.isfile("/usr/include/nccl.h")
sys.exit(0 if ok else 1)
PYEOF
then
  missing+=("${PYCCL_NCCL_WHEEL:-nvidia-nccl-cu13}")
fi
if ! $PY - <<'PYEOF' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
dirs = [os.path.join(d, "cu13", "include") for d in (spec.submodule_search_locations if spec else [])]
dirs += [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
dirs += ["/usr/local/cuda/include"]
sys.exit(0 if any(os.path.isfile(os.path.join(d, "cuda_runtime.h")) and
                  os.path.isfile(os.path.join(d, "crt", "host_config.h")) for d in dirs) else 1)
PYEOF
then
  missing+=(nvidia-cuda-runtime nvidia-cuda-crt)
fi
# mypy, for the stub test (tests/test_stubs_cpu.py, as in CI): wanted, not needed; offline
# (a GPU machine without it) the test says it is missing
if ! $PY -c "import mypy" 2>/dev/null; then
  $PY -m pip install -q --retries 1 --timeout 10 mypy >/dev/null 2>&1 && echo "setup: installed mypy" \
    || echo "setup: mypy is not installed and could not be (the stub test will say so)"
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $PY -m pip install -q "${missing[@]}"
fi
start=$(date +%s)
here=$(pwd -P)
# Already installed from this checkout?  Asked from / so the current folder cannot answer.
installed=$(cd / && $PY -c "import importlib.util as u, os; s = u.find_spec('pyccl'); print(os.path.realpath(s.submodule_search_locations[0]) if s else '')" 2>/dev/null || true)
if [ "$installed" = "$here/pyccl" ]; then
  $PY setup.py -q build_ext --inplace
  echo "setup: pyccl._C built in $(( $(date +%s) - start )) s"
else
  # builds _C in place too; --no-deps: torch is there (above), nothing is fetched
  # compat mode: a path entry (not an import hook), so mypy and pyright find pyccl and its
  # stubs too; it puts this checkout on sys.path
  $PY -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
  echo "setup: pyccl built and installed (editable, from $here) in $(( $(date +%s) - start )) s"
fi
