"""numpy reference implementations of pykvq's cache formats.

One module per format family; the C code in native/ is tested against these
bit for bit (quantize, dequantize) or to a stated tolerance (dot products).
``roundtrip(x, type)`` quantizes and dequantizes the last axis of x with a
cache type (fake quantization), and ``VEC_DOT_TYPE`` names the type Q is
converted to for K·Q on the CPU.
"""
from __future__ import annotations

import numpy as np

from ..cache_types import KVQ_TYPES
from . import bfp, nuq, q53, scale_search, stock, tcq  # noqa: F401

# the vec_dot_type of each K cache type in the pinned tree (iq4_nl, q4_1, q5_1 pair with q8_0/q8_1)
# (pykvq's own types: the type table, pykvq/cache_types.py)
VEC_DOT_TYPE = {"q4_0": "q8_0", "q4_1": "q8_0", "iq4_nl": "q8_0", "q5_0": "q8_0", "q5_1": "q8_0",
                "q8_0": "q8_0", "f16": "f16", "bf16": "bf16", "f32": "f32",
                **{n: t.vec_dot_type for n, t in KVQ_TYPES.items()}}

# q4_1 and iq4_nl have no numpy round trip yet; q4_0 stands in for them in calibration
_STANDIN = {"q4_1": "q4_0", "iq4_nl": "q4_0", "q5_1": "q5_0"}


def roundtrip(x: np.ndarray, type_name: str, *, lsq: bool = False) -> np.ndarray:
    """Quantize and dequantize the last axis of x (float32) with a cache type. lsq: q4_0 / q5_0 with
    least-squares block scales (scale_search), as the runtime writes a pykvq-converted file's cache."""
    if lsq and type_name in ("q4_0", "q5_0"):
        return scale_search.roundtrip(x, 8 if type_name == "q4_0" else 16)
    t = _STANDIN.get(type_name, type_name)
    x = np.asarray(x, dtype=np.float32)
    if t == "f32":
        return x
    if t == "f16":
        return x.astype(np.float16).astype(np.float32)
    if t == "bf16":
        return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)   # truncation: close enough
    if t in nuq.FORMATS:            # the fallback codebook; pass a file's codebook to nuq.roundtrip
        return nuq.roundtrip(x, t)
    if t in tcq.FORMATS:
        return tcq.roundtrip(x, t)
    if t == "q53_64":
        return q53.roundtrip(x)
    if t == "q42_64":
        return q53.q42_roundtrip(x)
    if t == "q32_64":
        return q53.q32_roundtrip(x)
    if t == "q4t2_64":
        return q53.q4t2_roundtrip(x)
    if t == "t32_64":
        return q53.t32_roundtrip(x)
    if t in bfp.FORMATS:
        e, m = bfp.quantize_blocks(x.reshape(-1), t)
        return bfp.dequantize_blocks(e, m).reshape(x.shape)
    fn = getattr(stock, f"roundtrip_{t}", None)
    if fn is None:
        raise ValueError(f"no numpy round trip for cache type {type_name!r}")
    return fn(x)
