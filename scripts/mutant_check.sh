#!/usr/bin/env bash
# Run tests against one mutmut mutant without disturbing a mutmut run in progress (issue 10):
# copies mutmut's trampolined source (mutants/kvhive, every mutant selectable by name) into a
# private directory once, then runs the given pytest arguments there with MUTANT_UNDER_TEST set.
# A test that kills the mutant fails here and passes with MUTANT_UNDER_TEST unset.
#   bash scripts/mutant_check.sh NAME tests/methods/test_subgen.py::test_x [more pytest args]
#   NAME "" runs the unmutated code (the clean check).
# KVHIVE_MUTCHECK_DIR picks the private directory (one per concurrent user); REFRESH=1 recopies.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NAME="$1"; shift
DIR="${KVHIVE_MUTCHECK_DIR:-/tmp/kvhive-mutcheck}"
if [ ! -d "$DIR/kvhive" ] || [ "${REFRESH:-0}" = 1 ]; then
    rm -rf "$DIR"; mkdir -p "$DIR"
    cp -r "$ROOT/mutants/kvhive" "$DIR/kvhive"
fi
rm -rf "$DIR/tests"; cp -r "$ROOT/tests" "$DIR/tests"
cd "$DIR"
MUTANT_UNDER_TEST="$NAME" OMP_NUM_THREADS=1 PYTHONPATH="$DIR" timeout "${TIMEOUT:-300}" \
    "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -q -x "$@"
