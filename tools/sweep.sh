#!/usr/bin/env bash
# The all_reduce comparison of docs/PERFORMANCE.md, on a machine with 2 or more GPUs (one rank per
# GPU), every system in one run: nccl-tests (built here against the NCCL torch loads),
# pyccl's own kernels against NCCL (python -m pyccl.bench --algos), pyccl beside
# torch.distributed (nccl and pyccl backends), torch.cuda.nccl and NCCL on symmetric windows
# (--compare --registered, eager and CUDA graph), torch's symmetric-memory kernels and a DDP
# step (tools/peers_bench.py); and all_gather and reduce_scatter, pyccl beside the same peers
# (--coll all_gather,reduce_scatter --compare) and nccl-tests' programs for them.
# Usage: bash tools/sweep.sh [--ranks LIST] [--only STEPS] [NCCL_TESTS_SOURCE]
#        NCCL_TESTS_SOURCE: a checkout of github.com/NVIDIA/nccl-tests; without it the
#        nccl-tests part is left out.
# Writes nt.txt (and nt-mpi.txt: nccl-tests built with MPI, one process per GPU, where mpicc is
# found), algos.txt/json (and algos-large.txt/json: 64 MiB-1 GiB), cmp.txt/json, cmpg.txt/json, coll.txt/json (and coll-own.txt/json: pyccl's own kernels), symm.txt/json, ddp.txt
# under $OUT (or ./sweep-out), and tables.md: every table of docs/PERFORMANCE.md from them
# (tools/sweep_tables.py); about 8 minutes on 2 H100s at 2 ranks without the coll step.  SWEEP_ARCH (default 90) is the compute
# capability nccl-tests is built for.  SWEEP_RANKS (default: every GPU) runs it at that many ranks,
# one GPU each, the first ones (one call per rank count: OUT=r3 SWEEP_RANKS=3 bash tools/sweep.sh).
# --ranks LIST runs it at each rank count of LIST (comma-separated, each 2 or more; "all": 2 up
# to the GPU count), one after another in one call, nccl-tests built once; each rank count's
# files go under $OUT/rN (r2/symm.txt, r3/symm.txt, ...).
# --only STEPS runs only these steps (comma-separated, of nt algos symm ddp cmp cmpg coll; default
# all, nt where NCCL_TESTS_SOURCE is given), to split a sweep over calls of limited length.
# Each step's seconds are printed ("sweep: STEP at N ranks: SECONDS s").
# Exit status: 0; 1 when a step failed or timed out (the others still run), or the machine
# cannot run it; 2 for a bad command line.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
usage() { sed -n '9,11p' "$0" | sed 's/^# //'; }
STEPS_ALL=nt,algos,symm,ddp,cmp,cmpg,coll
RANKS= ONLY= SRC=
while [ $# -gt 0 ]; do
  case $1 in
    --ranks|--only)
      [ $# -ge 2 ] || { echo "sweep: $1 needs a value"; exit 2; }
      if [ "$1" = --ranks ]; then RANKS=$2; else ONLY=$2; fi; shift 2 ;;
    --ranks=*) RANKS=${1#--ranks=}; shift ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "sweep: unknown option '$1'"; usage; exit 2 ;;
    *) [ -z "$SRC" ] || { echo "sweep: one NCCL_TESTS_SOURCE only, got '$SRC' and '$1'"; exit 2; }
       SRC=$1; shift ;;
  esac
done
if [ -n "$RANKS" ] && [ "$RANKS" != all ] && ! [[ "$RANKS" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "sweep: --ranks takes rank counts separated by commas (2,3,4) or 'all', got '$RANKS'"; exit 2
fi
if [ -n "$RANKS" ] && [ "$RANKS" != all ]; then
  for r in ${RANKS//,/ }; do
    [ "$((10#$r))" -ge 2 ] || { echo "sweep: --ranks: every rank count must be 2 or more, got '$RANKS'"; exit 2; }
  done
fi
R=${SWEEP_RANKS:-}
if [ -n "$R" ] && ! [[ "$R" =~ ^[0-9]+$ && "$R" -ge 2 ]]; then
  echo "sweep: SWEEP_RANKS must be a whole number of 2 or more, got '$R'"; exit 2
fi
if [ -n "$R" ] && [ -n "$RANKS" ]; then
  echo "sweep: give --ranks or SWEEP_RANKS, not both"; exit 2
fi
STEPS=${ONLY:-$STEPS_ALL}
for s in ${STEPS//,/ }; do
  [[ ",$STEPS_ALL," == *",$s,"* ]] || { echo "sweep: --only: unknown step '$s' (choose from $STEPS_ALL)"; exit 2; }
done
[[ "$STEPS" =~ ^[a-z]+(,[a-z]+)*$ ]] || { echo "sweep: --only takes steps separated by commas, got '$ONLY'"; exit 2; }
if [ -n "$ONLY" ] && [[ ",$ONLY," == *",nt,"* ]] && [ -z "$SRC" ]; then
  echo "sweep: --only nt needs NCCL_TESTS_SOURCE"; exit 2
fi
want() { [[ ",$STEPS," == *",$1,"* ]]; }
OUT=$(realpath -m "${OUT:-$PWD/sweep-out}")
SRC=${SRC:+$(realpath "$SRC")}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! G=$($PY -c 'import torch; print(torch.cuda.device_count())'); then
  echo "sweep: $PY cannot import torch"; exit 1
fi
if [ "$G" -lt 2 ]; then
  echo "sweep: needs 2 or more GPUs, one rank each (this machine has $G)"; exit 1
fi
if [ -n "$R" ]; then
  [ "$R" -le "$G" ] || { echo "sweep: SWEEP_RANKS=$R, but this machine has $G GPUs"; exit 1; }
fi
if [ "$RANKS" = all ]; then
  LIST=$(seq 2 "$G")
elif [ -n "$RANKS" ]; then
  LIST=$(printf '%s\n' ${RANKS//,/ } | sed 's/^0*//' | sort -nu)
  for r in $LIST; do
    [ "$r" -le "$G" ] || { echo "sweep: --ranks asks for $r ranks, but this machine has $G GPUs"; exit 1; }
  done
else
  LIST=${R:-$G}
fi
rc=0
step() {  # a step's command; its failure is remembered, the sweep goes on
  "$@" || { echo "sweep: failed (exit $?): $*"; rc=1; }
}
if [ -n "$SRC" ] && want nt; then
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
  # One process per GPU, as pyccl runs: nccl-tests built with MPI, where an MPI compiler is here
  NTM=
  if MPICC=$(command -v mpicc); then
    MH=$(dirname "$(dirname "$MPICC")")
    step make -j"$(nproc)" -C "$B/src/src" build BUILDDIR="$B/build" NCCL_HOME="$B/nccl" MPI=1 \
        MPI_HOME="$MH" NAME_SUFFIX=_mpi NVCC_GENCODE="-gencode=arch=compute_$A,code=sm_$A" \
        >> "$OUT/nt-build.log" 2>&1
    [ -x "$B/build/all_reduce_perf_mpi" ] && NTM=$B/build/all_reduce_perf_mpi
  else
    echo "sweep: no mpicc here: nccl-tests one process per GPU left out"
  fi
fi
run_nt() {  # nccl-tests at $G ranks into $D
  for d in float bfloat16; do
    echo "### nccl-tests $d eager"; step timeout 60 $NT -b 8 -e 64M -f 4 -g "$G" -n 100 -w 20 -d $d
    echo "### nccl-tests $d graph -G 10"; step timeout 60 $NT -b 8 -e 64M -f 4 -g "$G" -n 20 -w 5 -G 10 -d $d
    echo "### nccl-tests $d symmetric -R 2"; step timeout 60 $NT -b 8 -e 64M -f 4 -g "$G" -n 100 -w 20 -R 2 -d $d
  done > "$D/nt.txt" 2>&1
  echo "### nccl-tests float 1G" >> "$D/nt.txt"
  step timeout 60 $NT -b 64M -e 1G -f 4 -g "$G" -n 20 -w 5 >> "$D/nt.txt" 2>&1
  for c in all_gather reduce_scatter; do  # beside the coll step's rows
    echo "### nccl-tests $c float eager" >> "$D/nt.txt"
    step timeout 60 "$(dirname "$NT")/${c}_perf" -b 8 -e 64M -f 4 -g "$G" -n 100 -w 20 >> "$D/nt.txt" 2>&1
  done
  grep -E "^###|Avg bus|^sweep:" "$D/nt.txt"
  if [ -n "$NTM" ]; then
    RUN=(mpirun -np "$G")
    if mpirun --version 2>&1 | grep -q "Open MPI"; then  # Open MPI: as root, and pass the settings
      RUN+=(--allow-run-as-root -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
            -x NVSHMEM_DISABLE_NVLS -x LD_LIBRARY_PATH)
    fi
    for d in float bfloat16; do
      echo "### nccl-tests MPI $d eager"; step timeout 90 "${RUN[@]}" "$NTM" -b 8 -e 64M -f 4 -g 1 -n 100 -w 20 -d $d
      echo "### nccl-tests MPI $d graph -G 10"; step timeout 90 "${RUN[@]}" "$NTM" -b 8 -e 64M -f 4 -g 1 -n 20 -w 5 -G 10 -d $d
      echo "### nccl-tests MPI $d symmetric -R 2"; step timeout 90 "${RUN[@]}" "$NTM" -b 8 -e 64M -f 4 -g 1 -n 100 -w 20 -R 2 -d $d
    done > "$D/nt-mpi.txt" 2>&1
    grep -E "^###|Avg bus|^sweep:" "$D/nt-mpi.txt"
  fi
}
run_algos() {
  step timeout 200 $PY -m pyccl.bench -g "$G" -b 8 -e 64M -f 4 -n 100 --algos nccl,oneshot,twoshot,auto \
      --json "$D/algos.json" --no-progress > "$D/algos.txt" 2>&1; tail -40 "$D/algos.txt"
  # 64 MiB to 1 GiB (the sizes of nccl-tests' 1G section), own kernels in chunks of their buffer
  step timeout 180 $PY -m pyccl.bench -g "$G" -b 64M -e 1G -f 4 -n 20 --algos nccl,oneshot,twoshot,auto \
      --json "$D/algos-large.json" --no-progress > "$D/algos-large.txt" 2>&1; tail -12 "$D/algos-large.txt"
}
run_symm() {
  step timeout 150 $PY tools/peers_bench.py symm -g "$G" --json "$D/symm.json" > "$D/symm.txt" 2>&1
  tail -30 "$D/symm.txt"
}
run_ddp() {
  step timeout 100 $PY tools/peers_bench.py ddp -g "$G" > "$D/ddp.txt" 2>&1; tail -5 "$D/ddp.txt"
}
run_cmp() {
  step timeout 280 $PY -m pyccl.bench -g "$G" -b 8 -e 64M -f 4 -d float,bfloat16 --registered --compare -n 100 \
      --repeats 3 --json "$D/cmp.json" --no-progress > "$D/cmp.txt" 2>&1; tail -50 "$D/cmp.txt"
}
run_cmpg() {
  step timeout 150 $PY -m pyccl.bench -g "$G" -b 8 -e 64M -f 4 -G 10 -n 20 --registered \
      --json "$D/cmpg.json" --no-progress > "$D/cmpg.txt" 2>&1; tail -30 "$D/cmpg.txt"
}
run_coll() {
  step timeout 280 $PY -m pyccl.bench -g "$G" --coll all_gather,reduce_scatter -b 8 -e 64M -f 4 --compare \
      -n 100 --repeats 3 --json "$D/coll.json" --no-progress > "$D/coll.txt" 2>&1; tail -50 "$D/coll.txt"
  # pyccl's own all_gather and reduce_scatter kernels (algo="oneshot"), the same sizes
  step timeout 150 $PY -m pyccl.bench -g "$G" --coll all_gather,reduce_scatter -b 8 -e 64M -f 4 --algo oneshot \
      -n 100 --repeats 3 --json "$D/coll-own.json" --no-progress > "$D/coll-own.txt" 2>&1; tail -20 "$D/coll-own.txt"
}
for G in $LIST; do
  D=$OUT; [ -n "$RANKS" ] && D=$OUT/r$G
  mkdir -p "$D"
  echo "sweep: $G ranks, one GPU each${RANKS:+, files in $D}"
  for s in nt algos symm ddp cmp cmpg coll; do
    want $s || continue
    [ $s != nt ] || [ -n "$SRC" ] || continue
    t0=$SECONDS
    run_$s
    echo "sweep: $s at $G ranks: $((SECONDS - t0)) s"
  done
done
# every system side by side, per rank count, from the files above (tools/sweep_tables.py)
if $PY tools/sweep_tables.py "$OUT" > "$OUT/tables.md.new" 2>/dev/null; then
  mv "$OUT/tables.md.new" "$OUT/tables.md"; echo "sweep: tables in $OUT/tables.md"
else
  rm -f "$OUT/tables.md.new"
fi
exit $rc
