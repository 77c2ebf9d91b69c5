"""Exact row operations on stored weights, whatever their storage type.

A GGUF weight row is one output channel, and ggml's blocks run along a row, so
moving whole rows is exact on any type. Scaling a row by a power of two is
exact as well: on float rows it changes only exponents, on block-quantized
rows it multiplies each block's f16 scale fields (d, and the min/dmin where the
type has one) by the same power of two. Mixing rows (a rotation) is not exact
on quantized rows: those tensors are dequantized, transformed in f32 and
stored again (requantized) in the output type the user chose.
"""
from __future__ import annotations

import numpy as np

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants

from .gguf_io import ConvertError, Tensor

# byte offsets of the f16 fields that scale a whole block (ggml-common.h block layouts)
SCALE_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def permute_rows(t: Tensor, perm: np.ndarray) -> Tensor:
    """Row i of the result is row perm[i] of t (1-D tensors: element perm[i])."""
    return Tensor(t.name, t.qtype, np.ascontiguousarray(np.asarray(t.data)[perm]))


def _scale_f16(h: np.ndarray, factor: np.ndarray, stats: dict | None) -> np.ndarray:
    """h (uint16 view of f16) times powers of two. Exact unless a value is (or becomes) an f16
    subnormal: those lose low bits, are counted in stats["inexact"] and stay within one f16 ulp
    of the subnormal range (< 6e-8 absolute). Overflow is an error."""
    v = h.view(np.float16).astype(np.float32)
    want = v * factor
    out = want.astype(np.float16)
    if not np.all(np.isfinite(out) | ~np.isfinite(v)):
        raise ConvertError("a power-of-two row scale overflows an f16 block scale")
    if stats is not None:
        stats["inexact"] = stats.get("inexact", 0) + int(np.count_nonzero(out.astype(np.float32) != want))
        stats["fields"] = stats.get("fields", 0) + int(out.size)
    return out.view(np.uint16)


def scale_rows(t: Tensor, factors: np.ndarray, stats: dict | None = None) -> Tensor:
    """Multiply row i by factors[i] (each a power of two): exact but for f16 subnormals (counted
    in stats, see _scale_f16)."""
    f = np.asarray(factors, dtype=np.float32)
    m, e = np.frexp(f)
    if not np.all(m == 0.5):
        raise ConvertError("row scales must be powers of two to stay exact")
    data = np.array(t.data)                       # a writable copy of the mapped rows
    if data.ndim == 1:                            # a bias or 1-D float tensor
        if t.qtype != QT.F32:
            raise ConvertError(f"{t.name}: 1-D tensors must be f32 (got {t.qtype.name})")
        return Tensor(t.name, t.qtype, (data * f).astype(np.float32))
    if t.qtype == QT.F32:
        out = data * f[:, None]
        return Tensor(t.name, t.qtype, out.astype(np.float32))
    if t.qtype == QT.F16:
        return Tensor(t.name, t.qtype, _scale_f16(data.view(np.uint16), f[:, None], stats).view(np.float16))
    if t.qtype == QT.BF16:                        # bf16 = the high half of an f32: scale it as one
        u = data.view(np.uint16).astype(np.uint32) << 16
        v = u.view(np.float32) * f[:, None]
        back = (v.view(np.uint32) >> 16).astype(np.uint16)
        return Tensor(t.name, t.qtype, back.view(data.dtype).reshape(data.shape))
    if t.qtype not in SCALE_FIELDS:
        raise ConvertError(f"{t.name}: cannot scale rows of {t.qtype.name} exactly "
                           f"(supported: {', '.join(q.name for q in (*FLOAT_TYPES, *SCALE_FIELDS))})")
    block_elems, block_bytes = GGML_QUANT_SIZES[t.qtype]
    rows = data.reshape(data.shape[0], -1, block_bytes)          # [rows, blocks, bytes]
    for off in SCALE_FIELDS[t.qtype]:
        field = np.ascontiguousarray(rows[:, :, off:off + 2]).view(np.uint16)[..., 0]
        scaled = _scale_f16(field, f[:, None], stats)
        rows[:, :, off:off + 2] = scaled[..., None].view(np.uint8).reshape(rows.shape[0], rows.shape[1], 2)
    return Tensor(t.name, t.qtype, rows.reshape(data.shape))


def to_f32(t: Tensor) -> np.ndarray:
    """The tensor's values as float32, rows first."""
    if t.qtype == QT.F32:
        return np.asarray(t.data, dtype=np.float32)
    return quants.dequantize(np.asarray(t.data), t.qtype).astype(np.float32)


STORE_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}


def from_f32(name: str, x: np.ndarray, outtype: str) -> Tensor:
    """Store float32 rows x as outtype (f32, f16, bf16 or q8_0); 1-D stays f32."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1 or outtype == "f32":
        return Tensor(name, QT.F32, np.ascontiguousarray(x))
    if outtype == "f16":
        return Tensor(name, QT.F16, x.astype(np.float16))
    qt = STORE_TYPES.get(outtype)
    if qt is None:
        raise ConvertError(f"unknown output type {outtype!r}; choose one of {', '.join(STORE_TYPES)}")
    if x.shape[-1] % GGML_QUANT_SIZES[qt][0]:
        return Tensor(name, QT.F16, x.astype(np.float16))          # rows a block does not divide
    return Tensor(name, qt, quants.quantize(x, qt))
