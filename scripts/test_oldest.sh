#!/usr/bin/env bash
# The oldest end of what pyproject.toml allows: create .venv-oldest with the transformers and torch
# floors of pyproject's dependencies pinned exactly, and run the tests of the API, generate, the
# cache and every method's prefill + decode on it (about 2 minutes on 2 cores). scripts/test.sh runs
# it beside the full suite, which runs on the newest releases .venv installs. Pass pytest arguments
# to run something else on the oldest releases.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
floor() {  # the version after "NAME>=" in pyproject's dependencies
    local version
    version=$(grep -oE "\"$1>=[0-9][0-9.]*" pyproject.toml | head -1 | cut -d= -f2)
    [ -n "$version" ] || { echo "test_oldest.sh: no \"$1>=...\" floor in pyproject.toml" >&2; exit 2; }
    echo "$version"
}
transformers_floor=$(floor transformers)
torch_floor=$(floor torch)
venv=.venv-oldest
stamp=$venv/.kvhive-installed
want=$( (cat pyproject.toml scripts/test_oldest.sh) | sha256sum | cut -d' ' -f1)
if ! { [ -x $venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
    echo "Setting up $venv (torch $torch_floor, transformers $transformers_floor)..." >&2
    rm -rf $venv
    "$PYTHON" -m venv $venv
    $venv/bin/python -m pip install -q --upgrade pip
    # torch first and alone: this pinned release lies on the machine's disk as a CPU build; any
    # other resolution would pull a CUDA build of several GB.
    $venv/bin/python -m pip install -q "torch==$torch_floor"
    $venv/bin/python -m pip install -q "torch==$torch_floor" "transformers==$transformers_floor" \
        "pytest>=8" pytest-xdist "hypothesis>=6" -e .
    echo "$want" > "$stamp"
fi
$venv/bin/python - "$torch_floor" "$transformers_floor" <<'EOF'
# Refuse to report a pass on anything but the pinned floors (a resolver that upgraded one would
# make this job test the newest releases twice).
import sys

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

for name, installed, floor in (("torch", torch.__version__, sys.argv[1]), ("transformers", transformers.__version__, sys.argv[2])):
    if not SpecifierSet(f"=={floor}").contains(Version(installed).public):
        sys.exit(f"test_oldest.sh: .venv-oldest has {name} {installed}, not the floor {floor}")
print(f"oldest allowed releases: torch {torch.__version__}, transformers {transformers.__version__}")
EOF
if [ "$#" -eq 0 ]; then
    set -- tests/attention/test_transformers_compat.py tests/cache/test_cache.py tests/api/test_generate_output.py \
        tests/api/test_shared_prefill.py tests/methods/test_all_methods.py tests/attention/test_dtypes_and_decode_path.py
fi
exec $venv/bin/python -m pytest -q -n 2 -p no:cacheprovider "$@"
