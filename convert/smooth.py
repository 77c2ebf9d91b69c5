"""QK pair smoothing: per-pair scales s (K pair / s, Q pair * s), chosen per layer.

A scale on a rotary pair commutes with RoPE (it is a complex scalar on that
pair), so Q·K is unchanged and the file still runs on stock llama.cpp. Pair
magnitudes survive RoPE, so the statistics are post-RoPE statistics.

The rule (SmoothQuant's balance, per pair j of a KV head):
    s_j = kmax_j^alpha / qmax_j^(1 - alpha)
kmax_j / qmax_j: the largest pair magnitude of K / of the group's Q heads on the
calibration text. s is divided by its geometric mean over the head and rounded
to a power of two, so that scaling stays exact on block-quantized weight rows.
alpha is chosen per layer from a grid by fake quantization: K is quantized to
the target cache type (after K-sort and/or the online Hadamard the runtime will
apply), Q to that type's vec_dot_type (q8_0 or bfp8_32: Q absorbs the scales
and is quantized too), and the alpha with the smallest mean squared error of
the attention scores Q K^T / sqrt(d) wins; alpha = None (no smoothing) is a
candidate, so a layer is never made worse on the calibration sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pykvq.ref import VEC_DOT_TYPE, roundtrip

from .geometry import Geometry, pair_mag, pair_perms_to_channels, pair_rms
from .hadamard import hadamard
from .ksort import pair_order

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def rope_norm(x: np.ndarray, pos: np.ndarray, g: Geometry) -> np.ndarray:
    """NORM-order RoPE of x [T, H, head_dim] at positions pos [T] (float64 angles)."""
    r = g.n_rot_pairs
    freq = np.power(float(g.freq_base), -2.0 * np.arange(r) / g.n_rot)
    if g.rope_freqs is not None:
        freq = freq / np.asarray(g.rope_freqs, np.float64)
    ang = pos[:, None].astype(np.float64) * freq[None, :]            # [T, r]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.astype(np.float32).copy()
    a, b = x[..., 0:2 * r:2], x[..., 1:2 * r:2]
    out[..., 0:2 * r:2] = a * c - b * s
    out[..., 1:2 * r:2] = a * s + b * c
    return out


def pair_maxima(qr: np.ndarray, kr: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """(kmax, qmax) [n_kv, n_pairs]: largest pair magnitude of K and of the group's Q heads."""
    kmax = pair_mag(kr).max(axis=0)
    qmax = pair_mag(qr).reshape(-1, g.n_head_kv, g.group, g.n_pairs).max(axis=(0, 2))
    return kmax, qmax


def fixed_scales(q: np.ndarray, k: np.ndarray, pos: np.ndarray, g: Geometry, alpha: float) -> np.ndarray:
    """One layer's scales for a given alpha, from pre-RoPE calibration q, k (NORM order)."""
    return scales(*pair_maxima(rope_norm(q, pos, g), rope_norm(k, pos, g), g), alpha)


def scales(kmax: np.ndarray, qmax: np.ndarray, alpha: float) -> np.ndarray:
    """Power-of-two pair scales [n_kv, n_pairs] for one layer."""
    eps = 1e-6
    s = np.power(np.maximum(kmax, eps), alpha) / np.power(np.maximum(qmax, eps), 1.0 - alpha)
    s = s / np.exp(np.log(s).mean(axis=1, keepdims=True))
    return np.exp2(np.round(np.log2(s))).astype(np.float32)


def _apply_pairs(x: np.ndarray, s: np.ndarray, ch: np.ndarray | None, mul: bool) -> np.ndarray:
    """x [T, H_kv, G, hd] (NORM) with pair scales s [H_kv, P] applied, then channels permuted
    (ch [H_kv, hd], see geometry.pair_perms_to_channels)."""
    f = np.repeat(s, 2, axis=1)[:, None, :]
    y = x * f if mul else x / f
    if ch is not None:
        y = np.take_along_axis(y, ch[None, :, None, :], axis=3)
    return y


def score_error(q: np.ndarray, k: np.ndarray, s: np.ndarray | None, g: Geometry, k_type: str,
                ksort: bool, rotate: bool) -> float:
    """MSE of the scores after quantization. q [Tq, n_head, hd], k [Tk, n_kv, hd], post-RoPE, NORM."""
    hd, G = g.head_dim, g.group
    q4 = q.reshape(q.shape[0], g.n_head_kv, G, hd)
    k4 = k.reshape(k.shape[0], g.n_head_kv, 1, hd)
    ones = np.ones((g.n_head_kv, g.n_pairs), np.float32)
    s = ones if s is None else s
    ks = _apply_pairs(k4, s, None, mul=False)
    ch = pair_perms_to_channels(pair_order(pair_rms(ks[:, :, 0]), g), g) if ksort else None
    qs, ks = _apply_pairs(q4, s, ch, mul=True), _apply_pairs(k4, s, ch, mul=False)
    if rotate:
        n = hd & -hd                       # the largest power of two dividing hd (upstream's K rotation)
        h = hadamard(n).astype(np.float32)
        qs = (qs.reshape(*qs.shape[:-1], -1, n) @ h).reshape(qs.shape)
        ks = (ks.reshape(*ks.shape[:-1], -1, n) @ h).reshape(ks.shape)
    qq = roundtrip(qs, VEC_DOT_TYPE[k_type])
    kq = roundtrip(ks, k_type)
    ref = np.einsum("qhgd,khd->hgqk", q4, k4[:, :, 0])
    got = np.einsum("qhgd,khd->hgqk", qq, kq[:, :, 0])
    return float(((got - ref) ** 2).mean() / hd)


@dataclass
class LayerChoice:
    alpha: float | None           # None: no smoothing in this layer
    scales: np.ndarray            # [n_kv, n_pairs], ones when alpha is None
    errors: dict                  # alpha (or None) -> score MSE


def choose(q: np.ndarray, k: np.ndarray, pos: np.ndarray, g: Geometry, k_type: str, *, ksort: bool,
           rotate: bool, alphas=ALPHAS, n_query: int = 256, n_key: int = 1024,
           seed: int = 0) -> LayerChoice:
    """Pick one layer's alpha on pre-RoPE calibration q [T, n_head, hd], k [T, n_kv, hd] (NORM order)."""
    qr, kr = rope_norm(q, pos, g), rope_norm(k, pos, g)
    kmax, qmax = pair_maxima(qr, kr, g)
    rng = np.random.default_rng(seed)
    iq = rng.choice(len(q), size=min(n_query, len(q)), replace=False)
    ik = rng.choice(len(k), size=min(n_key, len(k)), replace=False)
    qs, ks = qr[iq], kr[ik]
    errors = {None: score_error(qs, ks, None, g, k_type, ksort, rotate)}
    cands = {None: np.ones((g.n_head_kv, g.n_pairs), np.float32)}
    for a in alphas:
        cands[a] = scales(kmax, qmax, a)
        errors[a] = score_error(qs, ks, cands[a], g, k_type, ksort, rotate)
    best = min(errors, key=lambda a: errors[a])
    return LayerChoice(best, cands[best], errors)
