#!/usr/bin/env bash
# Build the documentation site (Sphinx, warnings are errors) into $1 (default: build/docs).
# Installs docs/requirements.txt where Sphinx or MyST is missing.  pyccl must be importable:
# installed (tools/setup.sh) or built in place (python3 setup.py build_ext --inplace); the
# checkout is put first on PYTHONPATH, so an in-place build is found.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-build/docs}
if ! $PY -c "import sphinx, myst_parser" 2>/dev/null; then
  $PY -m pip install -q -r docs/requirements.txt
fi
export PYTHONPATH="$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}"
exec $PY -m sphinx -W --keep-going -q -b html docs "$OUT"
