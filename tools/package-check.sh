#!/usr/bin/env bash
# The packaging check (no GPU needed): what a user of the published package gets.
#   1. tools/build-wheels.sh on a copy of the files git knows, for this Python
#      only: the sdist, then a wheel built from that sdist in pip's isolated
#      build environment (headers and nvcc come from build-system.requires, not
#      from this Python), compiled for glibc 2.28 and given its
#      manylinux_2_28_x86_64 tag by auditwheel repair, which fails if the
#      extension needs anything outside that policy; auditwheel show is printed.
#   2. The sdist holds every tracked file of csrc/; the wheel's extension has no
#      RPATH/RUNPATH and no debug information, and embeds the own kernels.
#   3. The wheel installed in a fresh venv with torch; pyccl imported from a
#      folder outside the checkout: its version, then, with NCCL's wheel added,
#      pyccl.nccl.version() and a unique id.
#   4. With that torch, the oldest pyccl supports (pyproject.toml's dependencies), the
#      CPU tests of what rests on torch's own machinery: the custom ops under
#      torch.compile and the torch.distributed backend (tests/test_ops_cpu.py,
#      tests/test_distributed_cpu.py), run against the installed wheel.
# Environment: PYTHON (default python3), PYCCL_TORCH_SPEC (default torch==2.11.0),
# PYCCL_NCCL_SPEC (default nvidia-nccl-cu13==2.28.9), PYCCL_CUDA_ARCHS (passed to
# the build; default: setup.py's), KEEP=1 keeps the scratch folder.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
py="${PYTHON:-python3}"
torch_spec="${PYCCL_TORCH_SPEC:-torch==2.11.0}"
nccl_spec="${PYCCL_NCCL_SPEC:-nvidia-nccl-cu13==2.28.9}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
t0=$(date +%s)

work="$(mktemp -d "${TMPDIR:-/tmp}/pyccl-package.XXXXXX")"
cleanup() { [ "${KEEP:-0}" = 1 ] && echo "package-check: kept $work" || rm -rf "$work"; }
trap cleanup EXIT
log="$work/log"
step() {  # step WHAT COMMAND...: run it with its output in the log, shown on failure
  local what="$1"; shift
  local s; s=$(date +%s)
  if ! "$@" >"$log" 2>&1; then
    tail -60 "$log"; echo "package-check: $what failed"; exit 1
  fi
  echo "package-check: $what ($(( $(date +%s) - s )) s)"
}

mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard) |
  (cd "$repo" && xargs -0 cp --parents -t "$work/src" 2>/dev/null || true)  # a deleted file: skipped

PYTHON="$py" PYCCL_WHEEL_PYTHONS="$py" TMPDIR="$work" bash "$repo/tools/build-wheels.sh" "$work/dist" \
  >"$log" 2>&1 || { tail -60 "$log"; echo "package-check: tools/build-wheels.sh failed"; exit 1; }
sed 's/^build-wheels: /package-check: /' "$log"
sdist=$(ls "$work"/dist/*.tar.gz)
wheel=$(ls "$work"/dist/*manylinux_2_28_x86_64.whl)
echo "package-check: $(basename "$sdist") $(stat -c %s "$sdist") B, $(basename "$wheel") $(stat -c %s "$wheel") B"

# Every file of csrc/ that git knows is in the sdist (under its top folder).
missing=$(comm -23 <(cd "$repo" && git ls-files csrc | sort) \
                   <(tar tzf "$sdist" | sed 's|^[^/]*/||' | sort))
[ -z "$missing" ] || { echo "package-check: not in the sdist:"; echo "$missing"; exit 1; }

mkdir "$work/whl"
"$py" -m zipfile -e "$wheel" "$work/whl"
# The description the index page shows (README.md, through setup.py): no link relative to the
# repository, which would not resolve there.
"$py" - "$(ls "$work"/whl/*.dist-info/METADATA)" <<'EOF'
import re
import sys

body = open(sys.argv[1], encoding="utf-8").read().split("\n\n", 1)[1]
links = re.findall(r"\]\(([^)\s]+)\)", body)
relative = [t for t in links if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
assert len(body) > 1000 and not relative, f"the wheel's description has relative links: {relative}"
print(f"package-check: the description ({len(body)} characters, {len(links)} links) has no relative link")
EOF
so=$(ls "$work"/whl/pyccl/_C*.so)
dyn=$(readelf -d "$so")
if grep -E "RPATH|RUNPATH" <<<"$dyn"; then echo "package-check: the wheel's $(basename "$so") has a run path"; exit 1; fi
if readelf -S -W "$so" | grep -E '\.debug_|\.symtab'; then
  echo "package-check: the wheel's $(basename "$so") is not stripped"; exit 1
fi
echo "package-check: $(basename "$so") $(stat -c %s "$so") B, stripped, no run path, needs" \
  "$(grep -o 'Shared library: \[[^]]*\]' <<<"$dyn" | sed 's/.*\[\(.*\)\]/\1/' | paste -sd ' ')"

step "a fresh venv with $torch_spec and the wheel" bash -c \
  "'$py' -m venv '$work/venv' && '$work/venv/bin/pip' install '$torch_spec' '$wheel[numpy]'"
mkdir "$work/elsewhere"
cd "$work/elsewhere"
"$work/venv/bin/python" - "$work/venv" <<'EOF'
import importlib.metadata as md
import os
import sys

import pyccl

venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(pyccl.__file__)
assert where.startswith(venv + os.sep), f"pyccl imported from {where}, not from the venv"
assert pyccl.__version__ == md.version("pyccl-nccl"), (pyccl.__version__, md.version("pyccl-nccl"))
assert pyccl._C._ar_built(), "the wheel's extension was built without the own kernels"
print(f"package-check: import pyccl from {os.getcwd()}: {pyccl.__version__}, {where}, own kernels compiled in")
EOF
step "$nccl_spec in the venv" "$work/venv/bin/pip" install "$nccl_spec"
"$work/venv/bin/python" - "$nccl_spec" <<'EOF'
import sys

import pyccl

v = pyccl.nccl.version()
spec = sys.argv[1]
if "==" in spec:  # the NCCL loaded is the wheel's
    assert ".".join(map(str, v)) == spec.split("==")[1], (v, spec)
assert len(pyccl.unique_id()) == pyccl.NCCL_UNIQUE_ID_BYTES == 128
print(f"package-check: pyccl.nccl.version() {v}, unique_id() 128 bytes")
EOF
step "pytest in the venv" "$work/venv/bin/pip" install pytest
# from a folder without pyccl, so that the tests import the wheel's
(cd "$work/elsewhere" && "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
   "$work/src/tests/test_ops_cpu.py" "$work/src/tests/test_distributed_cpu.py") > "$log" 2>&1 ||
  { tail -60 "$log"; echo "package-check: the torch-facing tests failed with $torch_spec"; exit 1; }
echo "package-check: $torch_spec: $(tail -n 1 "$log")"
echo "package-check: OK in $(( $(date +%s) - t0 )) s"
