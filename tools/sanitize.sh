#!/usr/bin/env bash
# The sanitizer job: build pyccl._C with AddressSanitizer and
# UndefinedBehaviorSanitizer in a scratch copy of the tree (the normal in-place
# build is left alone), as a debug build (PYCCL_DEBUG=1: every lock checked
# against csrc/locks.h's order; a broken order aborts the process), then run the CPU tier's memory-safety tests under it:
#   tests/test_bad_input.py tests/test_api_cpu.py tests/test_nccl_cpu.py
#   tests/test_timeout_cpu.py tests/test_fuzz_cpu.py tests/test_lifecycle_cpu.py
#   tests/test_own_lifecycle_cpu.py
# (test_bench_cpu.py is left out: it tests the benchmark runner's Python, not
# the extension, and is the slowest file).  Child processes (the stand-in GPU
# scenarios, the fuzz batches) inherit the sanitizer runtime.  Exit status:
# pytest's, or 1 when any sanitizer wrote a report, in any process, even one
# whose failure a test expected.  Extra arguments go to pytest (--capture=sys
# keeps a report written to fd 2 by the pytest process itself in the output).
# Environment: PYTHON (default python3), PYCCL_FUZZ_CALLS (default 5000),
# KEEP=1 keeps the scratch folder.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
cc="${CC:-gcc}"
t0=$(date +%s)

scratch="$(mktemp -d "${TMPDIR:-/tmp}/pyccl-sanitize.XXXXXX")"
cleanup() { [ "${KEEP:-0}" = 1 ] && echo "sanitize: kept $scratch" || rm -rf "$scratch"; }
trap cleanup EXIT

# The tree as git sees it (tracked and new files, not build outputs); a plain
# copy without build/ where there is no git.
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard) |
        (cd "$repo" && xargs -0 cp --parents -t "$scratch" 2>/dev/null || true)  # a deleted file: skipped
else
    (cd "$repo" && tar --exclude=./build --exclude=./.git -cf - .) | (cd "$scratch" && tar -xf -)
fi
rm -f "$scratch"/pyccl/_C*.so

san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
echo "sanitize: building _C with $san in $scratch"
(cd "$scratch" && CC="$cc" CFLAGS="$san -O1 -g" LDFLAGS="$san" PYCCL_DEBUG=1 PYCCL_CUDA_ARCHS="${PYCCL_CUDA_ARCHS:-90}" \
    "$py" setup.py -q build_ext --inplace >"$scratch/build.log" 2>&1) || {
    tail -50 "$scratch/build.log"; echo "sanitize: build failed"; exit 1; }

so="$(ls "$scratch"/pyccl/_C*.so)"
libasan="$("$cc" -print-file-name=libasan.so)"
libubsan="$("$cc" -print-file-name=libubsan.so)"
for lib in "$libasan" "$libubsan"; do
    [ -e "$lib" ] || { echo "sanitize: $cc has no $(basename "$lib") (install libasan/libubsan)"; exit 1; }
done
ldd "$so" | grep libasan >/dev/null || { echo "sanitize: $so is not linked with libasan"; exit 1; }

logs="$scratch/sanitizer-logs"
mkdir -p "$logs"
# detect_leaks=0: CPython keeps much alive at exit by design.  PYTHONMALLOC=malloc
# puts Python objects in ASan's heap, so a freed object's reuse is seen.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1:log_path=$logs/asan:verify_asan_link_order=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan"
export PYTHONMALLOC=malloc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYCCL_FUZZ_CALLS="${PYCCL_FUZZ_CALLS:-5000}"
unset PYTHONPATH

# The extension must be the sanitized copy, not an installed one.
(cd "$scratch" && LD_PRELOAD="$libasan $libubsan" "$py" -c \
    "import pyccl._C as c, sys; sys.exit(0 if c.__file__ == '$so' else 'sanitize: imported ' + c.__file__)")

set +e
(cd "$scratch" && LD_PRELOAD="$libasan $libubsan" "$py" -m pytest -q -p no:cacheprovider --capture=sys \
    tests/test_bad_input.py tests/test_api_cpu.py tests/test_nccl_cpu.py \
    tests/test_timeout_cpu.py tests/test_fuzz_cpu.py tests/test_lifecycle_cpu.py \
    tests/test_own_lifecycle_cpu.py "$@" 2>&1) | tee "$scratch/pytest.log"
rc=${PIPESTATUS[0]}
set -e

# ASan honours log_path; gcc's UBSan runtime writes to stderr whatever its
# log_path says, so its reports are found in the output (a child's stderr is
# in there when its test failed, and halt_on_error makes that child fail).
if compgen -G "$logs/*" >/dev/null; then
    for f in "$logs"/*; do echo "=== sanitizer report $f"; head -80 "$f"; done
    echo "sanitize: sanitizer reports above"
    rc=1
fi
if grep -qE "runtime error:|ERROR: AddressSanitizer|UndefinedBehaviorSanitizer" "$scratch/pytest.log"; then
    grep -E -A3 "runtime error:|ERROR: AddressSanitizer|UndefinedBehaviorSanitizer" "$scratch/pytest.log" | head -40
    echo "sanitize: sanitizer reports in the test output"
    rc=1
fi
echo "sanitize: exit $rc after $(( $(date +%s) - t0 )) s"
exit $rc
