#!/usr/bin/env bash
# Cross-check kvhive's snapkv/streamingllm/tova/knorm/ada-snapkv/pyramidkv against NVIDIA kvpress.
#
#   bash crosscheck/run.sh            # CPU only, a few minutes once the kvpress venv exists
#
# Fails (non-zero exit, crosscheck/RESULTS.md left as it was) when kvpress cannot be imported, when
# any case fails on either side, or when any case cannot be compared.
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

fail() {
    echo "crosscheck: $*" >&2
    echo "crosscheck: FAILED; $HERE/RESULTS.md was not changed" >&2
    exit 1
}

# pip on this machine warns once per package about an absent local index folder; drop those lines.
# (The venv's own check below says whether it worked.)
bash "$HERE/setup_kvpress_venv.sh" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$KVPRESS_VENV/bin/python" -c "import kvpress" 2>/dev/null || fail "kvpress is not importable from $KVPRESS_VENV. \
It needs its own venv (it pins transformers < 5.3; kvhive needs 5.x), made by crosscheck/setup_kvpress_venv.sh \
from PyPI (CPU torch 2.13.0, then kvpress). Make it by hand, or point KVPRESS_VENV at a venv that imports kvpress."
[ -x "$KVHIVE_PYTHON" ] || fail "no kvhive Python at $KVHIVE_PYTHON (set KVHIVE_PYTHON)"

# kvhive from this checkout (whatever the venv has installed).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$ARTIFACTS"
rm -f "$ARTIFACTS/kvpress.json" "$ARTIFACTS/kvhive.json"  # no stale side is ever compared
"$KVHIVE_PYTHON" "$HERE/make_model.py" --out "$ARTIFACTS" --length "$LENGTH" || fail "make_model.py failed"
"$KVPRESS_VENV/bin/python" "$HERE/kvpress_side.py" --artifacts "$ARTIFACTS" || fail "the kvpress side failed"
"$KVHIVE_PYTHON" "$HERE/kvhive_side.py" --artifacts "$ARTIFACTS" || fail "the kvhive side failed (a case is unavailable)"
"$KVHIVE_PYTHON" "$HERE/compare.py" --artifacts "$ARTIFACTS" --results "$HERE/RESULTS.md" || fail "compare.py failed"
