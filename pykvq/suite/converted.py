"""Converted GGUFs, made once per (model, variant) and cached under $PYKVQ_CACHE/converted.

The converter is the `convert` package installed with pykvq (its command line: pykvq-convert); it
runs as `python -m convert.to_gguf` in a process of its own, as the speed runs do, so torch and its
memory never enter the suite's process. Its own report is kept beside each file, so a cached
conversion still says how long it took.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import PykvqError
from ..paths import cache_dir

CONVERTER = [sys.executable, "-m", "convert.to_gguf"]


def for_setting(src: Path, setting) -> tuple[Path, dict]:
    """The file a suite Setting runs on: src itself, or src converted with the setting's flags."""
    variant = setting.variant()
    return converted(src, variant, setting.converter_flags() if variant else [])


def converted(src: Path, variant: str | None, flags: list[str]) -> tuple[Path, dict]:
    """(path, {"seconds", "stdout"}) of src converted with flags; variant None is src itself."""
    if variant is None:
        return src, {"seconds": 0.0, "stdout": ""}
    out = cache_dir() / "converted" / f"{src.stem}.{variant}.gguf"
    meta = out.with_suffix(".json")
    if not (out.exists() and meta.exists()):
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*CONVERTER, str(src), "-o", str(out), "--no-progress", *flags]
        print(f"[pykvq] converting {src.name} -> {out.name} ({' '.join(flags)})", file=sys.stderr, flush=True)
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            hint = ("\nthe converter is not installed: pip install 'pykvq[convert]' (in a checkout: pip install -e "
                    "'.[convert]')" if "No module named 'convert'" in res.stderr else "")
            raise PykvqError(f"conversion failed: {' '.join(cmd)}\n{res.stderr[-3000:]}{hint}")
        meta.write_text(json.dumps({"seconds": round(time.time() - t0, 1), "stdout": res.stdout}))
    return out, json.loads(meta.read_text())
