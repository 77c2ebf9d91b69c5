"""Calibration K and V as the runtime's cache will hold them, with their Fisher weights.

The cache stores post-RoPE K in the file's channel order, after the baked
transforms (pair smoothing K/s, K-sort's channel permutation, the V Hadamard)
and, when the runtime rotates online (upstream's attn_rot: quantized cache,
not undone by a baked transform), multiplied by a Sylvester Hadamard per
block of `nrot` channels. Codebooks must be fitted to exactly those numbers.

With a pre-RoPE key cache (--prerope-k, convert/prerope.py) K is taken before
RoPE, goes through the same baked transforms and layout, and is then centred
and scaled per layer, KV head and channel: c = (k - mean) / scale, then turned
by the online Hadamard when the runtime rotates K (it undoes that per K tile).

Each value comes with the diagonal Fisher information F = (dL/dx)^2 of the
LM loss w.r.t. the cached value. The gradient follows each map x -> M x as
g -> M^-T g: rotations R map g to R g, x/s maps g to g*s, a learned V
transform A maps g to A^-T g. RoPE is orthogonal (g_post = R g_pre); the
pre-RoPE centring x -> (x - mean)/scale maps g to g*scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pykvq.ref.prerope import block_rotate

from .calib import Calib
from .geometry import Geometry, pair_channels
from .hadamard import hadamard
from .invariant import pair_transform
from .smooth import rope_norm


@dataclass
class CacheSamples:
    x: np.ndarray     # [T, n_kv, head_dim] float32, the values the cache quantizes
    fisher: np.ndarray  # same shape, (dL/dx)^2


@dataclass(frozen=True)
class Domain:
    """How one layer's K and V reach the cache (from the converter's choices)."""
    k_scale: np.ndarray | None = None     # [n_kv, n_pairs] smoothing scales s (K/s)
    k_angle: np.ndarray | None = None     # [n_kv, n_pairs] learned in-pair angles (K pair turned by phi)
    k_perm: np.ndarray | None = None      # [n_kv, head_dim] K-sort channel permutation (NORM order)
    layout: str = "norm"                  # channel order of the cache: "norm" or "neox"
    rotate_v: bool = False                # baked per-head Hadamard on V
    rot_k: bool = False                   # online Hadamard on K (largest power of two dividing head_dim)
    rot_k_halves: bool = False            # ... within each 32-value half of its blocks (halves K types)
    rot_v: bool = False                   # online Hadamard on V (blocks of rot_v_size)
    rot_v_size: int = 64                  # upstream's 64; 128 with a tcq*_128 V type (llama_kvq_v_rot_size)
    v_matrix: tuple | None = None         # learned V transform (A, A^-1), each [n_kv, hd, hd]
    k_prerope: bool = False               # K cached before RoPE (k_mean / k_div below; then rot_k if on)
    k_mean: np.ndarray | None = None      # [n_kv, head_dim] pre-RoPE mean in the cache's layout
    k_div: np.ndarray | None = None       # [n_kv, head_dim] pre-RoPE scale: the cache holds (k - mean) / k_div


HALF = 32       # LLAMA_KVQ_K_ROT_MIN: a halves block's half


def online_rot_k_size(head_dim: int) -> int:
    return head_dim & -head_dim


def online_rot_k(head_dim: int, halves: bool) -> tuple[int, int]:
    """(size, left-out butterfly stride) of the runtime's online K Hadamard (llama_kvq_new_k_rot_tensor): with any
    halves K layer (q53_64, q42_64) it never mixes the halves: 32 wide for a 64-wide rotation, wider ones without
    their stride-32 butterfly."""
    n = online_rot_k_size(head_dim)
    if not halves:
        return n, 0
    return (min(n, HALF), 0) if n <= 2 * HALF else (n, HALF)


def _pairs_scale(x: np.ndarray, s: np.ndarray, mul: bool) -> np.ndarray:
    f = np.repeat(s, 2, axis=1)[None]            # NORM order: pair p is channels 2p, 2p+1
    return x * f if mul else x / f


def _block_rotate(x: np.ndarray, n: int) -> np.ndarray:
    h = hadamard(n).astype(np.float32)
    return (x.reshape(*x.shape[:-1], -1, n) @ h).reshape(x.shape)


def norm_to_layout(x: np.ndarray, g: Geometry, layout: str) -> np.ndarray:
    if layout == "norm":
        return x
    src, dst = pair_channels(g, "norm"), pair_channels(g, layout)
    out = np.empty_like(x)
    out[..., dst[:, 0]] = x[..., src[:, 0]]
    out[..., dst[:, 1]] = x[..., src[:, 1]]
    return out


def _k_baked(x: np.ndarray, g: Geometry, d: Domain, grad: bool) -> np.ndarray:
    """NORM-order K (or its gradient, grad=True) through the baked pair transforms, K-sort and layout."""
    if d.k_angle is not None:                   # a rotation: gradients turn the same way
        x = pair_transform(x, np.zeros_like(d.k_angle), d.k_angle, 1.0)
    if d.k_scale is not None:
        x = _pairs_scale(x, d.k_scale, mul=grad)
    if d.k_perm is not None:
        x = np.take_along_axis(x, d.k_perm[None], axis=2)
    return norm_to_layout(x, g, d.layout)


def prerope_keys(c: Calib, layer: int, g: Geometry, d: Domain) -> np.ndarray:
    """[T, n_kv, head_dim] float32: the input of the runtime's K RoPE op (attn_k output plus bias) in the
    file's layout, after the baked transforms; what the pre-RoPE mean and scale are measured on."""
    return _k_baked(c.k[layer], g, d, grad=False).astype(np.float32)


def prerope_key_fisher(c: Calib, layer: int, g: Geometry, d: Domain) -> np.ndarray:
    """[n_kv, head_dim] float64: the diagonal Fisher E[(dL/dk)^2] of prerope_keys' channels (its gradients
    through the same baked transforms)."""
    return (_k_baked(c.gk[layer], g, d, grad=True).astype(np.float64) ** 2).mean(axis=0)


def prerope_key_moments(c: Calib, layer: int, g: Geometry, d: Domain) -> tuple[np.ndarray, ...]:
    """(mean, std, absmax around the mean, Fisher), each float64 [n_kv, head_dim], of prerope_keys' channels:
    from the samples when calibration kept them, else from the runtime's moments (calib.KeyMoments) through the
    same baked transforms, which act per channel (a positive scale, a permutation, the layout). The Fisher is
    the gradients' when calibration took them (backprop), else the runtime's forward estimate."""
    km = c.km[layer] if c.km is not None else None
    if c.k is not None:
        kp = prerope_keys(c, layer, g, d).astype(np.float64)
        mean = kp.mean(axis=0)
        std, absmax = kp.std(axis=0), np.abs(kp - mean).max(axis=0)
    else:
        if d.k_angle is not None:
            raise ValueError("a learned pair angle needs calibration samples, not moments")
        mean = _k_baked(km.mean[None], g, d, grad=False)[0]
        std = _k_baked(np.sqrt(np.maximum(km.sq - km.mean ** 2, 0.0))[None], g, d, grad=False)[0]
        absmax = _k_baked(np.maximum(km.hi - km.mean, km.mean - km.lo)[None], g, d, grad=False)[0]
    if c.gk is not None and c.sensitivity == "backprop":
        fisher = prerope_key_fisher(c, layer, g, d)
    elif km is not None:
        fisher = _k_baked(np.sqrt(km.fisher)[None], g, d, grad=True)[0].astype(np.float64) ** 2
    else:
        fisher = None
    return mean, std, absmax, fisher


def prerope_query_mean(c: Calib, layer: int, g: Geometry, d: Domain) -> np.ndarray | None:
    """[n_kv, head_dim] float32: the mean pre-RoPE query summed over each KV head's group, in prerope_keys' channels
    (the baked transforms act on queries as on the keys' gradients, so q.k is kept), or None without query
    statistics. Its dot product with a key is the key's mean score before RoPE: the runtime's heavy-hitter score."""
    km = c.km[layer] if c.km is not None else None
    if c.q is not None:
        qm = c.q[layer].astype(np.float64).mean(axis=0)
    elif km is not None and km.q_mean is not None:
        qm = np.asarray(km.q_mean, np.float64)
    else:
        return None
    qg = qm.reshape(g.n_head_kv, g.group, g.head_dim).sum(axis=1)
    return _k_baked(qg[None], g, d, grad=True)[0].astype(np.float32)


def keys(c: Calib, layer: int, g: Geometry, d: Domain) -> CacheSamples:
    if d.k_prerope:
        if d.k_mean is None or d.k_div is None:
            raise ValueError("a pre-RoPE key domain needs its mean and scale")
        k, gk = c.k[layer], c.gk[layer]
    else:
        k = rope_norm(c.k[layer], c.pos, g)
        gk = rope_norm(c.gk[layer], c.pos, g)       # g_post = R g_pre (R orthogonal)
    k, gk = _k_baked(k, g, d, grad=False), _k_baked(gk, g, d, grad=True)
    if d.k_prerope:                                 # x = c*scale + mean: dL/dc = dL/dx * scale
        k = (k.astype(np.float64) - d.k_mean[None]) / d.k_div[None]
        gk = gk.astype(np.float64) * d.k_div[None]
    if d.rot_k:
        n, skip = online_rot_k(g.head_dim, d.rot_k_halves)
        k, gk = block_rotate(k, n, skip), block_rotate(gk, n, skip)
    return CacheSamples(k.astype(np.float32), (gk.astype(np.float64) ** 2).astype(np.float32))


def values(c: Calib, layer: int, g: Geometry, d: Domain) -> CacheSamples:
    v, gv = c.v[layer], c.gv[layer]
    if d.rotate_v:
        v, gv = _block_rotate(v, g.head_dim), _block_rotate(gv, g.head_dim)
    if d.v_matrix is not None:
        a, a_inv = d.v_matrix
        v, gv = np.einsum("tnd,ned->tne", v, a), np.einsum("tnd,nde->tne", gv, a_inv)
    if d.rot_v:
        v, gv = _block_rotate(v, d.rot_v_size), _block_rotate(gv, d.rot_v_size)
    return CacheSamples(v.astype(np.float32), (gv.astype(np.float64) ** 2).astype(np.float32))


def layout_to_norm(x: np.ndarray, g: Geometry, layout: str) -> np.ndarray:
    """The inverse of norm_to_layout."""
    if layout == "norm":
        return x
    src, dst = pair_channels(g, "norm"), pair_channels(g, layout)
    out = np.empty_like(x)
    out[..., src[:, 0]] = x[..., dst[:, 0]]
    out[..., src[:, 1]] = x[..., dst[:, 1]]
    return out


def key_error_to_model(e: np.ndarray, pos: np.ndarray, g: Geometry, d: Domain, to_file: np.ndarray) -> np.ndarray:
    """A change e [T, n_kv, head_dim] of the cached keys (keys()' domain) -> the change of the unconverted model's
    post-RoPE keys at positions pos, in the file's channel order (to_file: NORM channel c is file channel
    to_file[c]): every step of keys() is linear in the error (the mean drops out), and each is undone."""
    if d.k_angle is not None:
        raise ValueError("a learned pair angle is not undone here")
    x = e.astype(np.float64)
    if d.rot_k:
        n, skip = online_rot_k(g.head_dim, d.rot_k_halves)
        x = block_rotate(x, n, skip)                     # orthonormal and symmetric: its own inverse
    if d.k_prerope:
        x = x * d.k_div[None]
    x = layout_to_norm(x, g, d.layout)
    if d.k_perm is not None:
        y = np.empty_like(x)
        np.put_along_axis(y, np.broadcast_to(d.k_perm[None], x.shape), x, axis=2)
        x = y
    if d.k_scale is not None:
        x = _pairs_scale(x, d.k_scale, mul=True)
    if d.k_prerope:
        x = rope_norm(x, pos, g)
    out = np.empty_like(x, dtype=np.float32)
    out[..., to_file] = x
    return out


def value_error_to_model(e: np.ndarray, g: Geometry, d: Domain) -> np.ndarray:
    """A change e [T, n_kv, head_dim] of the cached values (values()' domain) -> the change of the unconverted
    model's V projection."""
    if d.v_matrix is not None:
        raise ValueError("a learned V transform is not undone here")
    x = e.astype(np.float32)
    if d.rot_v:
        x = _block_rotate(x, d.rot_v_size)
    if d.rotate_v:
        x = _block_rotate(x, g.head_dim)
    return x
