"""Stock ggml cache formats (q8_0, q4_0, q5_0) as numpy round trips.

The rules of ggml's quantize_row_<type>_ref: the block scale d is the signed
value of largest magnitude over -2^(bits-1) (absolute maximum over 127 for
q8_0), values are rounded with the reference's own rounding, and d is stored as
f16. Used for fake quantization in the converter's calibration (smoothing), not
for storage.
"""
from __future__ import annotations

import numpy as np

QK = 32


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {QK}")
    return x.reshape(*x.shape[:-1], -1, QK)


def roundtrip_q8_0(x: np.ndarray) -> np.ndarray:
    b = _blocks(x)
    d = np.abs(b).max(axis=-1, keepdims=True) / 127.0
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d > 0, 1.0 / d, 0.0)
    v = b * inv
    q = np.trunc(v + np.copysign(0.5, v))                      # roundf: half away from zero
    return (q * d.astype(np.float16).astype(np.float32)).reshape(np.shape(x)).astype(np.float32)


def _roundtrip_signed_max(x: np.ndarray, half: int) -> np.ndarray:
    b = _blocks(x)
    idx = np.abs(b).argmax(axis=-1)[..., None]
    vmax = np.take_along_axis(b, idx, axis=-1)
    d = vmax / -half
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, 1.0 / d, 0.0)
    q = np.minimum(2 * half - 1, np.trunc(b * inv + (half + 0.5)))
    return ((q - half) * d.astype(np.float16).astype(np.float32)).reshape(np.shape(x)).astype(np.float32)


def roundtrip_q4_0(x: np.ndarray) -> np.ndarray:
    return _roundtrip_signed_max(x, 8)


def roundtrip_q5_0(x: np.ndarray) -> np.ndarray:
    return _roundtrip_signed_max(x, 16)


# The bytes of these formats, from levels of scale_search.quantize (what a pykvq-converted file's q4_0 / q5_0
# cache holds: pykvq.ref.roundtrip(..., lsq=True) for its values).
def pack_q4_0(d: np.ndarray, q: np.ndarray) -> bytes:
    """ggml's block_q4_0 bytes of f16 d [nb] and levels q [nb, 32] in [0, 16): d, then qs[16] (q(j) low
    nibble, q(j+16) high)."""
    qs = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), qs.astype(np.uint8)], axis=1).tobytes()


def pack_q5_0(d: np.ndarray, q: np.ndarray) -> bytes:
    """ggml's block_q5_0 bytes of f16 d [nb] and levels q [nb, 32] in [0, 32): d, qh[4] (bit j = q(j) >> 4),
    qs[16] as q4_0's."""
    qh = np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")
    qs = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), qh, qs.astype(np.uint8)], axis=1).tobytes()
