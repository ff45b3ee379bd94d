"""Keep history and measurements out of the library's text.

kvhive's comments and docstrings say what the code does and why, in the present tense. What
happened on the way (an issue number, a commit, a timing taken on some machine) belongs in docs/
and results/, where it can be dated and re-measured; in the code it goes stale unseen. This check
reads the comments and docstrings of every Python file under the given paths (default: kvhive/)
and reports, as ``path:line: rule: text``:

- ``issue-ref``: a reference to an issue or pull request (``issue 25``, ``issues 3 and 4``,
  ``#123``, ``PR 7``);
- ``commit-id``: a run of 7 to 40 hexadecimal digits holding both a digit and a letter (a commit
  id; plain numbers and words such as ``facade`` are not);
- ``measured-figure``: a time, size or speed figure (``1.3 ms``, ``484 MB``, ``2 GiB``,
  ``0.2 s``, ``1.5x faster``).

Only comments and docstrings are read (found with :mod:`tokenize` and :mod:`ast`), never code or
other strings, so hex constants, test data and error messages do not trip it. A line that states a
specification rather than a measurement (a bound the code enforces, a size a constant defines)
carries the marker ``lint-text: ok`` (in its comment, or in the docstring line) and is skipped.

Exit status: 0 when clean, 1 when something was found, 2 on a usage error. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

MARKER = "lint-text: ok"

RULES: dict[str, re.Pattern[str]] = {
    "issue-ref": re.compile(
        r"\b(?:issues?|pull requests?|PRs?)\s*#?\d+(?:\s*(?:,|and|&)\s*#?\d+)*\b|(?<![\w&#/])#\d+\b",
        re.IGNORECASE,
    ),
    "commit-id": re.compile(r"(?<![\w.])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w|\.\w)"),
    "measured-figure": re.compile(
        r"(?<![\w.])\d+(?:[.,]\d+)*\s?(?:[mµun]s|ns|[KMGT]i?B|kB)(?!\w)"
        r"|(?<![\w.])\d+(?:\.\d+)?\s(?:s|sec|seconds?|min|minutes?)(?!\w|\.\w)"
        r"|(?<![\w.])\d+(?:\.\d+)?\s?[x×]\s+(?:faster|slower|speed-?up)\b",
    ),
}


def text_lines(source: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every comment and every docstring line of ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        documented = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        if documented and isinstance(body[0].value.value, str):
            first = body[0].lineno
            for offset, line in enumerate(source.splitlines()[first - 1 : body[0].end_lineno]):
                yield first + offset, line
        # Attribute docstrings (a string right after an assignment in a class or module body).
        for before, after in zip(body, body[1:], strict=False):
            if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr):
                value = after.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    for offset, line in enumerate(source.splitlines()[after.lineno - 1 : after.end_lineno]):
                        yield after.lineno + offset, line


def findings(path: Path) -> list[tuple[int, str, str]]:
    """``(line, rule, first matched text)`` of every finding in one file (one per line and rule), in
    line order."""
    source = path.read_text(encoding="utf-8")
    physical = source.splitlines()
    found: dict[tuple[int, str], str] = {}
    for number, text in text_lines(source):
        if MARKER in physical[number - 1]:
            continue
        for rule, pattern in RULES.items():
            match = pattern.search(text)
            if match:
                found.setdefault((number, rule), match.group(0))
    return [(number, rule, text) for (number, rule), text in sorted(found.items())]


def python_files(paths: list[str]) -> Iterator[Path]:
    for name in paths:
        path = Path(name)
        if path.is_dir():
            yield from sorted(path.rglob("*.py"))
        elif path.suffix == ".py":
            yield path
        elif not path.exists():
            raise FileNotFoundError(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["kvhive"], help="files or folders (default: kvhive)")
    parser.add_argument("--count", action="store_true", help="print the number of findings per file instead")
    arguments = parser.parse_args(argv)
    try:
        files = list(python_files(arguments.paths))
    except FileNotFoundError as missing:
        print(f"lint_text.py: no such file or folder: {missing}", file=sys.stderr)
        return 2
    total = 0
    for path in files:
        found = findings(path)
        total += len(found)
        if arguments.count and found:
            print(f"{path}: {len(found)}")
        elif not arguments.count:
            for line, rule, text in found:
                print(f"{path}:{line}: {rule}: {text}")
    if total:
        print(
            f"lint_text.py: {total} finding(s); move history and measurements to docs/ or results/, "
            f"or mark a specification with '# {MARKER}'",
            file=sys.stderr,
        )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
