"""Evaluation text available offline (never used for calibration).

The default is the WikiText-2 raw test split. Where it is absent, the King
James Bible from Debian's bible-kjv(-text) packages is fetched once with
apt-get download (no root needed) and printed by the package's own `bible`
tool: real English prose that the converter never calibrates on.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import FetchError, PykvqError

_REPO = Path(__file__).resolve().parent.parent
KJV_PACKAGES = ("bible-kjv", "bible-kjv-text")


def wikitext_test_path() -> Path:
    """WikiText-2 raw test split: $PYKVQ_WIKITEXT or ../shared/data/wikitext-2-raw/wiki.test.raw."""
    env = os.environ.get("PYKVQ_WIKITEXT")
    cands = [Path(env)] if env else []
    cands += [_REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"]
    for p in cands:
        if p.is_file():
            return p
    raise PykvqError("WikiText-2 test text not found (looked at "
                     + ", ".join(map(str, cands)) + "); set PYKVQ_WIKITEXT")


def wikitext_test() -> str:
    return wikitext_test_path().read_text(encoding="utf-8")


def kjv_text() -> str:
    """The King James Bible as plain text (chapter headings kept, verse numbers removed)."""
    from .models import cache_dir
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
