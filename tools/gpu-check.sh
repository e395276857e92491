#!/usr/bin/env bash
# One device call: build pyccl, run the GPU test tier and a short benchmark.
# Usage (device tool): bash tools/gpu-check.sh [--part N] [pytest args...]
#   The whole tier is more than one 10-minute call: --part 1 to 6 split it into six calls
#   of under 10 minutes each on one GPU (multi-rank tests with ranks sharing it) or on
#   several: 1 = the own kernels; 2 = their recovery cycles, memory and sanitizer tests,
#   failures, stress; 3 = the per-rank API and its examples; 4 = the drop-in, bad input, the
#   torch.distributed backend; 5 = registered memory, compile ops, the benchmark tool, the own
#   kernels simulated at 2-8 ranks; 6 = the CPU tests that CI does not already cover (with a
#   GPU present).  Times on 4 H200s, one rank per GPU: 1 about 230 s, 2 about 465 s, 3 about
#   275 s, 4 about 300 s for all but its last four tests, 5 about 265 s for all but its last
#   two (set GPU_CHECK_PYTEST_S above those); on one H100 the five parts before 6 was split
#   off took about 2,100 s.  Given test paths (tests/...), only those run.
#        bash tools/gpu-check.sh --bench [pyccl.bench args...]   (build, then the benchmark)
#   GPU_CHECK_BENCH=0 leaves out the quick benchmark and the own-kernel sweep (python -m
#   pyccl.bench --algos) after the tests;
#   GPU_CHECK_WHEEL=0 leaves out the offline `pip wheel` build; GPU_CHECK_PYTEST_S caps pytest (500 s).
# PYCCL_EXPECT_GPUS defaults to the GPU count nvidia-smi shows: every skip short of a test
# needing more GPUs than that is a failure (set it yourself to override).
# Writes env.txt, build.log, pytest.log, quick.txt, ar.txt/json (bench.txt, bench.json,
# perf.png, host.txt with --bench) under $OUT (or ./gpu-out).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  $PY -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
  $PY -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-nccl|setuptools|pytest|cupy|mpi4py) "
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${1:-}" = "--part" ]; then
  part=$2; shift 2
  case "$part" in
    1) set -- tests/test_ar_gpu.py --deselect tests/test_ar_gpu.py::test_every_byte_back_after_100_abort_or_destroy_cycles \
              --deselect tests/test_ar_gpu.py::test_memory_kept_after_abort_is_at_most_the_exported_regions \
              --deselect tests/test_ar_gpu.py::test_compute_sanitizer_clean "$@" ;;
    2) set -- tests/test_ar_gpu.py::test_every_byte_back_after_100_abort_or_destroy_cycles \
              tests/test_ar_gpu.py::test_memory_kept_after_abort_is_at_most_the_exported_regions \
              tests/test_ar_gpu.py::test_compute_sanitizer_clean tests/test_failure_gpu.py tests/test_stress_gpu.py "$@" ;;
    3) set -- tests/test_comm_gpu.py "$@" ;;
    4) set -- tests/test_nccl_gpu.py tests/test_bad_input.py tests/test_distributed_gpu.py "$@" ;;
    5) set -- tests/test_registered_gpu.py tests/test_ops_gpu.py tests/test_bench_gpu.py \
              tests/test_ar_sim_gpu.py "$@" ;;
    6) set -- tests/test_registered_cpu.py tests/test_api_cpu.py tests/test_nccl_cpu.py \
              tests/test_share_gpus_cpu.py tests/test_distributed_cpu.py tests/test_ops_cpu.py \
              tests/test_selection_cpu.py \
              tests/test_bench_cpu.py::test_peers_bench_and_sweep_need_two_gpus "$@" ;;
    *) echo "gpu-check: --part takes 1 to 6, got '$part'"; exit 2 ;;
  esac
fi

start=$(date +%s%N)
# the device has nvcc: a build without pyccl's own kernels is a failure there
export PYCCL_REQUIRE_KERNELS=1
if ! $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "build_ext --inplace: $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$OUT/build.log"
# The offline pip path of the README must work too (GPU_CHECK_WHEEL=0 skips it).
if [ "${GPU_CHECK_WHEEL:-1}" = 0 ]; then
  echo "pip wheel --no-build-isolation: skipped (GPU_CHECK_WHEEL=0)" | tee -a "$OUT/build.log"
elif $PY -m pip wheel --no-build-isolation --no-deps -q -w /tmp/pyccl-wheel . >> "$OUT/build.log" 2>&1; then
  echo "pip wheel --no-build-isolation: ok ($(ls /tmp/pyccl-wheel))" | tee -a "$OUT/build.log"
else
  echo "pip wheel --no-build-isolation: FAILED" | tee -a "$OUT/build.log"
fi

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
set -o pipefail
# The GPUs the driver shows (not torch's count: a broken torch CUDA init must fail the
# tests, not make them skip as on a CPU machine).  With PYCCL_EXPECT_GPUS set, a skip for
# lack of GPUs or tools is a failure, except tests needing more GPUs than this (tests/_gpu_tier.py).
if [ -z "${PYCCL_EXPECT_GPUS:-}" ]; then
  if ! SEEN=$(nvidia-smi -L 2>&1); then
    echo "nvidia-smi -L failed: $SEEN"; exit 1
  fi
  SEEN=$(grep -c '^GPU ' <<< "$SEEN")
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # the ones this process may use
    VIS=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
    [ "$VIS" -lt "$SEEN" ] && SEEN=$VIS
  fi
  export PYCCL_EXPECT_GPUS=$SEEN
fi
echo "PYCCL_EXPECT_GPUS=$PYCCL_EXPECT_GPUS" | tee -a "$OUT/env.txt"
if [ "${1:-}" = "--bench" ]; then
  shift
  G=$($PY -c 'import torch; print(torch.cuda.device_count())')
  timeout 400 $PY -m pyccl.bench -b 8 -e 1G -f 8 -g "$G" --compare --repeats 3 \
      --json "$OUT/bench.json" --plot "$OUT/perf.png" "$@" 2>&1 | tee "$OUT/bench.txt"
  rc=$?
  timeout 150 $PY -m pyccl.bench -g "$G" --host-overhead 2>&1 | tee "$OUT/host.txt"
  rc2=$?
  exit $(( rc ? rc : rc2 ))
fi
# A hung test fails alone when pytest-timeout is there.
TO=$($PY -c 'import pytest_timeout' 2>/dev/null && echo "--timeout=300")
# no test paths given: pyproject's testpaths (tests/); the 15 slowest tests are listed in
# pytest.log (where a part's time goes)
timeout "${GPU_CHECK_PYTEST_S:-500}" $PY -m pytest -q -rs -p no:cacheprovider --durations=15 $TO "$@" 2>&1 \
  | tee "$OUT/pytest.log" | tail -60
rc=$?
[ "${GPU_CHECK_BENCH:-1}" = 0 ] && exit $rc
# The quick benchmark: the drop-in against torch.cuda.nccl (one process, every GPU), host cost
# per call of the four systems, and where an eager call's host time goes; then the own-kernel
# algo sweep against NCCL (eager, CUDA graph, host) on 2 GPUs or more.  Numbers, not a verdict:
# their exit status does not change the tests' ($rc).
G=$($PY -c 'import torch; print(torch.cuda.device_count())')
{
  timeout 150 $PY -m pyccl.bench --api nccl --compare -b 8 -e 256M -f 8 -n 50 -w 5 -c 1 --no-progress
  timeout 60 $PY -m pyccl.bench --host-overhead --no-progress
  timeout 60 $PY -m pyccl.bench -g 1 --host-breakdown --no-progress
} 2>&1 | tee "$OUT/quick.txt"
if [ "$G" -ge 2 ]; then
  timeout 200 $PY -m pyccl.bench -g "$G" -b 8 -e 16M -f 4 -n 100 --algos nccl,oneshot,twoshot,auto \
      --json "$OUT/ar.json" --no-progress 2>&1 | tee "$OUT/ar.txt"
fi
exit $rc
