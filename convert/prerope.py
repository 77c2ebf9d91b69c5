"""Pre-RoPE, centred key cache (--prerope-k): the per-channel mean and scale the runtime needs.

The runtime caches c = (k_pre - mean) / scale, where k_pre is the input of the K RoPE op (attn_k
output plus its bias, [n_head_kv, head_dim] per token) in the file's channel layout, after every
transform the converter bakes (pair smoothing, learned pair transforms, K-sort, NEOX -> NORM). When
attention reads a K tile it restores k = c*scale + mean and applies RoPE at each cell's own
position; upstream's online K Hadamard (attn_rot_k) is off for such a cache.

Before RoPE a per-channel mean is one constant vector per layer and head, so removing it is
cheap and exact; after RoPE it spins with the position and every per-token block has to cover it
(docs/prerope.md). The file carries per
layer F32 tensors blk.N.kvq_k_mean and blk.N.kvq_k_scale (numpy [n_head_kv, head_dim], ggml
ne = [head_dim, n_head_kv]) and the key pykvq.cache.k_domain = "prerope".

Scale methods (measured on calibration K in the file layout; each floored at STD_FLOOR x the
median of its head, so that channels that hardly move are not blown up into the block's range):
  absmax  per-channel largest |k - mean| over the calibration tokens (every channel's extremes
          reach the same size, so one heavy-tailed channel no longer sets its block's scale)
  std     per-channel standard deviation around the mean
  pow2    std rounded to a power of two
  one     1 everywhere (the mean only)
The default (DEFAULT_SCALE, below) is what scripts/prerope_study.py measured to pay on SmolLM2-135M;
docs/prerope.md has the table.
"""
from __future__ import annotations

import numpy as np

# GGUF names (Keys.Cache.K_DOMAIN, K_SCALE_METHOD, Tensors.K_MEAN / K_SCALE): pykvq/keys.py

SCALES = ("absmax", "std", "pow2", "one")
# std: the runtime turns the centred keys by the online Hadamard (upstream's attn_rot_k size) and undoes
# it per K tile in flash attention; with that rotation std pays most on SmolLM2-135M (scripts/prerope_study.py,
# 16 x 512 WikiText-2 tokens, K only: q4_0 0.0204 vs absmax 0.0336; stock post-RoPE q4_0 + Hadamard 0.0370).
# Without the rotation (-rotk off) absmax is better (q4_0 0.0376 vs 0.0381, nuq4 + Fisher 0.0204 vs 0.0266).
DEFAULT_SCALE = "std"
STD_FLOOR = 1e-2


def stats(k: np.ndarray, method: str = DEFAULT_SCALE) -> tuple[np.ndarray, np.ndarray]:
    """(mean, scale), each float32 [n_kv, head_dim], of pre-RoPE keys k [T, n_kv, head_dim] (file layout)."""
    if method not in SCALES:
        raise ValueError(f"pre-RoPE K scale must be one of {SCALES}, got {method!r}")
    k64 = np.asarray(k, np.float64)
    mean = k64.mean(axis=0)
    if method == "one":
        scale = np.ones_like(mean)
    else:
        spread = np.abs(k64 - mean).max(axis=0) if method == "absmax" else k64.std(axis=0)
        floor = STD_FLOOR * np.median(spread, axis=1, keepdims=True)
        scale = np.maximum(spread, floor)
        scale = np.where(scale > 0, scale, 1.0)            # a head whose keys never move (all-zero rows)
        if method == "pow2":
            scale = np.exp2(np.round(np.log2(scale)))
    mean, scale = mean.astype(np.float32), scale.astype(np.float32)
    if not (np.isfinite(mean).all() and np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("pre-RoPE K statistics are not finite (calibration activations overflowed?)")
    return mean, scale


def encode(k: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the cache quantizes: (k - mean) / scale, k [..., n_kv, head_dim] (as pykvq/ref/prerope.py)."""
    return ((np.asarray(k, np.float32) - mean) / scale).astype(np.float32)
