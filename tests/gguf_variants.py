"""Copies of a real GGUF with pykvq.cache.* keys and codebook tensors added (weights untouched)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from convert.gguf_io import Tensor, read_gguf, write_gguf
from pykvq.keys import Keys, Tensors


def variant(src, out, *, layer_types_k=None, layer_types_v=None, type_k=None, type_v=None,
            codebooks_k=None, codebooks_v=None, rot_k=None, rot_v=None):
    """A copy of src with pykvq.cache keys; codebooks_*: {layer: int8 entries (padded to 16)}."""
    m = read_gguf(src)
    for key, val in ((Keys.Cache.LAYER_TYPES_K, layer_types_k), (Keys.Cache.LAYER_TYPES_V, layer_types_v)):
        if val is not None:
            m.set(key, list(val), VT.ARRAY, VT.STRING)
    for key, val in ((Keys.Cache.TYPE_K, type_k), (Keys.Cache.TYPE_V, type_v)):
        if val is not None:
            m.set(key, val, VT.STRING)
    for key, val in ((Keys.Cache.CODEBOOK_ROT_K, rot_k), (Keys.Cache.CODEBOOK_ROT_V, rot_v)):
        if val is not None:
            m.set(key, bool(val), VT.BOOL)
    for which, cbs in (("k", codebooks_k or {}), ("v", codebooks_v or {})):
        for il, cb in cbs.items():
            padded = np.zeros(16, np.int8)
            padded[:len(cb)] = cb
            name = Tensors.CODEBOOK[which].format(bid=il)
            m.tensors[name] = Tensor(name, QT.I8, padded)
    write_gguf(m, out)
    return out


def without_tensors(src, out, suffix: str):
    """A copy of src without its tensors named blk.N.<suffix> (a file from before that tensor existed)."""
    m = read_gguf(src)
    for name in [n for n in m.tensors if n.endswith("." + suffix)]:
        del m.tensors[name]
    write_gguf(m, out)
    return out


def with_key(src, out, key: str, value, vtype):
    """A copy of src with one metadata key set (a pykvq.cache.* default of a newer converter, or a bad one)."""
    m = read_gguf(src)
    m.set(key, value, vtype)
    write_gguf(m, out)
    return out
