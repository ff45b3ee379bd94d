"""The GPU suite reuses the CPU suite's helpers (tests/helpers.py, tests/attention/test_dtypes_and_decode_path.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
