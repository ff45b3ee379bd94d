#!/usr/bin/env bash
# Create the separate virtualenv for kvpress (it pins transformers < 5.3, kvhive needs 5.x).
# torch is installed FIRST and pinned to the CPU build, so that resolving kvpress does not pull
# a CUDA torch (GBs). Idempotent: does nothing when the venv already imports kvpress.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVPRESS_VENV:-$ROOT/.venv-kvpress}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${KVPRESS_TORCH:-torch==2.13.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import kvpress" >/dev/null 2>&1; then
    echo "kvpress venv ready: $VENV"
    exit 0
fi
if [ -e "$VENV" ]; then
    # Never install kvpress (and the transformers < 5.3 it pins) into a folder that is something else:
    # KVPRESS_VENV pointing at kvhive's own .venv would downgrade its transformers.
    echo "$VENV exists but does not import kvpress: remove it (an interrupted setup) or set KVPRESS_VENV to a new folder" >&2
    exit 1
fi
echo "creating kvpress venv at $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "$TORCH_SPEC"
# The constraint keeps pip from replacing the CPU torch while resolving kvpress.
TORCH_VERSION="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
"$VENV/bin/pip" install --quiet kvpress "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress venv:', 'torch', torch.__version__, 'transformers', transformers.__version__)"
