#!/usr/bin/env bash
# Lint (ruff check) and formatting (ruff format --check) with the [tool.ruff] settings of
# pyproject.toml. Both run even when the first fails, so one CI run reports everything; the
# script exits non-zero if either does. Pass paths to check only those (default: the repository).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/ruff ]]; then
    RUFF=(.venv/bin/ruff)
elif .venv/bin/python -c "import ruff" 2>/dev/null; then
    RUFF=(.venv/bin/python -m ruff)
else
    echo "lint.sh: ruff is not installed in .venv (it belongs in the [test] extras of pyproject.toml)" >&2
    exit 2
fi
paths=("$@")
if [[ ${#paths[@]} -eq 0 ]]; then
    paths=(.)
fi
status=0
echo "== ruff check"
"${RUFF[@]}" check "${paths[@]}" || status=1
echo "== ruff format --check"
"${RUFF[@]}" format --check "${paths[@]}" || status=1
exit "$status"
