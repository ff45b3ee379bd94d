"""docs/ADDING_A_METHOD.md follows the code: its vnorm listing is the module, and it names every
capability flag a method may declare."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from kvhive.methods import base

DOC = Path(__file__).resolve().parents[2] / "docs" / "ADDING_A_METHOD.md"


def _listing(text: str) -> tuple[int, str]:
    match = re.search(
        r"`kvhive/methods/vnorm.py` \((\d+) lines, the whole module\):\n\n```python\n(.*?)```", text, re.S
    )
    assert match, "the vnorm listing is missing from docs/ADDING_A_METHOD.md"
    return int(match.group(1)), match.group(2)


def test_vnorm_listing_is_the_module():
    import kvhive.methods.vnorm as module

    stated, listing = _listing(DOC.read_text())
    source = Path(module.__file__).read_text()
    assert listing == source
    assert stated == len(source.splitlines())


def test_every_capability_flag_is_named():
    hints = typing.get_type_hints(base.Policy, include_extras=False)
    flags = {
        name
        for name, hint in hints.items()
        if typing.get_origin(hint) is typing.ClassVar and typing.get_args(hint) == (bool,)
    }
    flags.add("head_granularity")
    assert len(flags) >= 11
    text = DOC.read_text()
    missing = sorted(flag for flag in flags if f"`{flag}`" not in text)
    assert not missing, f"docs/ADDING_A_METHOD.md does not name {missing}"
