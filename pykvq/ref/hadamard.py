"""The orthonormal Sylvester Walsh-Hadamard matrix: llama.cpp's attn_rot matrices, the converter's
baked V rotation and the pre-RoPE cache's rotation of centred keys all use this one."""
from __future__ import annotations

import numpy as np


def hadamard(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of size n (a power of two), scaled to be orthonormal (H = H^T = H^-1)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)
