"""Trellis-coded quantization (tcq3_64, tcq2_64, tcq25_64, tcq35_64; tcq3_128, tcq2_128): the reference rule.

A block of 64 values stores a scale d (a one-byte code, below) and k bits per value (k = 3, 2) as a little-endian bit stream, value j's
bits at [kj, kj + k). Value j reads the 8-bit window of the stream that ends with its own bits, [kj + k - 8, kj + k)
taken around the block (tail-biting), as its state s (0..255), and is d * (A[s >> 4] + B[s & 15]) / 4096.

  tcq3_64 (64): d qs[24]   25 B  3.125 bits/value
  tcq2_64 (64): d qs[16]   17 B  2.125 bits/value

d is one byte, a scale code c: the scale is 2^((c - 159)/8) for c = 1..255 (1/8 octave apart, 2^-19.75 .. 2^12; the
float32 of 2^(i/8) times 2^e, SCALE_STEPS below) and 0 for c = 0. A block stores the code nearest its least-squares
scale (step 4; ties to the lower code; codes 0 and 255 take what lies beyond). The same code is the scale of each
trellis half of q4t2_64 / t32_64 (ref/q53.py). Against an f16 scale it costs ~1% of a 2-bit block's squared error and
saves 0.125 bits/value.

tcq25_64 is one trellis whose even values take k = 3 bits and odd values k = 2 (k written (3, 2) below): value j's
bits start at p_j = 5(j // 2) + 3(j % 2) of a 160-bit stream, its state is the 8-bit window [p_j + k_j - 8, p_j + k_j)
around it, and its level reads its parity's own tables A, B (TABLES[(3, 2)]: the even values' 32, then the odd
values'). Every rule below holds with k_j in place of k (the overlap o and the tail-biting ends take k_0 = 3):

  tcq25_64 (64): d qs[20]   21 B  2.625 bits/value

One path shares its bits across both parities, so on unit Gaussian blocks it reads back with 0.82x the squared error
of tcq3_64 and tcq2_64 in equal parts (the same bits). tcq35_64 is the same with k = 4 and 3 by turns
(TABLES[(4, 3)]; p_j = 7(j // 2) + 4(j % 2), a 224-bit stream; 0.79x tcq3_64 and nuq4 mixed to its bits):

  tcq35_64 (64): d qs[28]   29 B  3.625 bits/value

tcq3_128 / tcq2_128 hold a head row of 128 as two such runs of 64 (each its own tail-biting path and stream) under one
f16 scale (two bytes, unlike tcq*_64's code): the step 1 and 4 sums below run over all 128 values, steps 2-3 over each
run. The online Hadamard spreads
a 128-wide head evenly, so one scale serves both runs and 2 bytes per 128 values are saved (0.125 bits/value):

  tcq3_128 (128): d[2] qs[48]   50 B  3.125 bits/value
  tcq2_128 (128): d[2] qs[32]   34 B  2.125 bits/value

A state is the last 8 bits written, so state_j = (b_j << (8 - k)) | (state_{j-1} >> k): the levels a value can take
depend on the bits before it, and the encoder searches the whole block's path (Viterbi, 256 states x 64 steps) for the
least squared error. Encoding (native/ggml/tcq.c is held to this bit for bit):

1. v = x with NaN as 0 and +-inf as +-FLT_MAX; r2 = sum of v^2 (double, in order). r2 == 0: d = 0, every bit 0.
2. z = v * inv in float32, inv = float32(min(1 / sqrt(r2 / 64), FLT_MAX)) (unit RMS).
3. A free path (any start and end) over z read from index 32 on (around the block) names the overlap
   o = (the state of value 63 on it) >> k; the tail-biting path then starts in a state whose low 8 - k bits are o and
   ends in one whose high 8 - k bits are o. Costs are float32: cost_j(s) = min over the predecessors
   ((s << k) & 255) | i, i = 0 .. 2^k - 1 (the first of equals), plus (z_j - level(s))^2, the square rounded before
   the sum; the end state is the first of the least cost.
4. d = clip(sum v*y / sum y*y, +-65504) over the path's levels y (double sums in order), stored as its scale code
   (tcq*_64, the halves) or float16(d) (tcq*_128), and b_j = state_j >> (8 - k).
"""
from __future__ import annotations

import numpy as np

N = 64
STATES = 256
FLT_MAX = np.float32(np.finfo(np.float32).max)

# A[16] then B[16], in 1/4096 (native/ggml/tcq.c; scripts/tcq_tables.py trains them)
TABLES = {
    3: (354, -4187, -4449, 504, -1710, 3336, 1481, -7124, -2373, -771, 2696, 5536, -620, 1846, 6706, -2411,
        -4845, 1112, 2426, -2751, -769, 539, 3647, -1898, 1858, -318, 4712, -3977, -1802, 832, 3421, -2188),
    2: (2008, -4882, 2839, -2797, -1357, 1043, -6090, 6235, 5043, 962, 305, -113, -3288, -2157, 220, 2979,
        933, 2483, -2738, -5195, 4052, -1380, -1332, 1487, -991, 4290, 1273, -3988, 345, -368, 4341, -3213),
    (3, 2): (3196, -5611, 1048, -2035, -788, 1185, -5480, 5265, 6343, 242, 901, 3265, -3876, -2032, -1886, 1664,
             -111, 2888, -2664, -5549, 3494, -609, -3367, 1462, -1338, 5302, 1151, -1839, -698, 1522, 3740, -3384,
             -5669, 1310, 3975, -84, 2907, 2140, 659, 4370, 173, -2328, -2159, 2346, -1466, 6215, -4335, -2033,
             -525, 1093, -4629, 4090, 5911, 700, -1778, 2765, -4014, 2552, 573, -2219, -5629, -49, -1808, 2967),
    (4, 3): (2633, -4669, -510, -2422, 338, -628, -6672, 6218, 3957, -1037, 508, 1875, -1940, -3117, 1622, 1103,
             -125, 2289, -2114, -4572, 4312, -1195, 292, 1027, -1461, 5288, -90, -5253, 1390, 347, 2808, -2943,
             -5415, 727, 4287, 1932, 2463, -359, 1031, 5514, -337, -1825, -1585, 641, 887, 3089, -2906, -2413,
             -1106, 906, -1567, 2995, 4150, 1534, -391, 6581, -6332, 281, -467, -2429, -4218, 375, -2746, 2435),
}
FORMATS = {"tcq3_64": 3, "tcq2_64": 2, "tcq3_128": 3, "tcq2_128": 2, "tcq25_64": (3, 2), "tcq35_64": (4, 3)}
SCALE_BYTES = {"tcq3_64": 1, "tcq2_64": 1, "tcq3_128": 2, "tcq2_128": 2, "tcq25_64": 1, "tcq35_64": 1}   # a code byte, or f16
SCALE_BIAS = 159
# the float32 bits of 2^(i/8), i = 0..7 (native/include/ggml-kvq.h's ggml_kvq_tcq_scale)
SCALE_STEPS = np.array([0x3f800000, 0x3f8b95c2, 0x3f9837f0, 0x3fa5fed7, 0x3fb504f3, 0x3fc5672a, 0x3fd744fd,
                        0x3feac0c7], np.uint32).view(np.float32)


def scales() -> np.ndarray:
    """float32 [256]: the scale of each code."""
    e = np.arange(256) - SCALE_BIAS
    t = np.ldexp(SCALE_STEPS[e % 8], e // 8).astype(np.float32)
    t[0] = 0
    return t


def scale_codes(d: np.ndarray) -> np.ndarray:
    """The code nearest each scale d (float64; <= 0 or NaN: code 0), ties to the lower code."""
    t = scales().astype(np.float64)
    d = np.asarray(d, np.float64)
    hi = np.clip(np.searchsorted(t, d, side="left"), 1, 255)
    lo = hi - 1
    c = np.where(d - t[lo] <= t[hi] - d, lo, hi)
    c = np.where(d >= t[255], 255, c)
    return np.where(d > 0, c, 0).astype(np.uint8)


def scale_values(d: np.ndarray) -> np.ndarray:
    """float32 scales of stored d: codes (uint8) or float16."""
    d = np.asarray(d)
    return scales()[d] if d.dtype == np.uint8 else d.astype(np.float32)
BLOCK = {"tcq3_64": 64, "tcq2_64": 64, "tcq3_128": 128, "tcq2_128": 128, "tcq25_64": 64, "tcq35_64": 64}     # values under one scale (runs of 64)


def bits_of(type_name: str) -> int:
    return FORMATS[type_name]


def block_bytes(k, n: int = N, scale_bytes: int = 1) -> int:
    return scale_bytes + stream_bits(k, n) // 8


def levels(k, tables=None) -> np.ndarray:
    """level(s) for every state s, float32 (exact: integers over 4096): [256], or [2, 256] for tcq25_64 / tcq35_64 (their
    even values' table, then their odd values')."""
    t = np.asarray(TABLES[k] if tables is None else tables, np.int64).reshape(-1, 32)
    s = np.arange(STATES)
    lv = (t[:, s >> 4] + t[:, 16 + (s & 15)]).astype(np.float32) * np.float32(1 / 4096)
    return lv if isinstance(k, tuple) else lv[0]


def steps(k, n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """(k_j, p_j) [n]: each value's bits and where they start in its run's stream. k is an int, or (k_even, k_odd)
    for tcq25_64's / tcq35_64's alternating steps."""
    ks = np.array([k[j % 2] for j in range(n)] if isinstance(k, tuple) else [k] * n, np.int64)
    return ks, np.concatenate([[0], np.cumsum(ks)[:-1]]).astype(np.int64)


def stream_bits(k, n: int = N) -> int:
    return int(steps(k, n)[0].sum())


def step_levels(k, lut: np.ndarray, n: int) -> np.ndarray:
    """[n, 256]: the levels each value of a run reads (one table, or one per parity)."""
    lut = np.asarray(lut)
    return np.stack([lut[j % 2] if lut.ndim == 2 else lut for j in range(n)])


def viterbi(z: np.ndarray, k, lut: np.ndarray, o: np.ndarray | None, rot: int) -> np.ndarray:
    """z [n, 64] float32 -> states [n, 64] of the least-cost paths (step 3), reading z from index rot on (even); o
    [n]: the tail-biting overlap of each block, or None for a free path. (Other block lengths than 64 run the same
    rule.)"""
    n, N = z.shape
    ks = steps(k, N)[0]
    lv = step_levels(k, lut, N)
    s = np.arange(STATES)
    zz = np.roll(z, -rot, axis=1)
    ks, lv = np.roll(ks, -rot), np.roll(lv, -rot, axis=0)
    e = zz[:, 0, None] - lv[0][None, :]
    cost = (e * e).astype(np.float32)
    if o is not None:
        cost = np.where((s[None, :] & ((1 << (8 - ks[0])) - 1)) == o[:, None], cost, np.float32(np.inf))
    bp = np.empty((N, n, STATES), np.uint8)
    for i in range(1, N):
        K, ml = 1 << ks[i], (1 << (8 - ks[i])) - 1
        g = cost.reshape(n, ml + 1, K)
        arg = g.argmin(axis=2)                           # the first of equals
        minc = np.take_along_axis(g, arg[..., None], 2)[..., 0]
        e = zz[:, i, None] - lv[i][None, :]
        cost = minc[:, s & ml] + (e * e).astype(np.float32)
        bp[i] = arg[:, s & ml]
    if o is not None:
        cost = np.where((s[None, :] >> ks[0]) == o[:, None], cost, np.float32(np.inf))
    st = np.empty((n, N), np.int64)
    cur = cost.argmin(axis=1)
    rows = np.arange(n)
    st[:, N - 1] = cur
    for i in range(N - 1, 0, -1):
        cur = ((cur << ks[i]) & 0xFF) | bp[i][rows, cur]
        st[:, i - 1] = cur
    return st


def quantize_blocks(x: np.ndarray, k: int, tables=None, n: int = N, run: int | None = None, scale_bytes: int = 1
                    ) -> tuple[np.ndarray, np.ndarray]:
    """x [m*n] -> (d [m], states [m, n]): blocks of n values (64; q4t2_64's trellis half: 32; tcq*_128: 128)
    under one scale, each run of `run` values (default n) its own tail-biting path; d the scale codes (uint8) or, with
    scale_bytes=2, float16."""
    run = n if run is None else run
    v = np.asarray(x, np.float32).reshape(-1, n)
    v = np.where(np.isnan(v), np.float32(0), np.clip(v, -FLT_MAX, FLT_MAX)).astype(np.float32)
    vd = v.astype(np.float64)
    r2 = np.zeros(len(v))
    for j in range(n):                                   # in order, as the C reference sums
        r2 += vd[:, j] * vd[:, j]
    live = r2 > 0
    lut = levels(k, tables)
    d = np.zeros(len(v), np.uint8 if scale_bytes == 1 else np.float16)
    st = np.zeros((len(v), n), np.int64)
    if live.any():
        vl = v[live]
        inv = np.minimum(1.0 / np.sqrt(r2[live] / n), float(FLT_MAX)).astype(np.float32)
        z = (vl * inv[:, None]).astype(np.float32).reshape(-1, run)
        free = viterbi(z, k, lut, None, run // 2)
        path = viterbi(z, k, lut, free[:, run // 2 - 1] >> steps(k, run)[0][0], 0).reshape(-1, n)
        y = read(k, lut, path).astype(np.float64)
        vd = vl.astype(np.float64)
        xy = np.zeros(len(vl))
        yy = np.zeros(len(vl))
        for j in range(n):
            xy += vd[:, j] * y[:, j]
            yy += y[:, j] * y[:, j]
        dd = np.where(yy > 0, np.clip(xy / np.where(yy > 0, yy, 1), -65504.0, 65504.0), 0.0)
        d[live] = scale_codes(dd) if scale_bytes == 1 else dd.astype(np.float32).astype(np.float16)
        st[live] = path
    return d, st


def read(k, lut: np.ndarray, st: np.ndarray) -> np.ndarray:
    """The levels of states st [m, n] (runs of 64 for tcq25_64's parities)."""
    lv = step_levels(k, lut, st.shape[1])
    return lv[np.arange(st.shape[1])[None, :], st]


def dequantize_blocks(d: np.ndarray, st: np.ndarray, k, tables=None) -> np.ndarray:
    return (scale_values(d)[:, None] * read(k, levels(k, tables), st)).reshape(-1)


def scale_bytes_of(d: np.ndarray) -> np.ndarray:
    """[m, 1] codes or [m, 2] little-endian f16 bytes."""
    d = np.asarray(d)
    return d.reshape(-1, 1) if d.dtype == np.uint8 else d.astype("<f2").view(np.uint8).reshape(-1, 2)


def pack(d: np.ndarray, st: np.ndarray, k: int) -> bytes:
    """The blocks' bytes: d (its code, or f16 little-endian), then the k-bit stream of b_j = state_j >> (8 - k)."""
    out = np.concatenate([scale_bytes_of(d), stream(st, k)], axis=1)
    return out.tobytes()


def stream(st: np.ndarray, k) -> np.ndarray:
    """states [m, n] -> [m, n*k/8] uint8: the stream of b_j = state_j >> (8 - k_j), little-endian, value j's k_j
    bits from p_j on."""
    ks, p = steps(k, st.shape[1])
    bits = np.zeros((len(st), int(ks.sum())), np.uint8)
    for j in range(st.shape[1]):
        b = st[:, j] >> (8 - ks[j])
        for i in range(ks[j]):
            bits[:, p[j] + i] = (b >> i) & 1                          # bit p_j + i = bit i of b_j
    return np.packbits(bits, axis=1, bitorder="little")


def unpack(raw: bytes, k: int, n: int = N, run: int | None = None, scale_bytes: int = 1
           ) -> tuple[np.ndarray, np.ndarray]:
    """(d, states) of packed blocks of n values, each state read as its window of its run's stream around the run."""
    run = n if run is None else run
    a = np.frombuffer(raw, np.uint8).reshape(-1, block_bytes(k, n, scale_bytes))
    d = a[:, 0].copy() if scale_bytes == 1 else a[:, :2].copy().view("<f2").reshape(-1)
    qs = np.ascontiguousarray(a[:, scale_bytes:]).reshape(-1, stream_bits(k, run) // 8)
    return d, stream_states(qs, k, run).reshape(-1, n)


def stream_states(qs: np.ndarray, k: int, n: int = N) -> np.ndarray:
    """qs [m, n*k/8] uint8 streams -> states [m, n]: each value's 8-bit window of its stream, around the block."""
    bits = np.unpackbits(qs, axis=1, bitorder="little").astype(np.int64)          # [m, nk]
    ks, p = steps(k, n)
    pos = ((p + ks)[:, None] - 8 + np.arange(8)[None, :]) % int(ks.sum())          # window bits, low first
    return (bits[:, pos] << np.arange(8)).sum(axis=2)


def roundtrip(x: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize and dequantize the last axis of x (a multiple of the type's block: 64, or 128 for tcq*_128)."""
    k, n = bits_of(type_name), BLOCK[type_name]
    d, st = quantize_blocks(np.asarray(x, np.float32).reshape(-1), k, n=n, run=N, scale_bytes=SCALE_BYTES[type_name])
    return dequantize_blocks(d, st, k).reshape(np.shape(x))
