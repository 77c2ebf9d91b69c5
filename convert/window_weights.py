"""What the exact window leaves of each calibration token's cache error (issue 40).

A pre-RoPE file's runtime reads key s exactly (f16) when s is a sink (s < S) or is in query t's recent window
(t - s < W); every other read sees the quantized cell. The budget's errors (layer_types, sum F (x - Q(x))^2) weigh
every token alike, so a layer whose heads look mostly at recent tokens and the sinks, whose errors the window takes
away, competes for bits with a layer whose heads read far back. These weights say, per token and KV head, how much
of its error survives the window, from the attention it receives on the calibration text:

- keys: the attention mass the token gets from queries that read it quantized (a key error d moves query t's scores
  by q.d, whose effect on the attention distribution, KL to second order, is sum_s p_ts (q_t.d_s)^2 / 2 up to the
  mean shift: linear in p);
- values: the sum of squared attention from those queries (independent errors e_s reach query t's output as
  sum_s p_ts e_s, of variance sum_s p_ts^2 |e_s|^2).

Each is divided by its mean over the layer's tokens and heads without a window, so with no window and no sinks the
mean weight is 1 (the uniform errors the allocator used so far) and a window lowers each layer's mean by the share
of those reads it makes exact.
"""
from __future__ import annotations

import numpy as np

from .geometry import Geometry
from .learn_v import sequences
from .smooth import rope_norm


def _received(qr: np.ndarray, kr: np.ndarray, g: Geometry, quantized: np.ndarray) -> tuple[np.ndarray, ...]:
    """For one sequence's post-RoPE q [T, n_head, hd], k [T, n_kv, hd] and the mask of quantized reads [T(query),
    T(key)]: per key and KV head [T, n_kv] the attention mass and squared mass received, in all and from quantized
    reads (float64)."""
    t = qr.shape[0]
    causal = np.arange(t)[None, :] > np.arange(t)[:, None]
    out = [np.zeros((t, g.n_head_kv)) for _ in range(4)]
    for h in range(g.n_head):               # one head at a time: a [T, T] score matrix
        kv = h // g.group
        s = (qr[:, h].astype(np.float64) @ kr[:, kv].astype(np.float64).T) / np.sqrt(g.head_dim)
        s[causal] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p2 = p * p
        for o, a in zip(out, (p, p2, p * quantized, p2 * quantized)):
            o[:, kv] += a.sum(axis=0) / g.group
    return tuple(out)


def read_weights(q: np.ndarray, k: np.ndarray, pos: np.ndarray, g: Geometry, sinks: int,
                 window: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values): float32 [T, n_kv] weights of one layer's calibration tokens, from its pre-RoPE NORM-order q
    [T, n_head, hd] and k [T, n_kv, hd] at positions pos [T] (sequences start at 0)."""
    mass_all = sq_all = 0.0
    wk, wv = np.zeros(k.shape[:2]), np.zeros(k.shape[:2])
    for sl in sequences(pos):
        p = pos[sl]
        qd = p[:, None] - p[None, :]                        # query - key distance
        quantized = (qd >= window) & (p[None, :] >= sinks)
        mass, sq, mass_q, sq_q = _received(rope_norm(q[sl], p, g), rope_norm(k[sl], p, g), g, quantized)
        wk[sl], wv[sl] = mass_q, sq_q
        mass_all, sq_all = mass_all + mass.sum(), sq_all + sq.sum()
    n = wk.size
    return (wk * n / max(mass_all, 1e-30)).astype(np.float32), (wv * n / max(sq_all, 1e-30)).astype(np.float32)
