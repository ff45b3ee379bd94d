#!/usr/bin/env bash
# Lint (ruff check), formatting (ruff format --check) with the [tool.ruff] settings of
# pyproject.toml, then the library's text (scripts/lint_text.py: no issue numbers, commit ids or
# measured figures in kvhive/'s comments and docstrings). All run even when one fails, so one CI run
# reports everything; the script exits non-zero if any does. Pass paths to check only those
# (default: the repository; the text check reads the paths under kvhive/).
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
text_paths=()
for path in "${paths[@]}"; do
    case "$path" in
        . | ./) text_paths+=(kvhive) ;;
        kvhive | kvhive/* | ./kvhive | ./kvhive/*) text_paths+=("$path") ;;
    esac
done
if [[ ${#text_paths[@]} -gt 0 ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
    echo "== lint_text.py"
    "$PYTHON" scripts/lint_text.py "${text_paths[@]}" || status=1
fi
exit "$status"
