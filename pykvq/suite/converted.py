"""Converted GGUFs, made once per (model, variant) and cached under $PYKVQ_CACHE/converted.

The converter is the `convert` package installed with pykvq (its command line: pykvq-convert); it
runs as `python -m convert.to_gguf` in a process of its own, as the speed runs do, so torch and its
memory never enter the suite's process. Its own report is kept beside each file, so a cached
conversion still says how long it took, together with a fingerprint of the converter's sources and
flags: a file made by another version of the converter is made again, never reused.
"""
from __future__ import annotations

import hashlib
import importlib.util
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


def converter_fingerprint(src: Path, flags: list[str]) -> str | None:
    """SHA-256 (16 hex) of the converter's Python sources, the runtime calibration it runs (pykvq/calibrate.py
    and the native library's size), the flags and the input's name and size; None when the converter is not
    installed. (Found, not imported: pykvq never imports convert.)"""
    spec = importlib.util.find_spec("convert")
    if spec is None or not spec.submodule_search_locations:
        return None
    from .._lib import lib_path
    h = hashlib.sha256()
    for f in [*sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.py")),
              Path(__file__).resolve().parent.parent / "calibrate.py"]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    lib = lib_path()
    h.update(json.dumps([src.name, src.stat().st_size, flags, lib.stat().st_size if lib.exists() else 0]).encode())
    return h.hexdigest()[:16]


def _meta_ok(meta: Path, fingerprint: str) -> bool:
    try:
        return json.loads(meta.read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False


def converted(src: Path, variant: str | None, flags: list[str]) -> tuple[Path, dict]:
    """(path, {"seconds", "stdout", "fingerprint"}) of src converted with flags; variant None is src itself."""
    if variant is None:
        return src, {"seconds": 0.0, "stdout": ""}
    out = cache_dir() / "converted" / f"{src.stem}.{variant}.gguf"
    meta = out.with_suffix(".json")
    fingerprint = converter_fingerprint(src, flags)     # None: no converter, a cached file is all there is
    if not (out.exists() and meta.exists() and (fingerprint is None or _meta_ok(meta, fingerprint))):
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*CONVERTER, str(src), "-o", str(out), "--no-progress", *flags]
        print(f"[pykvq] converting {src.name} -> {out.name} ({' '.join(flags)})", file=sys.stderr, flush=True)
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            hint = ("\nthe converter is not installed: pip install 'pykvq[convert]' (in a checkout: pip install -e "
                    "'.[convert]')" if "No module named 'convert'" in res.stderr else "")
            raise PykvqError(f"conversion failed: {' '.join(cmd)}\n{res.stderr[-3000:]}{hint}")
        meta.write_text(json.dumps({"seconds": round(time.time() - t0, 1), "stdout": res.stdout,
                                    "fingerprint": fingerprint}))
    return out, json.loads(meta.read_text())
