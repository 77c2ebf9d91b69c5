"""q53_64: 4.5 bits/value split unevenly inside a block, the reference rule (numpy); q42_64 (3.5 bits) and q32_64
(3.0 bits) below.

A block of 64 values holds two halves of 32: the first half in 5 bits, the second in 3 bits
(q5_0's levels with half = 16, and the same levels with half = 4), each with its own f16 scale:

  per half of 32 values, half = 2^(bits-1) (16 for 5 bits, 4 for 3 bits):
  x    = 0 where NaN, clipped to +-FLT_MAX (inf saturates)
  vmax = the signed value of largest |x| (first of equals; +0 for a block of zeros)
  for k = 0 .. 25, f_k = float32(35 + k) / 50 (0.70 .. 1.20; f_15 = 1):
    d    = clip((vmax / -half) * f_k, -65504, 65504)    (float32)
    id   = 1/d, or 0 when d == 0
    q    = clip(trunc(x*id + half + 0.5), 0, 2*half - 1)   (float32 arithmetic)
    read back: (q - half) * float(fp16(d))            (no block decodes to inf or NaN)
    error = sum over the 32 values, in order, of (read back - x)^2 in float64
  keep the k of least error (the first of equals)

At f = 1 this is ggml's q5_0 quantizer on the first half and its 3-bit twin on the second; the scale
search (the signed max is not the best scale of a near-Gaussian block: ~11% less squared error at 5 bits,
~13% at 3) changes only which d a block stores. A block is two q*_0 blocks of different widths:
16 + 5*32 + 16 + 3*32 = 288 bits per 64 values, 4.5 bits/value like q4_0 and nuq4.

Why uneven: the loss reads the channels of a pre-RoPE key head very unevenly (the diagonal Fisher
of the channel times its variance spans orders of magnitude). A key cache whose channels are laid
out so that the important half of every 64 lands in the 5-bit half (importance_layout below, baked
into W_q / W_k by the converter's pair permutation) spends its bits where the loss reads them.
Fake quantization with this rule (scripts/prerope_study.py, rows "mixed bits"; docs/prerope-study.md) beats
the 4-bit cache at the same size: SmolLM2-135M keys 0.0101 vs 0.0150 KLD.

Storage (little endian, no padding; 36 bytes):
  d5[2] d3[2]  qh5[4]  qs5[16]  qs3[8]  qh3[4]
  qs5 byte j: q(j) & 15 (low nibble), q(j+16) & 15 (high)           (as q5_0)
  qh5: bit i of the 32-bit word = q(i) >> 4                          (as q5_0)
  qs3 byte j: bits 2k..2k+1 = q3(j + 8k) & 3, k = 0..3                (as nuq3)
  qh3: bit i of the 32-bit word = q3(i) >> 2                         (as nuq3)
"""
from __future__ import annotations

import numpy as np

from . import scale_search, tcq
from .nuq import pack_low2, unpack_low2

QK = 64
HALF = 32
BITS = (5, 3)
TYPE_SIZE = 36
BITS_PER_VALUE = 8 * TYPE_SIZE / QK


N_SCALES = scale_search.N_SCALES


def _quantize_halves(x: np.ndarray, bits: tuple, name: str):
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"{name}: the last dimension {x.shape[-1]} is not a multiple of {QK}")
    b = x.reshape(-1, QK)
    d_hi, q_hi = scale_search.quantize(b[:, :HALF], 1 << (bits[0] - 1))
    d_lo, q_lo = scale_search.quantize(b[:, HALF:], 1 << (bits[1] - 1))
    return d_hi, q_hi, d_lo, q_lo


def _dequantize_halves(d_hi, q_hi, d_lo, q_lo, bits: tuple) -> np.ndarray:
    hi = (q_hi.astype(np.float32) - (1 << (bits[0] - 1))) * d_hi.astype(np.float32)[:, None]
    lo = (q_lo.astype(np.float32) - (1 << (bits[1] - 1))) * d_lo.astype(np.float32)[:, None]
    return np.concatenate([hi, lo], axis=1)


def quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d5, q5, d3, q3) of the last axis of x (a multiple of 64) as [nb] f16 and [nb, 32] uint8 arrays."""
    return _quantize_halves(x, BITS, "q53_64")


def dequantize_blocks(d5, q5, d3, q3) -> np.ndarray:
    """[nb, 64] float32."""
    return _dequantize_halves(d5, q5, d3, q3, BITS)


def roundtrip(x: np.ndarray) -> np.ndarray:
    """Quantize and dequantize the last axis of x; the shape is kept."""
    x = np.asarray(x, dtype=np.float32)
    return dequantize_blocks(*quantize_blocks(x)).reshape(x.shape)


def pack(d5, q5, d3, q3) -> bytes:
    nb = q5.shape[0]
    qh5 = np.packbits((q5 >> 4).astype(np.uint8), axis=1, bitorder="little")
    qs5 = (q5[:, :16] & 15) | ((q5[:, 16:] & 15) << 4)
    qs3 = pack_low2(q3)
    qh3 = np.packbits((q3 >> 2).astype(np.uint8), axis=1, bitorder="little")
    parts = [d5.view(np.uint8).reshape(nb, 2), d3.view(np.uint8).reshape(nb, 2), qh5, qs5, qs3, qh3]
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=1)
    assert out.shape[1] == TYPE_SIZE
    return out.tobytes()


def unpack(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size % TYPE_SIZE:
        raise ValueError(f"q53_64: {a.size} bytes is not a whole number of {TYPE_SIZE}-byte blocks")
    a = a.reshape(-1, TYPE_SIZE)
    d5 = a[:, 0:2].copy().view(np.float16)[:, 0]
    d3 = a[:, 2:4].copy().view(np.float16)[:, 0]
    qh5 = np.unpackbits(a[:, 4:8], axis=1, bitorder="little")
    qs5 = a[:, 8:24]
    q5 = np.concatenate([qs5 & 15, qs5 >> 4], axis=1) | (qh5 << 4)
    qs3, qh3 = a[:, 24:32], np.unpackbits(a[:, 32:36], axis=1, bitorder="little")
    q3 = unpack_low2(qs3) | (qh3 << 2)
    return d5, q5.astype(np.uint8), d3, q3.astype(np.uint8)


# q42_64: the same split one bit lower, 3.5 bits/value. The first half in 4 bits (q4_0's levels, half = 8), the
# second in 2 bits (4 levels, half = 2), each with its own f16 scale by the same rule. Storage (28 bytes):
#   d4[2] d2[2]  qs4[16]  qs2[8]
#   qs4 byte j: q4(j) (low nibble), q4(j+16) (high)     (as q4_0)
#   qs2 byte j: bits 2k..2k+1 = q2(j + 8k), k = 0..3    (as nuq2)
# Fake quantization of SmolLM2's pre-RoPE keys at 4096 tokens with the window (scripts/longctx_study.py, "mix42"):
# 0.0045 KLD against 0.0109 for uniform 3-bit keys with the same scale rule (docs/RESULTS.md).
Q42_BITS = (4, 2)
HALVES_TYPES = ("q53_64", "q42_64", "q32_64", "q4t2_64", "t32_64")   # key types whose blocks want the importance layout
Q42_TYPE_SIZE = 28
Q42_BITS_PER_VALUE = 8 * Q42_TYPE_SIZE / QK


def q42_quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d4, q4, d2, q2) of the last axis of x (a multiple of 64) as [nb] f16 and [nb, 32] uint8 arrays."""
    return _quantize_halves(x, Q42_BITS, "q42_64")


def q42_dequantize_blocks(d4, q4, d2, q2) -> np.ndarray:
    """[nb, 64] float32."""
    return _dequantize_halves(d4, q4, d2, q2, Q42_BITS)


def q42_roundtrip(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return q42_dequantize_blocks(*q42_quantize_blocks(x)).reshape(x.shape)


def q42_pack(d4, q4, d2, q2) -> bytes:
    nb = q4.shape[0]
    qs4 = (q4[:, :16] & 15) | ((q4[:, 16:] & 15) << 4)
    qs2 = pack_low2(q2)
    parts = [d4.view(np.uint8).reshape(nb, 2), d2.view(np.uint8).reshape(nb, 2), qs4, qs2]
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=1)
    assert out.shape[1] == Q42_TYPE_SIZE
    return out.tobytes()


def q42_unpack(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size % Q42_TYPE_SIZE:
        raise ValueError(f"q42_64: {a.size} bytes is not a whole number of {Q42_TYPE_SIZE}-byte blocks")
    a = a.reshape(-1, Q42_TYPE_SIZE)
    d4 = a[:, 0:2].copy().view(np.float16)[:, 0]
    d2 = a[:, 2:4].copy().view(np.float16)[:, 0]
    qs4, qs2 = a[:, 4:20], a[:, 20:28]
    q4 = np.concatenate([qs4 & 15, qs4 >> 4], axis=1)
    q2 = unpack_low2(qs2)
    return d4, q4.astype(np.uint8), d2, q2.astype(np.uint8)


# q32_64: the split at 3.0 bits/value. The first half in 3 bits (q53_64's 3-bit half: half = 4, its layout), the
# second in 2 bits (q42_64's 2-bit half), each with its own f16 scale by the same rule. Storage (24 bytes):
#   d3[2] d2[2]  qs3[8]  qh3[4]  qs2[8]
#   qs3 byte j: bits 2k..2k+1 = q3(j + 8k) & 3; qh3: bit i of the 32-bit word = q3(i) >> 2   (as q53_64's 3-bit half)
#   qs2 byte j: bits 2k..2k+1 = q2(j + 8k), k = 0..3                                          (as q42_64's 2-bit half)
# It fills the key ladder's step from nuq2o (2.625 bits) to q42_64 (3.5): fake quantization of SmolLM2's keys at
# 4096 tokens, 2-bit blocks 0.0712, 3 / 2-bit halves 0.0138-0.0168, 4 / 2 0.0045 (docs/RESULTS-BY-DATE.md).
Q32_BITS = (3, 2)
Q32_TYPE_SIZE = 24
Q32_BITS_PER_VALUE = 8 * Q32_TYPE_SIZE / QK


def q32_quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d3, q3, d2, q2) of the last axis of x (a multiple of 64) as [nb] f16 and [nb, 32] uint8 arrays."""
    return _quantize_halves(x, Q32_BITS, "q32_64")


def q32_dequantize_blocks(d3, q3, d2, q2) -> np.ndarray:
    """[nb, 64] float32."""
    return _dequantize_halves(d3, q3, d2, q2, Q32_BITS)


def q32_roundtrip(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return q32_dequantize_blocks(*q32_quantize_blocks(x)).reshape(x.shape)


def q32_pack(d3, q3, d2, q2) -> bytes:
    nb = q3.shape[0]
    qh3 = np.packbits((q3 >> 2).astype(np.uint8), axis=1, bitorder="little")
    parts = [d3.view(np.uint8).reshape(nb, 2), d2.view(np.uint8).reshape(nb, 2), pack_low2(q3), qh3, pack_low2(q2)]
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=1)
    assert out.shape[1] == Q32_TYPE_SIZE
    return out.tobytes()


def q32_unpack(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size % Q32_TYPE_SIZE:
        raise ValueError(f"q32_64: {a.size} bytes is not a whole number of {Q32_TYPE_SIZE}-byte blocks")
    a = a.reshape(-1, Q32_TYPE_SIZE)
    d3 = a[:, 0:2].copy().view(np.float16)[:, 0]
    d2 = a[:, 2:4].copy().view(np.float16)[:, 0]
    q3 = unpack_low2(a[:, 4:12]) | (np.unpackbits(a[:, 12:16], axis=1, bitorder="little") << 2)
    q2 = unpack_low2(a[:, 16:24])
    return d3, q3.astype(np.uint8), d2, q2.astype(np.uint8)


# q4t2_64: q42_64 with its 2-bit half trellis-coded, 3.375 bits/value. The first half is q42_64's (q4_0's levels, a
# least-squares f16 scale); the second is tcq2_64's rule over 32 values (pykvq/ref/tcq.py: unit RMS, the tail-biting
# Viterbi path through tcq2's tables, the least-squares scale as tcq's one-byte code; value j's state is the 8-bit
# window of the 64-bit stream ending at its bits, around the half). Storage (27 bytes):
#   d4[2] d2  qs4[16]  qs2[8]
#   qs4 byte j: q4(j) (low nibble), q4(j+16) (high)     (as q4_0)
#   qs2: the 2-bit stream of values 32..63, value j's bits at 2j (as tcq2_64's)
# Fake quantization of SmolLM2's pre-RoPE keys at 4096 tokens (scripts/longctx_study.py, V q8_0, window 64 + sinks 4):
# 0.0039 KLD against q42_64's 0.0049 (docs/RESULTS-BY-DATE.md, 2026-12-01).
Q4T2_TYPE_SIZE = 27
TRELLIS_HALVES = ("q4t2_64", "t32_64")              # the halves types with a trellis-coded half (numpy's search is slow)
TRELLIS_HALF_BITS = 2


def q4t2_quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d4, q4, d2, states) of the last axis of x (a multiple of 64): [nb] f16, [nb, 32] uint8, [nb] scale codes
    (uint8, tcq.scales), [nb, 32]."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"q4t2_64: the last dimension {x.shape[-1]} is not a multiple of {QK}")
    b = x.reshape(-1, QK)
    d4, q4 = scale_search.quantize(b[:, :HALF], 8)
    d2, st = tcq.quantize_blocks(b[:, HALF:], TRELLIS_HALF_BITS, n=HALF)
    return d4, q4, d2, st


def q4t2_dequantize_blocks(d4, q4, d2, st) -> np.ndarray:
    """[nb, 64] float32."""
    hi = (q4.astype(np.float32) - 8) * d4.astype(np.float32)[:, None]
    lo = tcq.dequantize_blocks(d2, st, TRELLIS_HALF_BITS).reshape(-1, HALF)
    return np.concatenate([hi, lo], axis=1)


def q4t2_roundtrip(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return q4t2_dequantize_blocks(*q4t2_quantize_blocks(x)).reshape(x.shape)


def q4t2_pack(d4, q4, d2, st) -> bytes:
    nb = q4.shape[0]
    qs4 = (q4[:, :16] & 15) | ((q4[:, 16:] & 15) << 4)
    parts = [d4.view(np.uint8).reshape(nb, 2), tcq.scale_bytes_of(d2), qs4,
             tcq.stream(st, TRELLIS_HALF_BITS)]
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=1)
    assert out.shape[1] == Q4T2_TYPE_SIZE
    return out.tobytes()


def q4t2_unpack(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size % Q4T2_TYPE_SIZE:
        raise ValueError(f"q4t2_64: {a.size} bytes is not a whole number of {Q4T2_TYPE_SIZE}-byte blocks")
    a = a.reshape(-1, Q4T2_TYPE_SIZE)
    d4 = a[:, 0:2].copy().view(np.float16)[:, 0]
    d2 = a[:, 2].copy()
    qs4 = a[:, 3:19]
    q4 = np.concatenate([qs4 & 15, qs4 >> 4], axis=1)
    return d4, q4.astype(np.uint8), d2, tcq.stream_states(a[:, 19:27], TRELLIS_HALF_BITS, HALF)


# t32_64: q32_64's split with both halves trellis-coded, 2.75 bits/value: values 0..31 one 32-value block of tcq3_64's
# rule and tables, values 32..63 one of tcq2_64's (as q4t2_64's second half), each with tcq's one-byte scale code.
# Storage (22 bytes):
#   d3 d2  qs3[12]  qs2[8]      (the 3-bit stream of values 0..31, then the 2-bit stream of 32..63)
# Fake quantization of SmolLM2's keys at 4096 tokens: 0.0100 KLD against q32_64's 0.0168.
T32_TYPE_SIZE = 22


def t32_quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d3, states3, d2, states2) of the last axis of x (a multiple of 64): [nb] scale codes and [nb, 32] states."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"t32_64: the last dimension {x.shape[-1]} is not a multiple of {QK}")
    b = x.reshape(-1, QK)
    return (*tcq.quantize_blocks(b[:, :HALF], 3, n=HALF), *tcq.quantize_blocks(b[:, HALF:], 2, n=HALF))


def t32_dequantize_blocks(d3, s3, d2, s2) -> np.ndarray:
    """[nb, 64] float32."""
    return np.concatenate([tcq.dequantize_blocks(d3, s3, 3).reshape(-1, HALF),
                           tcq.dequantize_blocks(d2, s2, 2).reshape(-1, HALF)], axis=1)


def t32_roundtrip(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return t32_dequantize_blocks(*t32_quantize_blocks(x)).reshape(x.shape)


def t32_pack(d3, s3, d2, s2) -> bytes:
    nb = s3.shape[0]
    parts = [tcq.scale_bytes_of(d3), tcq.scale_bytes_of(d2),
             tcq.stream(s3, 3), tcq.stream(s2, 2)]
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=1)
    assert out.shape[1] == T32_TYPE_SIZE
    return out.tobytes()


def t32_unpack(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size % T32_TYPE_SIZE:
        raise ValueError(f"t32_64: {a.size} bytes is not a whole number of {T32_TYPE_SIZE}-byte blocks")
    a = a.reshape(-1, T32_TYPE_SIZE)
    d3, d2 = a[:, 0].copy(), a[:, 1].copy()
    return d3, tcq.stream_states(a[:, 2:14], 3, HALF), d2, tcq.stream_states(a[:, 14:22], 2, HALF)


def importance_layout(importance: np.ndarray) -> np.ndarray:
    """Where each rotary pair goes so that q53_64's 5-bit halves get the important ones.

    importance [n_kv, n_pairs] (e.g. the pair's summed F_c * var_c); returns perm [n_kv, n_pairs]
    (position p holds old pair perm[p], NORM order: pair p is channels 2p, 2p+1). Pairs are ranked
    by importance (descending, stable); the first n_pairs/2 fill the 5-bit halves of the head's
    64-blocks in rank order (block 0's first 16 pairs, then block 1's, ...), the rest the 3-bit
    halves. The head size must be a multiple of 64."""
    imp = np.asarray(importance, dtype=np.float64)
    n_kv, n_pairs = imp.shape
    if (2 * n_pairs) % QK:
        raise ValueError(f"q53_64 needs a head size that is a multiple of {QK}, not {2 * n_pairs}")
    ranked = np.argsort(-imp, axis=1, kind="stable")
    per_half = HALF // 2                                   # pairs in a half-block
    n_blocks = 2 * n_pairs // QK
    slots = np.arange(n_pairs).reshape(n_blocks, 2, per_half)
    order = np.concatenate([slots[:, 0].reshape(-1), slots[:, 1].reshape(-1)])   # 5-bit slots first
    perm = np.empty_like(ranked)
    perm[:, order] = ranked
    return perm
