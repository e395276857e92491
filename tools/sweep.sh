#!/usr/bin/env bash
# The all_reduce comparison of docs/PERFORMANCE.md, on a machine with 2 or more GPUs (one rank per
# GPU), every system in one run: nccl-tests (built here against the NCCL torch loads),
# pyccl's own kernels against NCCL (python -m pyccl.bench --algos), pyccl beside
# torch.distributed (nccl and pyccl backends), torch.cuda.nccl and NCCL on symmetric windows
# (--compare --registered, eager and CUDA graph), torch's symmetric-memory kernels and a DDP
# step (tools/peers_bench.py).
# Usage: bash tools/sweep.sh NCCL_TESTS_SOURCE   (a checkout of github.com/NVIDIA/nccl-tests;
#        without it the nccl-tests part is left out)
# Writes nt.txt (and nt-mpi.txt: nccl-tests built with MPI, one process per GPU, where mpicc is
# found), algos.txt/json, cmp.txt/json, cmpg.txt/json, symm.txt/json, ddp.txt under $OUT (or
# ./sweep-out); about 8 minutes on 2 H100s.  SWEEP_ARCH (default 90) is the compute
# capability nccl-tests is built for.  SWEEP_RANKS (default: every GPU) runs it at that many ranks,
# one GPU each, the first ones (one call per rank count: OUT=r3 SWEEP_RANKS=3 bash tools/sweep.sh).
# Exit status: 0, or 1 when a step failed or timed out (the others still run).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-$PWD/sweep-out}")
SRC=${1:+$(realpath "$1")}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
R=${SWEEP_RANKS:-}
if [ -n "$R" ] && ! [[ "$R" =~ ^[0-9]+$ && "$R" -ge 2 ]]; then
  echo "sweep: SWEEP_RANKS must be a whole number of 2 or more, got '$R'"; exit 2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! G=$($PY -c 'import torch; print(torch.cuda.device_count())'); then
  echo "sweep: $PY cannot import torch"; exit 1
fi
if [ "$G" -lt 2 ]; then
  echo "sweep: needs 2 or more GPUs, one rank each (this machine has $G)"; exit 1
fi
if [ -n "$R" ]; then
  [ "$R" -le "$G" ] || { echo "sweep: SWEEP_RANKS=$R, but this machine has $G GPUs"; exit 1; }
  G=$R
fi
echo "sweep: $G ranks, one GPU each"
rc=0
step() {  # a step's command; its failure is remembered, the sweep goes on
  "$@" || { echo "sweep: failed (exit $?): $*"; rc=1; }
}
if [ -n "$SRC" ]; then
  # nccl-tests against the libnccl of the nvidia-nccl wheel that torch loads (one NCCL per process)
  NH=$($PY -c "import nvidia.nccl as m; print(list(m.__path__)[0])")
  export LD_LIBRARY_PATH=$NH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  B=$(mktemp -d); trap 'rm -rf "$B"' EXIT
  mkdir -p "$B/nccl/lib"; ln -s "$NH/include" "$B/nccl/include"
  ln -s "$NH/lib/libnccl.so.2" "$B/nccl/lib/libnccl.so"
  cp -r "$SRC" "$B/src"
  A=${SWEEP_ARCH:-90}
  make -j"$(nproc)" -C "$B/src/src" build BUILDDIR="$B/build" NCCL_HOME="$B/nccl" MPI=0 \
      NVCC_GENCODE="-gencode=arch=compute_$A,code=sm_$A" > "$OUT/nt-build.log" 2>&1 \
    || { tail -20 "$OUT/nt-build.log"; echo "sweep: nccl-tests did not build"; exit 1; }
  NT=$B/build/all_reduce_perf
  for d in float bfloat16; do
    echo "### nccl-tests $d eager"; step timeout 60 $NT -b 8 -e 64M -f 4 -g "$G" -n 100 -w 20 -d $d
    echo "### nccl-tests $d graph -G 10"; step timeout 60 $NT -b 8 -e 64M -f 4 -g "$G" -n 20 -w 5 -G 10 -d $d
    echo "### nccl-tests $d symmetric -R 2"; step timeout 60 $NT -b 8 -e 64M -f 4 -g "$G" -n 100 -w 20 -R 2 -d $d
  done > "$OUT/nt.txt" 2>&1
  echo "### nccl-tests float 1G" >> "$OUT/nt.txt"
  step timeout 60 $NT -b 64M -e 1G -f 4 -g "$G" -n 20 -w 5 >> "$OUT/nt.txt" 2>&1
  grep -E "^###|Avg bus|^sweep:" "$OUT/nt.txt"
  # One process per GPU, as pyccl runs: nccl-tests built with MPI, where an MPI compiler is here
  if MPICC=$(command -v mpicc); then
    MH=$(dirname "$(dirname "$MPICC")")
    step make -j"$(nproc)" -C "$B/src/src" build BUILDDIR="$B/build" NCCL_HOME="$B/nccl" MPI=1 \
        MPI_HOME="$MH" NAME_SUFFIX=_mpi NVCC_GENCODE="-gencode=arch=compute_$A,code=sm_$A" \
        >> "$OUT/nt-build.log" 2>&1
    RUN=(mpirun -np "$G")
    if mpirun --version 2>&1 | grep -q "Open MPI"; then  # Open MPI: as root, and pass the settings
      RUN+=(--allow-run-as-root -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
            -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH)
    fi
    NTM=$B/build/all_reduce_perf_mpi
    if [ -x "$NTM" ]; then
      for d in float bfloat16; do
        echo "### nccl-tests MPI $d eager"; step timeout 90 "${RUN[@]}" "$NTM" -b 8 -e 64M -f 4 -g 1 -n 100 -w 20 -d $d
        echo "### nccl-tests MPI $d graph -G 10"; step timeout 90 "${RUN[@]}" "$NTM" -b 8 -e 64M -f 4 -g 1 -n 20 -w 5 -G 10 -d $d
        echo "### nccl-tests MPI $d symmetric -R 2"; step timeout 90 "${RUN[@]}" "$NTM" -b 8 -e 64M -f 4 -g 1 -n 100 -w 20 -R 2 -d $d
      done > "$OUT/nt-mpi.txt" 2>&1
      grep -E "^###|Avg bus|^sweep:" "$OUT/nt-mpi.txt"
    fi
  else
    echo "sweep: no mpicc here: nccl-tests one process per GPU left out"
  fi
fi
step timeout 200 $PY -m pyccl.bench -g "$G" -b 8 -e 64M -f 4 -n 100 --algos nccl,oneshot,twoshot,auto \
    --json "$OUT/algos.json" --no-progress > "$OUT/algos.txt" 2>&1; tail -40 "$OUT/algos.txt"
step timeout 150 $PY tools/peers_bench.py symm -g "$G" --json "$OUT/symm.json" > "$OUT/symm.txt" 2>&1
tail -30 "$OUT/symm.txt"
step timeout 100 $PY tools/peers_bench.py ddp -g "$G" > "$OUT/ddp.txt" 2>&1; tail -4 "$OUT/ddp.txt"
step timeout 280 $PY -m pyccl.bench -g "$G" -b 8 -e 64M -f 4 -d float,bfloat16 --registered --compare -n 100 \
    --repeats 3 --json "$OUT/cmp.json" --no-progress > "$OUT/cmp.txt" 2>&1; tail -50 "$OUT/cmp.txt"
step timeout 150 $PY -m pyccl.bench -g "$G" -b 8 -e 64M -f 4 -G 10 -n 20 --registered \
    --json "$OUT/cmpg.json" --no-progress > "$OUT/cmpg.txt" 2>&1; tail -30 "$OUT/cmpg.txt"
exit $rc
