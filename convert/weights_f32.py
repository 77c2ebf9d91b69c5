"""One GGUF tensor (or some of its rows) as float32, for computing with it in numpy a layer at a time.

The bytes are read with pread, not through the file's memory map: a mapped page that has been read counts in the
process's resident memory until the mapping goes, so a pass over every weight would hold the whole file there.
Rows are decoded by ggml's own decoders (the type traits' to_float of pykvq's library, on two threads),
gguf-py's numpy decoders where the library is not at hand (about 5x slower: Qwen2.5-Coder-1.5B's token_embd
4.7 s).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

from .gguf_io import GGUFModel, Tensor

THREADS = 2


def _file_offset(t: Tensor) -> int:
    """Where t's bytes start in its file: its address less that of the file's mapping (the root of its views)."""
    root = t.data
    while isinstance(root.base, np.ndarray):
        root = root.base
    return t.data.__array_interface__["data"][0] - root.__array_interface__["data"][0]


def raw_rows(m: GGUFModel, t: Tensor, rows: np.ndarray | slice | None = None) -> np.ndarray:
    """t's stored rows [n, row bytes or elements] (all of them, a slice of them, or those listed), read from the
    file."""
    shape2 = t.data.reshape(t.data.shape[0] if t.data.ndim > 1 else 1, -1).shape
    row_bytes = shape2[1] * t.data.dtype.itemsize
    base = _file_offset(t)
    if rows is None:
        rows = slice(0, shape2[0])
    fd = os.open(m.path, os.O_RDONLY)
    try:
        if isinstance(rows, slice):
            a, b, _ = rows.indices(shape2[0])
            buf = os.pread(fd, row_bytes * (b - a), base + a * row_bytes)
            out = np.frombuffer(buf, np.uint8).reshape(b - a, row_bytes)
        else:
            out = np.empty((len(rows), row_bytes), np.uint8)
            for i, r in enumerate(np.asarray(rows, np.int64)):
                out[i] = np.frombuffer(os.pread(fd, row_bytes, base + int(r) * row_bytes), np.uint8)
    finally:
        os.close(fd)
    return out.view(t.data.dtype) if t.data.dtype != np.uint8 else out


def _to_float(qtype: QT):
    """ggml's row decoder for qtype, or None."""
    try:
        from pykvq._lib import lib
        tr = lib().ggml_get_type_traits(int(qtype))
    except Exception:                    # no built library: gguf-py decodes
        return None
    from pykvq._lib import ffi
    return None if tr == ffi.NULL or tr.to_float == ffi.NULL else tr.to_float


def decode(raw: np.ndarray, qtype: QT, n_per_row: int) -> np.ndarray:
    """Stored rows [n, row bytes] of qtype -> float32 [n, n_per_row]."""
    if qtype == QT.F32:
        return np.ascontiguousarray(raw, np.float32).reshape(-1, n_per_row)
    if qtype == QT.F16:
        return raw.astype(np.float32).reshape(-1, n_per_row)
    fn = _to_float(qtype)
    if fn is None:
        return quants.dequantize(raw, qtype).astype(np.float32).reshape(-1, n_per_row)
    from pykvq._lib import ffi
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], n_per_row), np.float32)

    def part(a: int, b: int) -> None:
        if b > a:
            fn(ffi.from_buffer(raw[a:b]), ffi.cast("float *", ffi.from_buffer(out[a:b])), (b - a) * n_per_row)
    n = raw.shape[0]
    if n < 64 * THREADS:
        part(0, n)
    else:
        cut = [n * i // THREADS for i in range(THREADS + 1)]
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(lambda i: part(cut[i], cut[i + 1]), range(THREADS)))
    return out


def n_per_row(t: Tensor) -> int:
    """Elements per stored row."""
    if not t.quantized:
        return t.data.shape[-1]
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[t.qtype]
    return t.data.shape[-1] // size * block


def tensor_f32(m: GGUFModel, name: str, rows: np.ndarray | slice | None = None) -> np.ndarray:
    """m's tensor name as float32 [rows, n_per_row] (1-D tensors as [n]); rows: those rows only."""
    t = m.tensors[name]
    x = decode(raw_rows(m, t, rows), t.qtype, n_per_row(t))
    return x.reshape(-1) if t.data.ndim == 1 else x
