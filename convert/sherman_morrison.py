"""Invertible matrices as products of rank-one updates of the identity.

    A = (I + u_1 v_1^T)(I + u_2 v_2^T) ... (I + u_r v_r^T) B

with B orthogonal (a Hadamard matrix or I). Each factor's inverse is known in
closed form (Sherman–Morrison), (I + u v^T)^-1 = I - u v^T / (1 + v^T u), so A
is invertible exactly when every denominator 1 + v_k^T u_k is nonzero
(det A = det B * their product), and A^-1 never needs a general inversion.

Multiplying r factors one by one costs r small steps; the same products in
closed form (the "WY" form of a product of rank-one updates), with U = [u_k],
V = [v_k] (d x r) and S = V^T U:

    prod_k (I + u_k v_k^T)    = I + U T V^T,  T^-1 = I - striu(S)          (unit upper triangular)
    prod_k (I + u_k v_k^T)^-1 = I - U L^-1 V^T,  L = I + tril(S)           (the SM product, reversed)

L's diagonal holds exactly the Sherman–Morrison denominators. Both need one
r x r triangular solve. Batched over a leading axis: one A per KV head.
"""
from __future__ import annotations


def denominators(u, v):
    """[n, r]: 1 + v_k^T u_k of every factor."""
    return 1.0 + (u * v).sum(-1)


def _uv(u, v):
    import torch
    s = v @ u.transpose(-1, -2)                                  # [n, r, r]: s[i, j] = v_i . u_j
    eye = torch.eye(s.shape[-1], dtype=s.dtype).expand_as(s)
    return s, eye


def matrix(u, v, base):
    """A [n, d, d] for u, v [n, r, d] (rows u_k, v_k) and an orthogonal base [d, d]."""
    import torch
    s, eye = _uv(u, v)
    t = torch.linalg.solve_triangular(eye - torch.triu(s, diagonal=1), eye, upper=True, unitriangular=True)
    d = u.shape[-1]
    return (torch.eye(d, dtype=u.dtype) + u.transpose(-1, -2) @ t @ v) @ base


def inverse(u, v, base):
    """A^-1 [n, d, d] (base orthogonal: its inverse is its transpose)."""
    import torch
    s, eye = _uv(u, v)
    x = torch.linalg.solve_triangular(eye + torch.tril(s), v, upper=False)      # L^-1 V^T  [n, r, d]
    d = u.shape[-1]
    return base.transpose(-1, -2) @ (torch.eye(d, dtype=u.dtype) - u.transpose(-1, -2) @ x)
