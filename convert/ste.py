"""Fake quantization for learning: the exact reference forward, a straight-through gradient.

The forward value is the numpy reference round trip of the cache type (pykvq.ref), so
a learned transform is scored on exactly the numbers the runtime will store. The
gradient is the straight-through estimator of d * round(x / d) - x: the rounding
residual r = e / s of every value is held constant and the error e = r * s(x)
follows the block scale s, the block's largest magnitude (the second largest for
the outlier types, whose largest value is kept aside exactly). For the scale-
equivariant block formats here that is the usual STE; for bfp's power-of-two
exponent the continuous absmax stands in for the rounded scale.
"""
from __future__ import annotations

import numpy as np

from pykvq import cache_types
from pykvq.ref import nuq, roundtrip


def block_of(type_name: str) -> tuple[int, bool]:
    """(block size, has an outlier slot) of a quantized cache type."""
    if type_name in cache_types.KVQ_TYPES:
        t = cache_types.KVQ_TYPES[type_name]
        return t.qk, t.outliers
    return cache_types.block_size(type_name), False


def exact_error(x: np.ndarray, type_name: str, codebook: np.ndarray | None = None) -> np.ndarray:
    """Q(x) - x along the last axis with the reference quantizer (a nuq codebook if given)."""
    x = np.asarray(x, np.float32)
    q = nuq.roundtrip(x, type_name, codebook) if type_name in nuq.FORMATS else roundtrip(x, type_name)
    return q - x


def error(x, type_name: str, codebook: np.ndarray | None = None):
    """Torch: the exact quantization error of x [..., d] (d a multiple of the block), with the STE gradient."""
    import torch
    block, outliers = block_of(type_name)
    xn = x.detach().cpu().numpy()
    e = exact_error(xn, type_name, codebook)
    xb = x.reshape(*x.shape[:-1], -1, block)
    mag = xb.abs()
    s = mag.topk(2, dim=-1).values[..., 1] if outliers else mag.amax(dim=-1)
    sn = s.detach().cpu().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(sn[..., None] > 0, e.reshape(xb.shape) / sn[..., None], 0.0).astype(np.float32)
    # the value is exactly e; the gradient is r * ds (s - s.detach() is zero but carries s's gradient)
    return torch.from_numpy(e) + (torch.from_numpy(r) * (s - s.detach())[..., None]).reshape(x.shape)
