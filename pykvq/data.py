"""Evaluation text available offline (never used for calibration).

The default is the WikiText-2 raw test split, shipped compressed in pykvq/texts
(licence and checksum in its README). If that copy is missing, the King
James Bible from Debian's bible-kjv(-text) packages is fetched once with
apt-get download (no root needed) and printed by the package's own `bible`
tool: real English prose that the converter never calibrates on.
"""
from __future__ import annotations

import functools
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import FetchError, PykvqError

KJV_PACKAGES = ("bible-kjv", "bible-kjv-text")


WIKITEXT_XZ = Path(__file__).resolve().parent / "texts" / "wiki.test.raw.xz"
WIKITEXT_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"


@functools.lru_cache(maxsize=1)
def _wikitext_bytes() -> bytes:
    """The shipped WikiText-2 test split (pykvq/texts/README.md), checked against its SHA-256."""
    env = os.environ.get("PYKVQ_WIKITEXT")
    if env:
        p = Path(env)
        if not p.is_file():
            raise PykvqError(f"PYKVQ_WIKITEXT={env}: no such file")
        return p.read_bytes()
    try:
        raw = lzma.decompress(WIKITEXT_XZ.read_bytes())
    except (OSError, lzma.LZMAError) as e:
        raise PykvqError(f"{WIKITEXT_XZ}: cannot read the shipped WikiText-2 text ({e}); reinstall pykvq") from e
    if hashlib.sha256(raw).hexdigest() != WIKITEXT_SHA256:
        raise PykvqError(f"{WIKITEXT_XZ}: checksum mismatch (the file is damaged); reinstall pykvq")
    return raw


def wikitext_test() -> str:
    """WikiText-2 raw test split: $PYKVQ_WIKITEXT if set, else the copy shipped in pykvq/texts."""
    return _wikitext_bytes().decode("utf-8")


def wikitext_test_path() -> Path:
    """The same text as a plain file (for llama.cpp tools' -f): $PYKVQ_WIKITEXT, else a checked copy
    in the user's cache directory."""
    env = os.environ.get("PYKVQ_WIKITEXT")
    if env:
        _wikitext_bytes()
        return Path(env)
    from .paths import cache_dir
    out = cache_dir() / "text" / "wiki.test.raw"
    if not (out.is_file() and hashlib.sha256(out.read_bytes()).hexdigest() == WIKITEXT_SHA256):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(_wikitext_bytes())
        tmp.replace(out)
    return out


def kjv_text() -> str:
    """The King James Bible as plain text (chapter headings kept, verse numbers removed)."""
    from .paths import cache_dir
    out = cache_dir() / "text" / "kjv.txt"
    if out.is_file():
        return out.read_text(encoding="utf-8")
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise FetchError("no evaluation text: WikiText-2 is absent and apt-get/dpkg-deb (for Debian's "
                         "bible-kjv-text) are not available; pass a text file")
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(["apt-get", "download", *KJV_PACKAGES], cwd=tmp, capture_output=True, text=True)
        debs = sorted(Path(tmp).glob("*.deb"))
        if res.returncode != 0 or len(debs) != len(KJV_PACKAGES):
            raise FetchError(f"apt-get download {' '.join(KJV_PACKAGES)} failed: {res.stderr.strip()[-400:]}")
        root = Path(tmp) / "root"
        for d in debs:
            subprocess.run(["dpkg-deb", "-x", str(d), str(root)], check=True)
        res = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "gen1:1-rev22:21"],
                             capture_output=True, text=True)
        if res.returncode != 0 or len(res.stdout) < 1_000_000:
            raise FetchError(f"the bible tool did not print the text: {res.stderr.strip()[-400:]}")
    text = "\n".join(re.sub(r"^\s+\d+ ", "", line) for line in res.stdout.splitlines())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(text, encoding="utf-8")
    tmp_out.replace(out)
    return text


def eval_text(path: str | os.PathLike | None = None) -> tuple[str, str]:
    """(text, name) to evaluate on: a given file, else WikiText-2 test, else the KJV fallback."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise PykvqError(f"text file {p} not found")
        return p.read_text(encoding="utf-8", errors="replace"), p.name
    try:
        return wikitext_test(), "WikiText-2 raw test"
    except PykvqError:
        return kjv_text(), "King James Bible (Debian bible-kjv-text)"
