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


def hadamard_skip(n: int, skip: int = 0) -> np.ndarray:
    """The orthonormal Hadamard of size n without its butterfly at stride `skip` (0: hadamard(n)):
    H_{n/2skip} (x) I_2 (x) H_skip: entry (i, j) is 0 where i and j differ in skip's bit, else
    (-1)^popcount(i & j & ~skip) / sqrt(n/2) (ggml_kvq_fa_set_hadamard_skip;
    q53_64 keys on a 128 head turn the two blocks' 5-bit halves together and their 3-bit halves together)."""
    if not skip:
        return hadamard(n)
    if skip & (skip - 1) or not 0 < skip < n:
        raise ValueError(f"the left-out stride must be a power of two below {n}, got {skip}")
    return np.kron(np.kron(hadamard(n // (2 * skip)), np.eye(2)), hadamard(skip))
