"""NEOX -> NORM re-layout of Q/K rows (qwen2 and other NEOX-rope archs).

In NEOX order a head's channel j rotates with channel j + n_rot/2, so every
32-block of a 64-wide head holds one half of each pair, and a pair permutation
cannot group magnitudes. Interleaving the rows (new 2j <- old j, new 2j+1 <-
old j + n_rot/2: the same interleave llama.cpp's converter applies to llama's
q/k) puts each pair in adjacent channels; the file then says
pykvq.rope.layout = norm and the patched runtime ropes it in NORM mode. Q·K is
unchanged because Q and K channels move together.
"""
from __future__ import annotations

import numpy as np

from .geometry import Geometry, pair_channels


def neox_to_norm(g: Geometry) -> np.ndarray:
    """Channel permutation of one head: new channel c <- old channel perm[c]."""
    perm = np.empty(g.head_dim, dtype=np.int64)
    norm, neox = pair_channels(g, "norm"), pair_channels(g, "neox")
    perm[norm[:, 0]] = neox[:, 0]
    perm[norm[:, 1]] = neox[:, 1]
    return perm
