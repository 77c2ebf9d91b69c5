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
  fisher  std^(1-2a) / F^a with a = FISHER_POWER, F = the channel's diagonal Fisher E[(dL/dk)^2] from
          the calibration's gradients; a = 1/4 minimises the Fisher-weighted key error when a Hadamard
          gives every scaled channel the same error (below), a = 0 is std; clipped to CLIP x its head's median
  absmax  per-channel largest |k - mean| over the calibration tokens (every channel's extremes
          reach the same size, so one heavy-tailed channel no longer sets its block's scale)
  std     per-channel standard deviation around the mean
  pow2    std rounded to a power of two
  one     1 everywhere (the mean only)
Every method but std also writes blk.N.kvq_k_std (the std), which the centred post-RoPE cache reads to
choose the mean pairs it keeps. The default (DEFAULT_SCALE, below) is what scripts/prerope_study.py
measured to pay on both models; docs/prerope-study.md has the tables.
"""
from __future__ import annotations

import numpy as np

# GGUF names (Keys.Cache.K_DOMAIN, K_SCALE_METHOD, Tensors.K_MEAN / K_SCALE): pykvq/keys.py

SCALES = ("fisher", "absmax", "std", "pow2", "one")
# The runtime turns the centred keys by the online Hadamard (upstream's attn_rot_k size) and undoes it per
# K tile in flash attention. With that rotation (scripts/prerope_study.py, WikiText-2 test, K only, q4_0):
#   SmolLM2-135M (16 x 512): fisher a=0.15 0.0150, a=0.25 0.0167, std 0.0213, mean only 0.0230, absmax 0.0336
#                            (stock post-RoPE 0.0370); on the KJV Bible a=0.15 0.0207, 0.25 0.0229, std 0.0283
#   Qwen2.5-Coder-1.5B (8 x 512): fisher a=0.15 0.0063, a=0.25 0.0068, std 0.0090, mean only 0.0091 (stock 1.89)
# Why fisher: with a Hadamard after the scale every scaled channel gets about the same error D, which grows
# with mean_c (sigma_c / s_c)^2, so the key's Fisher-weighted error is ~ (sum_c sigma_c^2/s_c^2)(sum_c F_c s_c^2),
# least at s_c^4 ~ sigma_c^2 / F_c (Cauchy-Schwarz). Channels the loss barely reads give their share of the
# block's range to the ones it does (in Qwen2.5 a few pre-RoPE channels carry most of the query's weight).
# The power a depends on the key types' bits (fisher_power): 0.15 measured best in that study (no exact window,
# gradients through every key; 0.1 and 0.2 worse on SmolLM2 / KJV). Since the converter keeps sinks and a recent
# window exact and takes F only through the quantized reads (convert/calib.py), the runtime measures the theory's
# 1/4 best for keys of 3.5 bits and more, not below (docs/RESULTS.md, issue 40; weights in f32 so the KLD is the
# cache's own; SmolLM2 at 4096 tokens, a = 0.15 -> 0.25, V q8_0 unless named: q53_64/q4_0 0.00136 -> 0.00113
# (0.05 0.00147, 0.3 0.00114, 0.35 0.00116), q4_0/q4_0 0.00223 -> 0.00209, nuq4 0.00256 -> 0.00219, q42_64 0.00457
# -> 0.00439, Qwen q53_64/q4_0 0.000560 -> 0.000549; but nuq2o 0.0457 -> 0.0483, 3/2-bit halves (study) 0.0138
# -> 0.0168, --kv-bits 3.0 (nuq2o keys in 23 layers) 0.0345 -> 0.0518, --kv-bits 3.5 0.00982 -> 0.0101). The
# theory assumes steps small against each channel's spread; with 2-3 levels a channel scaled up is clipped. A
# budget's layers whose keys then take uniform blocks of 3.5 bits or more get 1/4 (pipeline._rescale_plain_k_layers).
DEFAULT_SCALE = "fisher"
FISHER_POWER = 0.25            # keys of FISHER_POWER_BITS bits/value or more
FISHER_POWER_LOW = 0.15        # when any layer's keys may take fewer (a --kv-bits ladder has nuq2o)
FISHER_POWER_BITS = 3.5
STD_FLOOR = 1e-2
CLIP = 16.0          # fisher: within [median / CLIP, median * CLIP] of its head (study: clip 4 is 5% worse)


def fisher_power(k_bits) -> float:
    """The fisher scale's power for a file whose layers' keys may take types of these bits/value."""
    return FISHER_POWER if min(k_bits) >= FISHER_POWER_BITS else FISHER_POWER_LOW


def stats(k: np.ndarray, method: str = DEFAULT_SCALE, fisher: np.ndarray | None = None,
          power: float = FISHER_POWER) -> tuple[np.ndarray, np.ndarray]:
    """(mean, scale), each float32 [n_kv, head_dim], of pre-RoPE keys k [T, n_kv, head_dim] (file layout);
    method fisher needs fisher = E[(dL/dk)^2] [n_kv, head_dim] of the same keys (and takes its power)."""
    k64 = np.asarray(k, np.float64)
    mean = k64.mean(axis=0)
    absmax = np.abs(k64 - mean).max(axis=0) if method == "absmax" else None
    return stats_from_moments(mean, k64.std(axis=0), absmax, method, fisher, power)


def stats_from_moments(mean: np.ndarray, std: np.ndarray, absmax: np.ndarray | None, method: str = DEFAULT_SCALE,
                       fisher: np.ndarray | None = None, power: float = FISHER_POWER) -> tuple[np.ndarray, np.ndarray]:
    """stats() from per-channel moments ([n_kv, head_dim] each: mean, std, largest |k - mean|; absmax only for
    method absmax): what runtime calibration (pykvq.calibrate) gives without keeping the keys."""
    if method not in SCALES:
        raise ValueError(f"pre-RoPE K scale must be one of {SCALES}, got {method!r}")
    mean = np.asarray(mean, np.float64)
    if method == "one":
        scale = np.ones_like(mean)
    elif method == "fisher":
        if fisher is None or np.shape(fisher) != mean.shape:
            raise ValueError(f"the fisher scale needs the keys' diagonal Fisher {mean.shape}")
        scale = fisher_scale(np.asarray(std, np.float64), np.asarray(fisher, np.float64), power=power)
    else:
        spread = np.asarray(absmax if method == "absmax" else std, np.float64)
        floor = STD_FLOOR * np.median(spread, axis=1, keepdims=True)
        scale = np.maximum(spread, floor)
        scale = np.where(scale > 0, scale, 1.0)            # a head whose keys never move (all-zero rows)
        if method == "pow2":
            scale = np.exp2(np.round(np.log2(scale)))
    mean, scale = mean.astype(np.float32), scale.astype(np.float32)
    if not (np.isfinite(mean).all() and np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("pre-RoPE K statistics are not finite (calibration activations overflowed?)")
    return mean, scale


def fisher_scale(std: np.ndarray, fisher: np.ndarray, clip: float = CLIP, power: float = FISHER_POWER) -> np.ndarray:
    """std^(1 - 2a) / F^a per channel ([n_kv, head_dim]; a = power: 1/4 the theory's optimum, 0 the std scale,
    1/2 the Fisher alone), clipped to clip x the head's median scale and normalised so that the median
    channel's spread (std / scale) is 1 in each head."""
    sd = np.maximum(std, STD_FLOOR * np.median(std, axis=-1, keepdims=True))
    sd = np.where(sd > 0, sd, 1.0)
    f = np.maximum(fisher, 1e-12 * max(float(fisher.max()), 1e-300))
    scale = sd ** (1.0 - 2.0 * power) / f ** power
    med = np.median(scale, axis=-1, keepdims=True)
    scale = np.clip(scale, med / clip, med * clip)
    return scale * np.median(sd / scale, axis=-1, keepdims=True)


def encode(k: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the cache quantizes: (k - mean) / scale, k [..., n_kv, head_dim] (as pykvq/ref/prerope.py)."""
    return ((np.asarray(k, np.float32) - mean) / scale).astype(np.float32)
