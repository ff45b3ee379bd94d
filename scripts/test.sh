#!/usr/bin/env bash
# Set up the environment if needed and run the test suite (pytest exits non-zero, 5, when no
# test is collected, so an empty run fails too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Convert the embedded model once before the workers start (about a minute the first time).
.venv/bin/python -c "from kvhive.models import load_model; load_model()" > /dev/null
# Lint and formatting first (seconds): a style error fails CI like a test.
bash scripts/lint.sh
if [ "$#" -gt 0 ]; then  # a chosen subset: on the newest releases only
    exec .venv/bin/python -m pytest -q -n 2 "$@"
fi
# The oldest transformers and torch pyproject allows, on the API/generate/cache tests (a few
# minutes, set-up included), then the whole suite on the newest; both run, either failing fails.
status=0
bash scripts/test_oldest.sh || status=$?
.venv/bin/python -m pytest -q -n 2 || status=$?
exit "$status"
