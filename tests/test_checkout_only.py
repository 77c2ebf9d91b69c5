"""A fresh clone has nothing beside it: the code reads no file outside the checkout.

conftest.py also records, at run time, every file the test process opens next to the checkout
and fails the session if there is one.
"""
from __future__ import annotations

import hashlib
import re
import subprocess

from conftest import REPO

# a path that climbs out of the checkout: a string starting "../" or holding "/../", three .parent steps up,
# or the parent of the checkout's own root variable
OUTSIDE = re.compile(r"[\"']\.\./|/\.\./|\.parent\.parent\.parent|\b_?(REPO|ROOT|REPO_ROOT)\w*\.parent\b")
CODE = (".py", ".toml", ".sh", ".md", ".c", ".cpp", ".h", ".cu", ".cuh", ".cmake", ".txt")
# conftest.py's audit hook names the checkout's parent to watch it, which is the point
GUARDS = ("tests/conftest.py",)


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in out.splitlines():
        p = REPO / name
        if name.startswith("third_party/") or name in GUARDS:
            continue
        if (p.suffix in CODE or p.name in ("Makefile", "run")) and p.is_file():
            yield name, p


def test_no_code_reads_beside_the_checkout():
    hits = [f"{name}:{i}: {line.strip()}"
            for name, p in _tracked()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if OUTSIDE.search(line) and name != "tests/test_checkout_only.py"
            and not line.lstrip().startswith("#include")]   # an include is resolved inside the checkout
    assert not hits, "paths outside the checkout:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for line in ['text = open("../data/wiki.test.raw").read()', 'p = _REPO.parent / "data"',
                 'root = Path(__file__).resolve().parent.parent.parent', 'f = "/work/main/../x"']:
        assert OUTSIDE.search(line), line
    for line in ['p = REPO / "build" / "bin"', 'here = Path(__file__).resolve().parent', 'x = a.parent']:
        assert not OUTSIDE.search(line), line


def test_shipped_wikitext_is_the_test_split(monkeypatch):
    from pykvq import data
    monkeypatch.delenv("PYKVQ_WIKITEXT", raising=False)
    data._wikitext_bytes.cache_clear()
    text = data.wikitext_test()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == data.WIKITEXT_SHA256
    assert len(text.encode("utf-8")) == 1290547
    assert text.startswith(" = Robert Boulter = \r\n")
    path = data.wikitext_test_path()
    assert path.read_bytes() == text.encode("utf-8")
    assert data.eval_text()[1] == "WikiText-2 raw test"


def test_damaged_wikitext_is_an_error(monkeypatch, tmp_path):
    import lzma

    import pytest

    from pykvq import data
    from pykvq.errors import PykvqError
    bad = tmp_path / "wiki.test.raw.xz"
    bad.write_bytes(lzma.compress(b"not the test split"))
    monkeypatch.delenv("PYKVQ_WIKITEXT", raising=False)
    monkeypatch.setattr(data, "WIKITEXT_XZ", bad)
    data._wikitext_bytes.cache_clear()
    try:
        with pytest.raises(PykvqError, match="checksum mismatch"):
            data.wikitext_test()
    finally:
        data._wikitext_bytes.cache_clear()
