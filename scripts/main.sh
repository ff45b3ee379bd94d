#!/usr/bin/env bash
# The main job: a quick evaluation of a few methods at two budgets on the embedded Gemma-3-270M
# (converted once from its GGUF package and cached), then the results table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
out=${KVHIVE_OUT:-runs/quick}
.venv/bin/kvhive eval --suite quick --out "$out" "$@"
cat "$out/report.md"
