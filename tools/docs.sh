#!/usr/bin/env bash
# Build the documentation site (Sphinx, warnings are errors) into $1 (default: build/docs).
# Installs docs/requirements.txt where Sphinx or MyST is missing.  pyccl must be importable:
# built in place in this checkout (tools/setup.sh, or python3 setup.py build_ext --inplace),
# which is documented first, or installed (pip install ., a wheel), which docs/conf.py imports
# where the checkout has no built extension.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-build/docs}
if ! $PY -c "import sphinx, myst_parser" 2>/dev/null; then
  $PY -m pip install -q -r docs/requirements.txt
fi
exec $PY -m sphinx -W --keep-going -q -b html docs "$OUT"
