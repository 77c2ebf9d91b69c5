"""Block floating point (bfp4_32, bfp4_64, bfp8_32): the reference rule.

A block of `block` values shares one power-of-two scale 2^s; each value keeps
an integer mantissa m in [-M, M] with M = 2^(bits-1) - 1, so x ≈ m * 2^s.

  amax = max |x| (NaN counts as 0)
  amax == 0     -> e = 0 and every mantissa 0
  amax is inf   -> s = SMAX (mantissas saturate)
  otherwise     -> amax = f * 2^E with f in [0.5, 1)   (frexp)
                   s = E - (bits-1) + [f >= (M + 0.5) / 2^(bits-1)]
                   the smallest s with rint(amax / 2^s) <= M, so nothing overflows
  s is clamped to [-127, SMAX] and stored as e = s + 127 (one byte, E8M0)
  m = clip(rint(x * 2^-s), -M, M)   round half to even; NaN -> 0
  dequantized: m * 2^(e - 127)      (e = 0 is the subnormal 2^-127)

SMAX = 129 - bits (125 for bfp4, 121 for bfp8) is the largest s with M * 2^s finite:
no block decodes to inf; +-inf and |x| >= (M + 1/2) * 2^SMAX saturate to +-M * 2^SMAX.

Storage (ggml blocks): e, then mantissas. 4-bit mantissas are nibbles m + 8,
byte j holding element j (low) and element j + block/2 (high); 8-bit
mantissas are int8.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BFPFormat:
    name: str
    block: int
    bits: int

    @property
    def mmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def smax(self) -> int:
        """Largest shared exponent s: M * 2^s is the largest finite value a block holds."""
        return 129 - self.bits

    @property
    def type_size(self) -> int:
        return 1 + self.block * self.bits // 8

    @property
    def bits_per_value(self) -> float:
        return 8 * self.type_size / self.block


FORMATS = {f.name: f for f in (BFPFormat("bfp4_32", 32, 4), BFPFormat("bfp4_64", 64, 4),
                               BFPFormat("bfp8_32", 32, 8))}


def fmt_of(fmt: str | BFPFormat) -> BFPFormat:
    return fmt if isinstance(fmt, BFPFormat) else FORMATS[fmt]


def e8m0_to_float(e: np.ndarray) -> np.ndarray:
    """2^(e - 127) as float32 (e = 0: 2^-127, a float32 subnormal)."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e == 0, np.uint32(0x00400000), e << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def exponents(blocks: np.ndarray, fmt: str | BFPFormat) -> np.ndarray:
    """Shared exponent byte of each row of blocks [nb, block] (float32)."""
    f_ = fmt_of(fmt)
    a = np.abs(blocks.astype(np.float32))
    a = np.where(np.isnan(a), np.float32(0), a)
    amax = a.max(axis=1)
    with np.errstate(invalid="ignore"):
        frac, E = np.frexp(amax)
    thresh = np.float32((f_.mmax + 0.5) / (1 << (f_.bits - 1)))
    s = E.astype(np.int64) - (f_.bits - 1) + (frac >= thresh)
    s = np.where(np.isinf(amax), f_.smax, s)
    s = np.clip(s, -127, f_.smax)
    return np.where(amax == 0, 0, s + 127).astype(np.uint8)


def quantize_blocks(x: np.ndarray, fmt: str | BFPFormat) -> tuple[np.ndarray, np.ndarray]:
    """(e [nb] uint8, m [nb, block] int8) for a 1-D float array whose length the block divides."""
    f_ = fmt_of(fmt)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size % f_.block:
        raise ValueError(f"{f_.name}: {x.size} values is not a multiple of the block size {f_.block}")
    blocks = x.reshape(-1, f_.block)
    e = exponents(blocks, f_)
    inv = e8m0_to_float(254 - e.astype(np.int64))            # 2^-s, exact: 2^(127 - e)
    # e = 254 gives inv = 2^-127 (e8m0 code 0), which is exact as well
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.rint(blocks * inv[:, None])
    v = np.where(np.isnan(v), 0, v)
    m = np.clip(v, -f_.mmax, f_.mmax).astype(np.int8)
    return e, m


def dequantize_blocks(e: np.ndarray, m: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):   # only foreign bytes (e > 256 - bits) can overflow, as in C
        return (m.astype(np.float32) * e8m0_to_float(e)[:, None]).reshape(-1)


def pack(e: np.ndarray, m: np.ndarray, fmt: str | BFPFormat) -> bytes:
    f_ = fmt_of(fmt)
    nb = e.size
    out = np.empty((nb, f_.type_size), dtype=np.uint8)
    out[:, 0] = e
    if f_.bits == 8:
        out[:, 1:] = m.view(np.uint8)
    else:
        nib = (m.astype(np.int16) + 8).astype(np.uint8)
        half = f_.block // 2
        out[:, 1:] = nib[:, :half] | (nib[:, half:] << 4)
    return out.tobytes()


def unpack(buf: bytes, fmt: str | BFPFormat) -> tuple[np.ndarray, np.ndarray]:
    f_ = fmt_of(fmt)
    raw = np.frombuffer(buf, dtype=np.uint8).reshape(-1, f_.type_size)
    e = raw[:, 0].copy()
    if f_.bits == 8:
        m = raw[:, 1:].view(np.int8).copy()
    else:
        lo = (raw[:, 1:] & 0x0F).astype(np.int8) - 8
        hi = (raw[:, 1:] >> 4).astype(np.int8) - 8
        m = np.concatenate([lo, hi], axis=1)
    return e, m


def quantize_row(x: np.ndarray, fmt: str | BFPFormat) -> bytes:
    """The bytes ggml's quantize_row_<fmt>_ref writes for x."""
    return pack(*quantize_blocks(x, fmt), fmt)


def dequantize_row(buf: bytes, fmt: str | BFPFormat) -> np.ndarray:
    return dequantize_blocks(*unpack(buf, fmt))


def vec_dot(kbuf: bytes, kfmt: str | BFPFormat, q: np.ndarray) -> float:
    """K·Q as the kernels define it: Q quantized to bfp8_32, exact integer block
    sums, times the product of the two block scales; summed in float64."""
    ek, mk = unpack(kbuf, kfmt)
    eq, mq = quantize_blocks(q, "bfp8_32")
    mk = mk.reshape(-1, 32).astype(np.int64)
    ek = np.repeat(ek, fmt_of(kfmt).block // 32)
    isum = (mk * mq.astype(np.int64)).sum(axis=1)
    scale = e8m0_to_float(ek).astype(np.float64) * e8m0_to_float(eq).astype(np.float64)
    return float((isum * scale).sum())
