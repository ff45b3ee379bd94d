#!/usr/bin/env bash
# Cross-check kvhive's snapkv/streamingllm/tova/knorm/pyramidkv against NVIDIA kvpress.
#
#   bash crosscheck/run.sh            # CPU only, ~1 minute once the kvpress venv exists
#
# 1. creates .venv-kvpress (torch 2.13.0 CPU first, then kvpress and the transformers < 5.3 it
#    pins) unless it already imports kvpress;
# 2. make_model.py   (kvhive venv)  : tiny random GQA Llama + 509-token prompt -> crosscheck/artifacts/
# 3. kvpress_side.py (kvpress venv) : kept positions per layer/KV head -> artifacts/kvpress.json
# 4. kvhive_side.py  (kvhive venv)  : same for kvhive (native, matched, ablations) -> artifacts/kvhive.json
# 5. compare.py                     : agreement table + explanations -> crosscheck/RESULTS.md
#
# Environment: KVHIVE_PYTHON (default .venv/bin/python), KVPRESS_VENV (default .venv-kvpress),
# CROSSCHECK_ARTIFACTS (default crosscheck/artifacts), CROSSCHECK_LENGTH (default 509).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
KVHIVE_PYTHON="${KVHIVE_PYTHON:-$ROOT/.venv/bin/python}"
export KVPRESS_VENV="${KVPRESS_VENV:-$ROOT/.venv-kvpress}"
ARTIFACTS="${CROSSCHECK_ARTIFACTS:-$HERE/artifacts}"
LENGTH="${CROSSCHECK_LENGTH:-509}"
# Quiet the "Loading weights" progress bars of transformers.
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1

# pip on this machine warns once per package about an absent local index folder; drop those lines.
bash "$HERE/setup_kvpress_venv.sh" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$KVPRESS_VENV/bin/python" -c "import kvpress" || { echo "kvpress venv is not usable" >&2; exit 1; }

"$KVHIVE_PYTHON" "$HERE/make_model.py" --out "$ARTIFACTS" --length "$LENGTH"
"$KVPRESS_VENV/bin/python" "$HERE/kvpress_side.py" --artifacts "$ARTIFACTS"
"$KVHIVE_PYTHON" "$HERE/kvhive_side.py" --artifacts "$ARTIFACTS"
"$KVHIVE_PYTHON" "$HERE/compare.py" --artifacts "$ARTIFACTS" --results "$HERE/RESULTS.md"
