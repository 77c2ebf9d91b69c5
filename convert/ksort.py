"""K-sort at rotary-pair granularity (Trukhanov & Soloveychik, Algorithm 1).

Per layer and KV head, pairs are sorted by a magnitude key (ascending), so a
32- or 64-channel block of the K cache holds pairs of similar size and its
shared scale fits them all. Rotary pairs are sorted among themselves (each
carries its frequency with it); non-rotary pairs among themselves.

A pair moved from frequency index pi[p] to position p must still rotate at
freq_base^(-2 pi[p]/n_rot). ggml's rope computes pos * freq_base^(-2p/n_rot) / ff[p],
so the per-layer, per-KV-head factor tensor is
    ff[h, p] = rope_freqs[pi[p]] * freq_base^(2 (pi[p] - p) / n_rot)
(rope_freqs: the model's own divisors, 1 when it has none).
"""
from __future__ import annotations

import numpy as np

from .geometry import Geometry, pair_channels


def pair_order(key: np.ndarray, g: Geometry) -> np.ndarray:
    """[n_kv, n_pairs] pair permutation (position p holds old pair perm[p]),
    ascending in key, stable, rotary and non-rotary pairs kept apart."""
    key = np.asarray(key, dtype=np.float64)
    r = g.n_rot_pairs
    rot = np.argsort(key[:, :r], axis=1, kind="stable")
    rest = r + np.argsort(key[:, r:], axis=1, kind="stable")
    return np.concatenate([rot, rest], axis=1).astype(np.int64)


def freq_factors(perm: np.ndarray, g: Geometry) -> np.ndarray:
    """[n_kv, n_rot/2] float32 divisors for the patched rope."""
    r = g.n_rot_pairs
    src = perm[:, :r].astype(np.float64)
    p = np.arange(r, dtype=np.float64)[None, :]
    ff = np.power(float(g.freq_base), 2.0 * (src - p) / g.n_rot)
    if g.rope_freqs is not None:
        ff = ff * np.asarray(g.rope_freqs, dtype=np.float64)[perm[:, :r]]
    return ff.astype(np.float32)


def weight_key(wk: np.ndarray, g: Geometry, layout: str = "norm") -> np.ndarray:
    """The paper's sort key at pair level: the norm of the pair's two W_k rows,
    [n_kv, n_pairs], from the f32 weight [n_kv*head_dim, n_embd]."""
    ch = pair_channels(g, layout)
    w = wk.reshape(g.n_head_kv, g.head_dim, -1)
    sq = (w.astype(np.float64) ** 2).sum(axis=2)                 # [n_kv, head_dim]
    return np.sqrt(sq[:, ch[:, 0]] + sq[:, ch[:, 1]])
