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
from .learn_v import attention_probs, sequences


def read_exactly(t, s, sinks: int, window: int):
    """Whether query position t reads key position s from the window's f16 rows (numpy or torch, broadcast): the
    runtime's rule (native/llama/llama-kvq-window.cpp), shared with calib.py's backward pass."""
    return (s < sinks) | (t - s < window)


def read_weights(q: np.ndarray, k: np.ndarray, pos: np.ndarray, g: Geometry, sinks: int,
                 window: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values): float32 [T, n_kv] weights of one layer's calibration tokens, from its pre-RoPE NORM-order q
    [T, n_head, hd] and k [T, n_kv, hd] at positions pos [T] (sequences start at 0)."""
    mass_all = sq_all = 0.0
    wk, wv = np.zeros(k.shape[:2]), np.zeros(k.shape[:2])
    for sl in sequences(pos):
        p = pos[sl]
        # [n_kv, group, query, key]: every query of the sequence (causal: zero above the diagonal)
        a = attention_probs(q[sl], k[sl], p, g, len(p)).astype(np.float64).reshape(g.n_head_kv, g.group, len(p), -1)
        quantized = ~read_exactly(p[:, None], p[None, :], sinks, window)
        a2 = a * a
        wk[sl] = (a * quantized).sum(axis=(1, 2)).T / g.group
        wv[sl] = (a2 * quantized).sum(axis=(1, 2)).T / g.group
        mass_all, sq_all = mass_all + a.sum() / g.group, sq_all + a2.sum() / g.group
    n = wk.size
    return (wk * n / max(mass_all, 1e-30)).astype(np.float32), (wv * n / max(sq_all, 1e-30)).astype(np.float32)
