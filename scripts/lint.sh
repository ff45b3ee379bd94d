#!/usr/bin/env bash
# Lint (ruff check) and formatting (ruff format --check) with the [tool.ruff] settings of
# pyproject.toml. Both run even when the first fails, so one CI run reports everything; the
# script exits non-zero if either does. Pass paths to check only those (default: the repository).
set -uo pipefail
cd "$(dirname "$0")/.."
RUFF=(.venv/bin/ruff)
if [[ ! -x .venv/bin/ruff ]]; then
    RUFF=(.venv/bin/python -m ruff)
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
