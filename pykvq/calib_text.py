"""The calibration corpus: the four Canterbury English texts (alice29, asyoulik, lcet10, plrabn12) from the brotli
1.2.1 sdist on PyPI, fetched once into the user's cache and checked against their sha256. Never the evaluation text
(pykvq.data). Used by `pykvq calibrate` and the converter (convert/calib.py)."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .errors import FetchError
from .paths import cache_dir

CANTERBURY = ("alice29.txt", "asyoulik.txt", "lcet10.txt", "plrabn12.txt")
BROTLI_SDIST = "brotli==1.2.1"
# sha256 of each text as brotli 1.2.1's sdist ships it: a changed or damaged download is refused, not calibrated on
CANTERBURY_SHA256 = {
    "alice29.txt": "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
    "asyoulik.txt": "eaa3526fe53859f34ecdf255712f9ecf0b2c903451d4755b2edaa2e2599cb0fc",
    "lcet10.txt": "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f",
    "plrabn12.txt": "07e2e0b461af78c7c647cb53dab39de560198e16f799b4516eccf0fbd69f764c",
}


def _canterbury_ok(d: Path) -> bool:
    return all((d / n).is_file() and hashlib.sha256((d / n).read_bytes()).hexdigest() == CANTERBURY_SHA256[n]
               for n in CANTERBURY)


def canterbury_text() -> str:
    """The four Canterbury English texts, concatenated (downloaded once)."""
    d = cache_dir() / "calib" / "canterbury"
    if not _canterbury_ok(d):
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--quiet", "-d", tmp, BROTLI_SDIST]
            res = subprocess.run(cmd, capture_output=True, text=True)
            sdists = list(Path(tmp).glob("*.tar.gz"))
            if res.returncode != 0 or not sdists:
                raise FetchError(f"could not fetch the calibration corpus ({BROTLI_SDIST} sdist): "
                                   f"{res.stderr.strip()[-500:]}; pass --calib FILE with your own text")
            with tarfile.open(sdists[0]) as tar:
                for m in tar.getmembers():
                    if m.name.split("/")[-1] in CANTERBURY and "/tests/testdata/" in m.name:
                        (d / m.name.split("/")[-1]).write_bytes(tar.extractfile(m).read())
        if not _canterbury_ok(d):
            bad = [n for n in CANTERBURY if not (d / n).is_file() or
                   hashlib.sha256((d / n).read_bytes()).hexdigest() != CANTERBURY_SHA256[n]]
            for n in bad:
                (d / n).unlink(missing_ok=True)
            raise FetchError(f"the calibration corpus from {BROTLI_SDIST} does not match its checksums "
                               f"({', '.join(bad)}); pass --calib FILE with your own text")
    return "\n\n".join((d / n).read_text(encoding="latin-1") for n in CANTERBURY)
