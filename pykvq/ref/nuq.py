"""Non-uniform quantization (nuq4, nuq3, nuq2, nuq3o, nuq2o, nuq3_64, nuq2_64): the reference rule.

Each block of `block` values stores one f16 scale d and, per value, an index
into a codebook c of 2^bits int8 entries (sorted strictly ascending, each in
[-127, 127]); x ≈ d * c[idx]. The codebook comes from the model file (one per
layer, K and V apart, calibrated by the converter) or, when the file has none,
from FALLBACK below.

  amax = max |x| over the block (NaN counts as 0, inf counts)
  d    = min(amax / 127, 65504)   (float32; 65504 is the largest finite f16)
  id   = 1/d, or 0 when d <= 2^-25 (then fp16(d) == 0 and the block decodes to 0)
  v    = x * id       (float32, so v is in [-127, 127] unless d was clamped; NaN x -> 0)
  idx  = #{ j : v > m_j }  with midpoints m_j = (c_j + c_{j+1}) / 2
         (nearest entry; a tie goes to the lower one)
  stored: fp16(d), idx;  dequantized: float(fp16(d)) * c[idx]

Outlier variants (nuq3o, nuq2o; block 64) keep the block's largest |x| exactly
(as f16, like an f16 cache): its position oi (first of equals) and value
ov = fp16(clip(x[oi], -65504, 65504)) (NaN -> 0) are stored, the dense part is
quantized with x[oi] replaced by 0, and the dequantized block gets ov back at oi.
One outlier per 64 values is 1.6%.

Edge inputs (docs/FORMATS.md): no block decodes to inf or NaN. A NaN is read as 0,
|x| beyond 65504 * 127 (dense) or 65504 (outlier) and +-inf saturate, all-zero
blocks decode to (+-)0.

Storage (ggml blocks, little endian, no padding):
  nuq4  (32): d[2] qs[16]            byte j: idx j (low nibble), idx j+16 (high)       18 B  4.5   bits/value
  nuq3  (32): d[2] qs[8] qh[4]       qs byte j: bits 2k..2k+1 = idx(j+8k) & 3, k=0..3;  14 B  3.5
                                     qh: bit i of the 32-bit word = idx(i) >> 2
  nuq2  (32): d[2] qs[8]             as nuq3's qs                                      10 B  2.5
  nuq3o (64): d[2] ov[2] oi qs[16] qh[8]   qs byte j: idx(j+16k) & 3 at bits 2k;       29 B  3.625
                                     qh: bit i of the 64-bit word = idx(i) >> 2
  nuq2o (64): d[2] ov[2] oi qs[16]                                                     21 B  2.625
  nuq3_64 (64): d[2] qs[16] qh[8]  as nuq3o without the outlier                        26 B  3.25
  nuq2_64 (64): d[2] qs[16]        as nuq2o without the outlier                        18 B  2.25

K·Q converts Q to q8_0 (vec_dot_type) and sums c[idx] * q in int32 per 32 values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NUQFormat:
    name: str
    block: int
    bits: int
    outliers: int = 0

    @property
    def n_codes(self) -> int:
        return 1 << self.bits

    @property
    def type_size(self) -> int:
        return 2 + 3 * self.outliers + self.block * self.bits // 8

    @property
    def bits_per_value(self) -> float:
        return 8 * self.type_size / self.block


FORMATS = {f.name: f for f in (
    NUQFormat("nuq4", 32, 4), NUQFormat("nuq3", 32, 3), NUQFormat("nuq2", 32, 2),
    NUQFormat("nuq3o", 64, 3, 1), NUQFormat("nuq2o", 64, 2, 1),
    NUQFormat("nuq3_64", 64, 3), NUQFormat("nuq2_64", 64, 2))}

# Used when a model file carries no codebook for a layer: Lloyd-Max centroids of
# Gaussian blocks of 32 normalised by their absmax to [-127, 127], rounded. After
# the online Hadamard rotation K and V rows are close to Gaussian.
FALLBACK = {
    4: np.array([-123, -98, -78, -61, -46, -32, -19, -6, 6, 19, 32, 46, 61, 78, 98, 123], np.int8),
    3: np.array([-112, -71, -40, -13, 13, 40, 71, 112], np.int8),
    2: np.array([-84, -25, 25, 84], np.int8),
}


def fmt_of(fmt: str | NUQFormat) -> NUQFormat:
    return fmt if isinstance(fmt, NUQFormat) else FORMATS[fmt]


def fallback(fmt: str | NUQFormat) -> np.ndarray:
    return FALLBACK[fmt_of(fmt).bits]


def check_codebook(cb, fmt: str | NUQFormat) -> np.ndarray:
    """The codebook as int8, or ValueError if it breaks the rules above."""
    f = fmt_of(fmt)
    c = np.asarray(cb)
    if c.shape != (f.n_codes,):
        raise ValueError(f"{f.name} needs a codebook of {f.n_codes} entries, got shape {c.shape}")
    if np.any(c < -127) or np.any(c > 127) or np.any(c != np.round(c)):
        raise ValueError(f"codebook entries must be integers in [-127, 127]: {c.tolist()}")
    c = c.astype(np.int8)
    if np.any(np.diff(c.astype(np.int32)) <= 0):
        raise ValueError(f"codebook must be strictly ascending: {c.tolist()}")
    return c


def midpoints(cb: np.ndarray) -> np.ndarray:
    c = cb.astype(np.float32)
    return ((c[1:] + c[:-1]) * np.float32(0.5)).astype(np.float32)


@dataclass
class Blocks:
    fmt: NUQFormat
    d: np.ndarray     # float16 [nb]
    idx: np.ndarray   # uint8 [nb, block]
    oi: np.ndarray    # uint8 [nb] (outlier variants; else empty)
    ov: np.ndarray    # float16 [nb]


def _split(x: np.ndarray, f: NUQFormat):
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size % f.block:
        raise ValueError(f"{f.name}: {x.size} values is not a multiple of the block size {f.block}")
    xb = x.reshape(-1, f.block).copy()
    ax = np.abs(np.where(np.isnan(xb), np.float32(0), xb))
    if f.outliers:
        oi = np.argmax(ax, axis=1).astype(np.uint8)
        rows = np.arange(xb.shape[0])
        ov = outlier_value(xb[rows, oi])
        xb[rows, oi] = 0
        ax[rows, oi] = 0
    else:
        oi = np.zeros(0, np.uint8)
        ov = np.zeros(0, np.float16)
    return xb, ax, oi, ov


F16_MAX = np.float32(65504)
D_MIN = np.float32(2.0 ** -25)   # fp16(d) == 0 for d <= D_MIN


def outlier_value(x: np.ndarray) -> np.ndarray:
    """The stored f16 of the outlier: NaN -> 0, clamped to the largest finite f16."""
    x = np.where(np.isnan(x), np.float32(0), x).astype(np.float32)
    return np.clip(x, -F16_MAX, F16_MAX).astype(np.float16)


def _scale(ax: np.ndarray):
    """(d, id) of each block from |x| (NaN already 0): d = min(amax/127, 65504), id = 1/d or 0."""
    d = np.minimum(ax.max(axis=1) / np.float32(127), F16_MAX).astype(np.float32)
    use = d > D_MIN
    with np.errstate(divide="ignore"):
        id_ = np.where(use, np.float32(1) / np.where(use, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return d, id_


def _values(xb: np.ndarray, id_: np.ndarray) -> np.ndarray:
    """v = x * id per value, a NaN x read as 0."""
    return (np.where(np.isnan(xb), np.float32(0), xb) * id_[:, None]).astype(np.float32)


def normalize(x: np.ndarray, fmt: str | NUQFormat):
    """(v, d, keep): v = x * id per value as the quantizer sees it ([nb, block] float32),
    the fp16 scales, and a mask of the values the dense codebook encodes (not outliers)."""
    f = fmt_of(fmt)
    xb, ax, oi, _ = _split(x, f)
    d, id_ = _scale(ax)
    v = _values(xb, id_)
    keep = np.ones(v.shape, bool)
    if f.outliers:
        keep[np.arange(v.shape[0]), oi] = False
    return v, d.astype(np.float16), keep


def assign(v: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Codebook index of each normalised value (nearest, ties to the lower entry)."""
    m = midpoints(cb)
    vv = np.where(np.isnan(v), np.float32(0), v)   # NaN is read as 0 (the quantizer zeroes it first)
    return np.searchsorted(m, vv, side="left").astype(np.uint8)


def quantize_blocks(x: np.ndarray, fmt: str | NUQFormat, cb=None) -> Blocks:
    f = fmt_of(fmt)
    c = fallback(f) if cb is None else check_codebook(cb, f)
    xb, ax, oi, ov = _split(x, f)
    d, id_ = _scale(ax)
    v = _values(xb, id_)
    return Blocks(f, d.astype(np.float16), assign(v, c), oi, ov)


def dequantize_blocks(b: Blocks, cb=None) -> np.ndarray:
    c = fallback(b.fmt) if cb is None else check_codebook(cb, b.fmt)
    y = b.d.astype(np.float32)[:, None] * c.astype(np.float32)[b.idx]
    if b.fmt.outliers:
        y[np.arange(y.shape[0]), b.oi] = b.ov.astype(np.float32)
    return y.reshape(-1).astype(np.float32)


def roundtrip(x: np.ndarray, fmt: str | NUQFormat, cb=None) -> np.ndarray:
    """Quantize and dequantize the last axis of x; the shape is kept."""
    x = np.asarray(x, dtype=np.float32)
    return dequantize_blocks(quantize_blocks(x, fmt, cb), cb).reshape(x.shape)


# --- ggml byte layout -------------------------------------------------------

def pack_low2(idx: np.ndarray) -> np.ndarray:
    """[nb, block] 2-bit fields: byte j holds idx(j + k*block/4) & 3 at bits 2k (nuq2 / nuq3 and the low
    halves of q53_64 / q42_64)."""
    q = (idx & 3).astype(np.uint8)
    g = q.reshape(q.shape[0], 4, -1)            # [nb, k, j]
    return (g[:, 0] | (g[:, 1] << 2) | (g[:, 2] << 4) | (g[:, 3] << 6)).astype(np.uint8)


def unpack_low2(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([(qs >> (2 * k)) & 3 for k in range(4)], axis=1).astype(np.uint8)


def pack(b: Blocks) -> bytes:
    f, nb = b.fmt, b.idx.shape[0]
    parts = [b.d.view(np.uint8).reshape(nb, 2)]
    if f.outliers:
        parts += [b.ov.view(np.uint8).reshape(nb, 2), b.oi.reshape(nb, 1)]
    if f.bits == 4:
        h = f.block // 2
        parts.append((b.idx[:, :h] | (b.idx[:, h:] << 4)).astype(np.uint8))
    else:
        parts.append(pack_low2(b.idx))
        if f.bits == 3:
            parts.append(np.packbits((b.idx >> 2).astype(np.uint8), axis=1, bitorder="little"))
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == f.type_size
    return out.tobytes()


def unpack(data: bytes, fmt: str | NUQFormat) -> Blocks:
    f = fmt_of(fmt)
    a = np.frombuffer(data, np.uint8).reshape(-1, f.type_size)
    nb, o = a.shape[0], 0
    d = a[:, 0:2].copy().view(np.float16).reshape(nb)
    o = 2
    if f.outliers:
        ov = a[:, 2:4].copy().view(np.float16).reshape(nb)
        oi = a[:, 4].copy()
        o = 5
    else:
        ov, oi = np.zeros(0, np.float16), np.zeros(0, np.uint8)
    if f.bits == 4:
        qs = a[:, o:o + f.block // 2]
        idx = np.concatenate([qs & 15, qs >> 4], axis=1)
    else:
        idx = unpack_low2(a[:, o:o + f.block // 4])
        if f.bits == 3:
            qh = np.unpackbits(a[:, o + f.block // 4:], axis=1, bitorder="little")
            idx = idx | (qh << 2)
    return Blocks(f, d, idx.astype(np.uint8), oi, ov)


def quantize_bytes(x: np.ndarray, fmt: str | NUQFormat, cb=None) -> bytes:
    return pack(quantize_blocks(x, fmt, cb))


def dequantize_bytes(data: bytes, fmt: str | NUQFormat, cb=None) -> np.ndarray:
    return dequantize_blocks(unpack(data, fmt), cb)
