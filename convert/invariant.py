"""Bake invertible transforms of the cached K and V into the attention weights (numpy, f32/f64).

V: for any invertible A per KV head, v' = A v is what the cache holds, and each
query head's output o' = A o is undone in W_o: W_v <- A W_v, b_v <- A b_v,
W_o[:, head] <- W_o[:, head] A^-1 for every query head of the group (query head
h reads KV head h // group, as llama.cpp broadcasts).

K under RoPE: a map commutes with every rotary rotation only if it acts on each
pair as a complex number, a scale and an in-pair angle. With
k_pair <- e^-l R(phi) k_pair and q_pair <- e^l R(phi) q_pair (same l, phi for
the group's query heads) q.k is unchanged at every pair of positions, because
2-D rotations commute: (R_m R_phi q)^T (R_n R_phi k) = q^T R_(n-m) k.
"""
from __future__ import annotations

import numpy as np

from .geometry import Geometry, pair_channels


def bake_v(wv: np.ndarray, bv: np.ndarray | None, wo: np.ndarray, a: np.ndarray, a_inv: np.ndarray,
           n_head: int, n_head_kv: int, head_dim: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(W_v', b_v', W_o') for f32 W_v [n_kv*hd, n_embd], W_o [n_embd, n_head*hd] and A, A^-1 [n_kv, hd, hd]."""
    group = n_head // n_head_kv
    a, a_inv = np.asarray(a, np.float64), np.asarray(a_inv, np.float64)
    wv2 = np.einsum("hij,hjc->hic", a, wv.reshape(n_head_kv, head_dim, -1).astype(np.float64))
    bv2 = None if bv is None else np.einsum("hij,hj->hi", a, bv.reshape(n_head_kv, head_dim).astype(np.float64))
    per_q = np.repeat(a_inv, group, axis=0)                                   # [n_head, hd, hd]
    wo2 = np.einsum("rhj,hjk->rhk", wo.reshape(wo.shape[0], n_head, head_dim).astype(np.float64), per_q)
    return (wv2.reshape(wv.shape).astype(np.float32),
            None if bv2 is None else bv2.reshape(-1).astype(np.float32),
            wo2.reshape(wo.shape).astype(np.float32))


def pair_transform(x: np.ndarray, log_scale: np.ndarray, angle: np.ndarray, sign: float) -> np.ndarray:
    """NORM-order activations x [..., H, hd] with pair p (channels 2p, 2p+1) mapped to
    e^(sign*l) R(phi) pair; log_scale, angle [H, hd/2] broadcast over the leading axes."""
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    f = np.exp(sign * log_scale)
    c, s = np.cos(angle), np.sin(angle)
    out = np.empty(x.shape, np.float64)
    out[..., 0::2] = f * (c * a - s * b)
    out[..., 1::2] = f * (s * a + c * b)
    return out.astype(np.float32)


def bake_pairs(w: np.ndarray, log_scale: np.ndarray, angle: np.ndarray, sign: float, g: Geometry,
               n_heads: int) -> np.ndarray:
    """Rows of W_q / W_k ([n_heads*hd, n_embd], or a bias [n_heads*hd]) in the file's layout, with
    each head's pairs transformed like pair_transform; log_scale, angle are per KV head [n_kv, hd/2]."""
    reps = n_heads // g.n_head_kv
    ch = pair_channels(g)                                                      # [P, 2] in the file's layout
    x = np.asarray(w, np.float64).reshape(n_heads, g.head_dim, -1)
    l, phi = np.repeat(log_scale, reps, axis=0)[..., None], np.repeat(angle, reps, axis=0)[..., None]
    a, b = x[:, ch[:, 0]], x[:, ch[:, 1]]
    f, c, s = np.exp(sign * l), np.cos(phi), np.sin(phi)
    out = x.copy()
    out[:, ch[:, 0]] = f * (c * a - s * b)
    out[:, ch[:, 1]] = f * (s * a + c * b)
    return out.reshape(np.shape(w)).astype(np.float32)
