"""The source tree's shape (issue 60): one name per file in native/, so a file is found by its name alone."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "native"


def test_no_two_native_files_share_a_name():
    names = Counter(p.name for p in NATIVE.rglob("*") if p.is_file())
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
