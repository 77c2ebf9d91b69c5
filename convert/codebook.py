"""Per-layer NUQ codebooks (KVQuant): sensitivity-weighted k-means, Q-Norm, int8.

Values are normalised exactly as the cache quantizer does (pykvq/ref/nuq.py:
v = x * 127 / amax per block, outliers left out), so the codebook lives in
[-127, 127]. Methods:

  uniform  evenly spaced entries (the ablation's starting point)
  kmeans   1-D k-means on the normalised values, every value weighted alike
  fisher   weighted k-means, weight = F * d^2: the diagonal Fisher information of
           the value times its block scale squared, so the objective is
           sum F (x - x')^2, the second-order estimate of the loss increase

Q-Norm then shifts and scales the centroids so that dequantized values have the
mean and standard deviation of the originals (over the calibration set); the
result is rounded to int8, strictly ascending.
"""
from __future__ import annotations

import numpy as np

from pykvq.ref import nuq

METHODS = ("uniform", "kmeans", "fisher")
MAX_SAMPLES = 400_000


def uniform(n_codes: int) -> np.ndarray:
    return np.round(np.linspace(-127, 127, n_codes)).astype(np.int8)


def to_int8(c: np.ndarray) -> np.ndarray:
    """Round centroids to int8 in [-127, 127], strictly ascending (nudging collisions apart)."""
    c = np.clip(np.round(np.sort(np.asarray(c, np.float64))), -127, 127).astype(np.int64)
    for i in range(1, len(c)):
        c[i] = max(c[i], c[i - 1] + 1)
    c[-1] = min(c[-1], 127)
    for i in range(len(c) - 2, -1, -1):
        c[i] = min(c[i], c[i + 1] - 1)
    if c[0] < -127:
        raise ValueError("codebook does not fit in int8")
    return c.astype(np.int8)


def weighted_kmeans(v: np.ndarray, w: np.ndarray, n: int, iters: int = 60,
                    init: np.ndarray | None = None, presorted: bool = False) -> np.ndarray:
    """1-D Lloyd iterations on samples v with weights w (each step lowers sum w (v - c)^2);
    init: given centroids, else weighted quantiles. presorted: v is already in ascending order (w with it)."""
    if not presorted:
        # equal values fall in one cluster whatever their order, so an unstable sort (5x faster) gives the same sums
        order = np.argsort(v)
        v, w = v[order], w[order]
    v, w = v.astype(np.float64), w.astype(np.float64)
    w = w + 1e-30 * (w.sum() == 0)
    cw = np.cumsum(w)
    cwv = np.cumsum(w * v)
    c = np.sort(np.asarray(init, np.float64)) if init is not None else np.interp((np.arange(n) + 0.5) / n * cw[-1], cw, v)
    for _ in range(iters):
        m = (c[1:] + c[:-1]) / 2
        cut = np.searchsorted(v, m, side="right")       # cluster j: v[cut[j-1]:cut[j]]
        lo = np.concatenate([[0], cut])
        hi = np.concatenate([cut, [len(v)]])
        sw = np.where(hi > 0, cw[np.maximum(hi - 1, 0)], 0) - np.where(lo > 0, cw[np.maximum(lo - 1, 0)], 0)
        swv = np.where(hi > 0, cwv[np.maximum(hi - 1, 0)], 0) - np.where(lo > 0, cwv[np.maximum(lo - 1, 0)], 0)
        new = np.where(sw > 0, swv / np.where(sw > 0, sw, 1), c)
        if np.allclose(new, c, atol=1e-4):
            c = new
            break
        c = np.sort(new)
    return c


def samples(x: np.ndarray, fisher: np.ndarray, fmt: str, *, seed: int = 0):
    """(v, weight) of the dense values of x [..., head_dim] under fmt's normalisation."""
    f = nuq.fmt_of(fmt)
    v, d, keep = nuq.normalize(x.reshape(-1), f)
    fw = fisher.reshape(-1, f.block).astype(np.float64) * (d.astype(np.float64)[:, None] ** 2)
    v, fw = v[keep], fw[keep]
    if len(v) > MAX_SAMPLES:
        idx = np.random.default_rng(seed).choice(len(v), MAX_SAMPLES, replace=False)
        v, fw = v[idx], fw[idx]
    return v.astype(np.float32), fw


def qnorm(c: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Centroids c (float) moved so dequantized v has v's mean and std."""
    cq = to_int8(c)
    deq = cq.astype(np.float64)[nuq.assign(v, cq)]
    sd_q, sd_x = deq.std(), v.astype(np.float64).std()
    if sd_q == 0:
        return c
    return (np.asarray(c, np.float64) - deq.mean()) * (sd_x / sd_q) + v.astype(np.float64).mean()


def fit(x: np.ndarray, fisher: np.ndarray, fmt: str, method: str = "fisher", *, q_norm: bool = True) -> np.ndarray:
    """int8 codebook for one layer's K or V samples x (with Fisher weights) and a nuq type."""
    f = nuq.fmt_of(fmt)
    if method not in METHODS:
        raise ValueError(f"codebook method must be one of {METHODS}, got {method!r}")
    if method == "uniform":
        c = uniform(f.n_codes).astype(np.float64)
        v = None
    else:
        v, w = samples(x, fisher, f)
        order = np.argsort(v)
        vs, ws = v[order], w[order]
        # plain k-means first; the Fisher-weighted one starts from it, because the weights are
        # heavy-tailed (a few tokens dominate) and quantile starts end in poor local optima
        c = weighted_kmeans(vs, np.ones_like(ws), f.n_codes, presorted=True)
        if method == "fisher":
            c = weighted_kmeans(vs, ws, f.n_codes, init=c, presorted=True)
    if q_norm:
        if v is None:
            v, _ = samples(x, fisher, f)
        c = qnorm(c, v)
    return to_int8(c)


def roundtrip(x: np.ndarray, type_name: str, cb: np.ndarray | None = None) -> np.ndarray:
    """x as a converted file's cache holds it after quantizing to type_name (q4_0 / q5_0 with least-squares block
    scales: what the runtime writes for a converted file, docs/FORMATS.md)."""
    from pykvq.ref import roundtrip as ref_roundtrip
    from pykvq.ref import q53, tcq
    if type_name in nuq.FORMATS:
        return nuq.roundtrip(x, type_name, cb)
    if type_name in tcq.FORMATS or type_name in q53.TRELLIS_HALVES:
        return library_roundtrip(x, type_name)
    return ref_roundtrip(x, type_name, lsq=True)


def library_roundtrip(x: np.ndarray, type_name: str) -> np.ndarray:
    """x quantized and read back by the built library's reference codec of a pykvq type (ggml's from_float_ref and
    to_float): for the trellis types, whose numpy Viterbi (pykvq/ref/tcq.py, the same bits: tests/test_tcq.py) would
    take minutes over a conversion's samples."""
    from pykvq import cache_types
    from pykvq._lib import ffi, lib
    tr = lib().ggml_get_type_traits(cache_types.resolve(type_name))
    xs = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = ffi.new("uint8_t[]", xs.size // tr.blck_size * tr.type_size)
    tr.from_float_ref(ffi.cast("float *", ffi.from_buffer(xs)), out, xs.size)
    back = np.empty(xs.size, np.float32)
    tr.to_float(out, ffi.cast("float *", ffi.from_buffer(back)), xs.size)
    return back.reshape(np.shape(x))


def weighted_error(x: np.ndarray, fisher: np.ndarray, type_name: str, cb: np.ndarray | None = None) -> float:
    """sum F (x - Q(x))^2 over the samples: the loss-increase estimate of a cache type."""
    return error_of(x, roundtrip(x, type_name, cb), fisher)


def error_of(x: np.ndarray, y: np.ndarray, fisher: np.ndarray) -> float:
    """sum F (x - y)^2: weighted_error of a rounding y already made."""
    return float((fisher.astype(np.float64) * (x.astype(np.float64) - y) ** 2).sum())
