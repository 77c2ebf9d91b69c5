"""Reference of the pre-RoPE key cache (native/include/ggml-kvq.h, "Pre-RoPE key cache").

The cache holds c = (k - mean) / scale per layer, KV head and channel, where k is the key
before RoPE, optionally turned by an orthonormal Walsh-Hadamard matrix per block of n_rot_h
channels (Sylvester order; H = H^T = H^-1). Reading undoes the Hadamard, restores k = c*scale + mean and applies ggml_rope_ext's rotation at each
cell's own position: pair i turns by p*w[i], both terms times mscale. NORM pairs channels
(2i, 2i+1), NEOX pairs (i, i + n_dims/2); channels from n_dims on are not rotated.
"""
from __future__ import annotations

import numpy as np

from .hadamard import hadamard_skip

NORM, NEOX = 0, 2


def _yarn_corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * np.log(n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))


def rope_freqs(n_dims: int, freq_base: float, freq_scale: float = 1.0, ext_factor: float = 0.0,
               attn_factor: float = 1.0, n_ctx_orig: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0,
               ff: np.ndarray | None = None, n_cols: int = 1) -> tuple[np.ndarray, float]:
    """([n_cols, n_dims/2] angular frequencies w, mscale) as ggml_rope_ext computes its angles.

    ff: None, [n_dims/2] (rope_freqs) or [n_cols, n_dims/2] (K-sort: one column per KV head)."""
    i = np.arange(n_dims // 2)
    extrap = freq_base ** (-2.0 * i / n_dims) * np.ones((n_cols, 1))
    if ff is not None:
        extrap = extrap / np.broadcast_to(np.asarray(ff, np.float64), extrap.shape)
    w = freq_scale * extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        lo = max(0.0, np.floor(_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base)))
        hi = min(n_dims - 1.0, np.ceil(_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base)))
        r = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * ext_factor
        w = w * (1 - r) + extrap * r
        mscale *= 1.0 + 0.1 * np.log(1.0 / freq_scale)
    return w, float(mscale)


def pair_index(n_dims: int, mode: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, second) channel of each rotary pair."""
    i = np.arange(n_dims // 2)
    return (i, i + n_dims // 2) if mode == NEOX else (2 * i, 2 * i + 1)


def rope(x: np.ndarray, pos: np.ndarray, w: np.ndarray, mode: int, n_dims: int, mscale: float = 1.0) -> np.ndarray:
    """x [..., n_kv, n_head_kv, D] at positions pos [n_kv]; w [n_head_kv, n_dims/2] -> rotated copy."""
    a, b = pair_index(n_dims, mode)
    th = pos.astype(np.float64)[:, None, None] * w[None]          # [n_kv, n_head_kv, n_pairs]
    c, s = np.cos(th) * mscale, np.sin(th) * mscale
    y = x.astype(np.float64).copy()
    x0, x1 = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
    y[..., a] = x0 * c - x1 * s
    y[..., b] = x0 * s + x1 * c
    return y


def block_rotate(x: np.ndarray, n_rot_h: int, skip: int = 0) -> np.ndarray:
    """x [..., D] with each block of n_rot_h channels multiplied by the Hadamard (its own inverse), without its
    butterfly at stride skip when one is given (hadamard.hadamard_skip)."""
    if not n_rot_h:
        return x
    return (x.reshape(*x.shape[:-1], -1, n_rot_h) @ hadamard_skip(n_rot_h, skip)).reshape(x.shape)


def encode(k: np.ndarray, mean: np.ndarray, scale: np.ndarray, n_rot_h: int = 0, skip: int = 0) -> np.ndarray:
    """Pre-RoPE keys [..., n_head_kv, D] -> what the cache quantizes."""
    return block_rotate((k - mean) / scale, n_rot_h, skip).astype(np.float32)


def decode(c: np.ndarray, mean: np.ndarray, scale: np.ndarray, pos: np.ndarray, w: np.ndarray, mode: int,
           n_dims: int, mscale: float = 1.0, n_rot_h: int = 0, skip: int = 0) -> np.ndarray:
    """Dequantized cache rows [n_kv, n_head_kv, D] -> the post-RoPE keys attention uses (float64)."""
    return rope(block_rotate(c.astype(np.float64), n_rot_h, skip) * scale + mean, pos, w, mode, n_dims, mscale)


def centred(kd: np.ndarray, mean: np.ndarray, pos: np.ndarray, w: np.ndarray, mode: int, n_dims: int,
            mscale: float = 1.0, n_rot_h: int = 0, skip: int = 0) -> np.ndarray:
    """A centred post-RoPE cache: dequantized rows kd [n_kv, n_head_kv, D] hold H R(p)(k - mean) -> the keys
    attention uses, H R(p)k (float64). mean [n_head_kv, D]: the kept pairs, zero elsewhere."""
    m = np.broadcast_to(mean.astype(np.float64), (len(pos),) + mean.shape)
    return kd.astype(np.float64) + block_rotate(rope(m, pos, w, mode, n_dims, mscale), n_rot_h, skip)


def centre_pairs(mean: np.ndarray, var: np.ndarray | None, n_dims: int, mode: int, residual: float = 0.5) -> np.ndarray:
    """Which pairs of the mean a centred cache keeps (llama_kvq_centre_pairs): per KV head the largest by energy
    m_a² + m_b² until the energy left is at most residual × the head's summed variance (var: the squared std
    scales, [n_head_kv, D]; None: every pair with a mean). mean [n_head_kv, D] -> kept [n_head_kv, n_dims/2]."""
    a, b = pair_index(n_dims, mode)
    m = mean.astype(np.float64)
    e = m[:, a] ** 2 + m[:, b] ** 2
    allowed = np.zeros(len(m)) if var is None else residual * var.astype(np.float64).sum(axis=1)
    kept = np.zeros(e.shape, bool)
    for h in range(len(m)):
        left = e[h].sum()
        for i in np.argsort(-e[h], kind="stable"):
            if left <= allowed[h] or e[h, i] == 0.0:
                break
            kept[h, i] = True
            left -= e[h, i]
    return kept
