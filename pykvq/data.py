"""Evaluation text available offline (never used for calibration)."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import PykvqError

_REPO = Path(__file__).resolve().parent.parent


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
