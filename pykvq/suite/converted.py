"""Converted GGUFs, made once per (model, variant) and cached under $PYKVQ_CACHE/converted.

The converter's own report is kept beside each file, so a cached conversion
still says how long it took.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import PykvqError
from ..paths import cache_dir

CONVERTER = Path(__file__).resolve().parents[2] / "convert" / "to_gguf.py"


def converted(src: Path, variant: str | None, flags: list[str]) -> tuple[Path, dict]:
    """(path, {"seconds", "stdout"}) of src converted with flags; variant None is src itself."""
    if variant is None:
        return src, {"seconds": 0.0, "stdout": ""}
    out = cache_dir() / "converted" / f"{src.stem}.{variant}.gguf"
    meta = out.with_suffix(".json")
    if not (out.exists() and meta.exists()):
        if not CONVERTER.is_file():
            raise PykvqError(f"the converter ({CONVERTER}) is not there: converted settings need a checkout")
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(CONVERTER), str(src), "-o", str(out), "--no-progress", *flags]
        print(f"[pykvq] converting {src.name} -> {out.name} ({' '.join(flags)})", file=sys.stderr, flush=True)
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise PykvqError(f"conversion failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
        meta.write_text(json.dumps({"seconds": round(time.time() - t0, 1), "stdout": res.stdout}))
    return out, json.loads(meta.read_text())
