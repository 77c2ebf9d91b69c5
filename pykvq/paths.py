"""Where pykvq keeps what it downloads and computes: the user's cache directory.

$PYKVQ_CACHE, else $XDG_CACHE_HOME/pykvq, else ~/.cache/pykvq. Below it: models/ (fetched GGUFs),
hf/ (HF checkpoints dequantized for calibration), calib/, converted/ (the suite's converted files),
eval/ (base logits), text/.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("PYKVQ_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pykvq"
