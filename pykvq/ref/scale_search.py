"""Least-squares block scales for q*_0-style blocks, the reference rule (numpy).

q*_0 stores a block of 32 values as levels q in [0, 2*half) and one f16 scale d, reading back
(q - half) * d, half = 2^(bits-1) (8 for q4_0, 16 for q5_0 and q53_64's 5-bit half, 4 for its 3-bit
half). ggml picks d = vmax / -half, the signed value of largest magnitude mapped to the extreme level.
For near-Gaussian blocks (keys and values after the online Hadamard) that is not the scale whose levels
land nearest; this rule tries 26 multiples of it and keeps the best:

  x    = 0 where NaN, clipped to +-FLT_MAX (inf saturates)
  vmax = the signed value of largest |x| (first of equals); +0 for a block of zeros (-0 included), as ggml's
         q*_0 quantizers start from max = 0 and replace it only by a larger |x|
  for k = 0 .. 25, f_k = float32(35 + k) / 50 (0.70 .. 1.20; f_15 = 1 is q*_0's own):
    d    = clip((vmax / -half) * f_k, -65504, 65504)    (float32)
    id   = 1/d, or 0 when d == 0
    q    = clip(trunc(x*id + half + 0.5), 0, 2*half - 1)   (float32 arithmetic; NaN counts as 0)
    read back: (q - half) * float(fp16(d))            (no block decodes to inf or NaN)
    error = sum over the 32 values, in order, of (read back - x)^2 in float64
  keep the k of least error (the first of equals)

It cuts the squared error of Gaussian blocks by ~11% at 5 bits, ~13% at 3 and 4. Only the stored d
changes: the output is the stock format, read by every decoder unchanged. The C twin is
native/ggml/lsq.c (ggml_kvq_lsq_block); q53_64 always encodes so, a q4_0 / q5_0 cache where the runtime
asks (a pykvq-converted file: docs/FORMATS.md).
"""
from __future__ import annotations

import numpy as np

N = 32            # values per block
N_SCALES = 26     # the scale factors f_k = (35 + k)/50 the rule tries


def quantize(b: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 d [nb], q [nb, 32] uint8) of blocks b [nb, 32] by the rule above."""
    fmax = np.float32(np.finfo(np.float32).max)
    b = np.clip(np.nan_to_num(np.asarray(b, np.float32), nan=0.0, posinf=fmax, neginf=-fmax), -fmax, fmax)
    b = b.astype(np.float32)
    idx = np.abs(b).argmax(axis=-1)[:, None]
    vmax = np.take_along_axis(b, idx, axis=-1)
    vmax = np.where(vmax == 0, np.float32(0.0), vmax)   # -0 -> +0: the C rule (and ggml's) starts from max = +0
    best = np.full(len(b), np.inf)
    d_out = np.zeros(len(b), np.float16)
    q_out = np.zeros(b.shape, np.uint8)
    for k in range(N_SCALES):
        f = np.float32(35 + k) / np.float32(50)
        d = np.clip((vmax / np.float32(-half)) * f, -65504, 65504).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
            t = (b * inv + np.float32(half + 0.5)).astype(np.float32)
        q = np.clip(np.trunc(np.where(np.isnan(t), 0, t)), 0, 2 * half - 1)   # NaN (0 * an inverse that overflows) is 0
        d16 = d[:, 0].astype(np.float16)
        back = ((q - half).astype(np.float32) * d16.astype(np.float32)[:, None]).astype(np.float64)
        e = np.zeros(len(b))
        for j in range(b.shape[1]):                 # summed in order, as the C reference sums
            e = e + (back[:, j] - b[:, j].astype(np.float64)) ** 2
        better = e < best
        best[better], d_out[better], q_out[better] = e[better], d16[better], q[better]
    return d_out, q_out


def dequantize(d: np.ndarray, q: np.ndarray, half: int) -> np.ndarray:
    """[nb, 32] float32 read back."""
    return (q.astype(np.float32) - half) * d.astype(np.float32)[:, None]


def roundtrip(x: np.ndarray, half: int) -> np.ndarray:
    """Quantize and dequantize the last axis of x (a multiple of 32); the shape is kept."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % N:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {N}")
    return dequantize(*quantize(x.reshape(-1, N), half), half).reshape(x.shape)
