#!/usr/bin/env bash
# Prove the tests catch faults: apply each of tools/_mutate.py's deliberate faults, one at a
# time, to a scratch copy of this tree (git ls-files: tracked and untracked, not ignored),
# rebuild, run the tests that should notice, and print  fault | tier | caught/survived.
# Every anchor must be found exactly once, or that fault reports no-anchor (never a silent pass).
# Usage:
#   bash tools/mutate.sh --cpu            CPU-tier faults (fake GPU library; no GPU needed)
#   bash tools/mutate.sh --gpu            GPU-tier faults (2 GPUs; 'gpu3' rows need 3+)
#   bash tools/mutate.sh --gpu1           the kernel faults one GPU catches (simulated ranks)
#   bash tools/mutate.sh                  all of them
#   bash tools/mutate.sh --list | --only 'wrong stream' [--keep] [--timeout S]
# Exit status 0 only when every selected fault was caught.
set -u
cd "$(dirname "$0")/.."
tier=all
args=()
for a in "$@"; do
  case "$a" in
    --cpu) tier=cpu ;;
    --gpu) tier=gpu ;;
    --gpu1) tier=gpu1 ;;
    *) args+=("$a") ;;
  esac
done
exec "${PYTHON:-python3}" tools/_mutate.py --tier "$tier" "${args[@]}"
