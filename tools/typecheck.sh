#!/usr/bin/env bash
# The typing score and the linter (no GPU, no build needed; installs nothing):
#   1. `pyright --verifytypes pyccl --ignoreexternal`: the share of pyccl's public names whose
#      types a user's checker knows (pyccl/_C.pyi stands for the extension).  Fails under
#      PYCCL_TYPE_SCORE (default 95) percent, listing the names that lack types.
#   2. `ruff check` over pyccl/, tests/, tools/ and examples/ with pyproject.toml's [tool.ruff].
# Needs basedpyright or pyright (pip install basedpyright, or pyright with node) and ruff.
# Environment: PYTHON (default python3), PYRIGHT (the checker's command; default PYTHON's
# basedpyright module where installed for it, else basedpyright or pyright on PATH), PYCCL_TYPE_SCORE.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
cd "$repo"
py="${PYTHON:-python3}"
min="${PYCCL_TYPE_SCORE:-95}"
# (PYTHON's own basedpyright first: `$PYTHON -m pip install basedpyright` need not put it on PATH)
if [ -n "${PYRIGHT:-}" ]; then
  checker="$PYRIGHT"
elif "$py" -m basedpyright --version >/dev/null 2>&1; then
  checker="$py -m basedpyright"
elif command -v basedpyright >/dev/null; then
  checker=basedpyright
elif command -v pyright >/dev/null; then
  checker=pyright
else
  echo "typecheck: neither basedpyright nor pyright is installed (pip install basedpyright)" >&2
  exit 2
fi
"$py" -m ruff --version >/dev/null 2>&1 || {
  echo "typecheck: ruff is not installed for $py (pip install ruff)" >&2; exit 2; }

# The checkout's pyccl, not an installed copy: the checker resolves `pyccl` through this path.
report="$(mktemp "${TMPDIR:-/tmp}/pyccl-verifytypes.XXXXXX")"
trap 'rm -f "$report"' EXIT
# (exit 1 means "some names lack types": the score below decides)
# ($checker unquoted: it may be a command with arguments, "$py -m basedpyright")
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $checker --verifytypes pyccl --ignoreexternal \
  --outputjson > "$report" || [ $? = 1 ]
status=0
"$py" - "$report" "$min" "$repo" "$checker" <<'EOF' || status=1
import json
import sys

path, minimum, repo, checker = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
with open(path) as f:
    result = json.load(f)["typeCompleteness"]
where = result["packageRootDirectory"]
if not where.startswith(repo):
    sys.exit(f"typecheck: {checker} read pyccl from {where}, not from {repo}")
counts = result["exportedSymbolCounts"]
score = 100 * result["completenessScore"]
total = counts["withKnownType"] + counts["withAmbiguousType"] + counts["withUnknownType"]
print(f"typecheck: {checker} --verifytypes pyccl: {score:.1f}% "
      f"({counts['withKnownType']} of {total} public names with known types; at least {minimum:g}% needed)")
if score < minimum:
    for s in result["symbols"]:
        if s["isExported"] and not s["isTypeKnown"]:
            first = next((d["message"].splitlines()[0] for d in s["diagnostics"]
                          if d["severity"] == "error"), "")
            print(f"  {s['name']}: {first}")
    sys.exit(f"typecheck: the typing score {score:.1f}% is under {minimum:g}%")
EOF

# (run even when the score failed: one run says everything that is wrong)
if "$py" -m ruff check pyccl tests tools examples; then
  echo "typecheck: ruff check pyccl tests tools examples: clean"
else
  status=1
fi
exit "$status"
