"""scripts/lint_text.py: every rule fires on comments and docstrings, and clean text, code and
other strings pass."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lint_text.py"


def _load():
    spec = importlib.util.spec_from_file_location("lint_text", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lint_text = _load()


def rules_in(tmp_path: Path, source: str) -> list[tuple[int, str]]:
    path = tmp_path / "sample.py"
    path.write_text(source, encoding="utf-8")
    return [(line, rule) for line, rule, _ in lint_text.findings(path)]


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("as issue 25 asked", "issue-ref"),
        ("see issues 3 and 4", "issue-ref"),
        ("fixed in #123", "issue-ref"),
        ("PR 7 added it", "issue-ref"),
        ("as the run of 71b99e7 found", "commit-id"),
        ("at 4aebeca0d1f2e3c4b5a69788", "commit-id"),
        ("took 1.7 ms a step", "measured-figure"),
        ("a 484 MB matrix", "measured-figure"),
        ("holds 2 GiB", "measured-figure"),
        ("64 KiB apart", "measured-figure"),
        ("~65 µs against ~10 µs", "measured-figure"),
        ("0.2 s of page faults", "measured-figure"),
        ("about 1.5x faster", "measured-figure"),
    ],
)
def test_each_rule_fires_in_a_comment_and_in_a_docstring(tmp_path, text, rule):
    comment = f"x = 1  # {text}\n"
    assert rules_in(tmp_path, comment) == [(1, rule)]
    docstring = f'def f():\n    """Say it.\n\n    {text}.\n    """\n'
    assert rules_in(tmp_path, docstring) == [(4, rule)]
    attribute = f'class A:\n    flag = True\n    """{text}."""\n'
    assert rules_in(tmp_path, attribute) == [(3, rule)]


def test_clean_text_code_and_other_strings_pass(tmp_path):
    source = '''"""Keeps the top scores of each row; float16 logits overflow past 65504 (s.e. 0.03 s.e.).

The facade computes 2 ** 22 elements per chunk and 128 rows; Eq. 10 and Table 2 hold.
"""

MASK = 0xDEADBEEF1234567  # a hex constant in code is not a commit
CHUNK = 1 << 22  # elements of one chunk, 4 bytes each
MESSAGE = "issue 25 took 1.7 ms at 71b99e7"  # (a string in code is not read)


def f(x):
    """``x`` in [0, 1]: the 8th step moves no element by more than 1e-14 relative."""
    return x  # 32 heads x 1024 tokens, float32
'''
    assert rules_in(tmp_path, source) == []


def test_the_marker_allows_a_specification(tmp_path):
    source = "LIMIT = 1 << 31  # a 2 GiB bound  # lint-text: ok\nOTHER = 1  # 2 GiB\n"
    assert rules_in(tmp_path, source) == [(2, "measured-figure")]


def test_the_command_reports_file_line_and_rule_and_fails(tmp_path):
    (tmp_path / "clean.py").write_text('"""Clean."""\n', encoding="utf-8")
    dirty = tmp_path / "dirty.py"
    dirty.write_text("x = 1\ny = 2  # as issue 12 says\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stdout.strip() == f"{dirty}:2: issue-ref: issue 12"
    clean = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "clean.py")], capture_output=True, text=True)
    assert clean.returncode == 0 and clean.stdout == ""
