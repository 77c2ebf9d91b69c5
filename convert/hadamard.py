"""Per-KV-head Hadamard rotation baked into W_v / W_o (QuaRot).

v' = H v for every KV head (H orthonormal and symmetric, H = H^-1), so each
query head's attention output is H o, and W_o's columns of that head are
multiplied by H to undo it: out = W_o[:, head] H H o = W_o[:, head] o.
Spreads V's outlier channels over the head before the cache quantizes it.
"""
from __future__ import annotations

import numpy as np

from pykvq.ref.hadamard import hadamard  # noqa: F401  (one definition, shared with the runtime's reference)


def rotate_v(wv: np.ndarray, bv: np.ndarray | None, wo: np.ndarray, n_head: int, n_head_kv: int,
             head_dim: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(W_v', b_v', W_o') for f32 W_v [n_kv*hd, n_embd] and W_o [n_embd, n_head*hd]."""
    from .invariant import bake_v
    h = np.broadcast_to(hadamard(head_dim), (n_head_kv, head_dim, head_dim))
    return bake_v(wv, bv, wo, h, h, n_head, n_head_kv, head_dim)
