"""Learn a per-pair complex scale of Q/K (a scale and an in-pair angle) per KV head.

The only maps of K that commute with every RoPE rotation act on each rotary pair
as a complex number (invariant.py). Pair smoothing (smooth.py) already picks the
scale part, as a power of two from one rule per layer; this learns both parts
freely, per pair: k_pair <- e^-l R(phi) k_pair, q_pair <- e^l R(phi) q_pair.

What the angle can add: RoPE turns pair j by m*theta_j, so for fast pairs the
in-pair angle of a cached key is spread over the circle and phi changes nothing;
a slow pair keeps its direction over the context, and phi can turn a one-sided
pair (all its energy in one channel, the typical outlier) toward the diagonal,
halving that channel's share of the block maximum.

Objective: mean squared attention-score error over causal (query, key) pairs of
the calibration text, with K quantized to the target cache type in the cache's
own domain (file layout, and the runtime's online Hadamard when it applies) and
Q to its vec_dot type, both with ste.py's straight-through gradient. Initial
point: the smoothing scales (or 1) and angle 0; the last sequence is held out
and the learned pair transform is kept only when it beats the initial point
there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pykvq.ref import VEC_DOT_TYPE

from . import ste
from .cache_domain import norm_to_layout, online_rot_k_size
from .geometry import Geometry
from .hadamard import hadamard
from .learn_v import query_positions, sequences
from .smooth import rope_norm


@dataclass
class KResult:
    log_scale: np.ndarray          # [n_kv, n_pairs] l: K pair / e^l, Q pair * e^l
    angle: np.ndarray              # [n_kv, n_pairs] phi (radians)
    choice: str                    # "learned" or "initial"
    heldout: dict = field(default_factory=dict)   # held-out score error, relative to no transform
    seconds: float = 0.0


def _pairs(x, l, phi, sign: float):
    """Torch version of invariant.pair_transform (NORM order, params [H, P])."""
    import torch
    a, b = x[..., 0::2], x[..., 1::2]
    f, c, s = torch.exp(sign * l), torch.cos(phi), torch.sin(phi)
    return torch.stack([f * (c * a - s * b), f * (s * a + c * b)], dim=-1).reshape(x.shape)


def _to_cache(x, order, rot):
    """NORM -> the file's channel order, then the runtime's online block Hadamard (if any)."""
    x = x[..., order]
    if rot is not None:
        n = rot.shape[0]
        x = (x.reshape(*x.shape[:-1], -1, n) @ rot).reshape(x.shape)
    return x


def score_error(q, k, l, phi, kv, qi, type_k, order, rot):
    """Torch: mean squared score error of one sequence (post-RoPE NORM q [T, n_head, hd], k [T, n_kv, hd])."""
    import torch
    qc = _to_cache(_pairs(q[qi], l[kv], phi[kv], 1.0), order, rot)
    kc = _to_cache(_pairs(k, l, phi, -1.0), order, rot)
    kq = kc + ste.error(kc, type_k)
    qq = qc + ste.error(qc, VEC_DOT_TYPE.get(type_k, "q8_0"))
    diff = torch.einsum("qhd,thd->hqt", qq, kq[:, kv]) - torch.einsum("qhd,thd->hqt", qc, kc[:, kv])
    mask = (torch.arange(k.shape[0])[None, :] <= qi[:, None]).to(diff.dtype)
    return (diff.pow(2) * mask).sum() / (mask.sum() * diff.shape[0])


def learn(q: np.ndarray, k: np.ndarray, pos: np.ndarray, g: Geometry, type_k: str, init_scale: np.ndarray,
          *, rotate: bool, steps: int = 100, lr: float = 2e-2, n_query: int = 128) -> KResult:
    """One layer: q [T, n_head, hd], k [T, n_kv, hd] pre-RoPE NORM; init_scale [n_kv, n_pairs] (s: K / s)."""
    import torch
    t0 = time.time()
    seqs = sequences(pos)
    if len(seqs) < 2:
        raise ValueError("learning a K transform needs at least 2 calibration sequences (one is held out)")
    kv = torch.from_numpy(np.arange(g.n_head) // g.group)
    order = torch.from_numpy(norm_to_layout(np.arange(g.head_dim), g, g.layout))   # file channel c = NORM order[c]
    rot = torch.from_numpy(hadamard(online_rot_k_size(g.head_dim)).astype(np.float32)) if rotate else None
    data = []
    for s in seqs:
        t = s.stop - s.start
        qi = torch.from_numpy(query_positions(t, n_query))
        data.append((torch.from_numpy(rope_norm(q[s], pos[s], g)), torch.from_numpy(rope_norm(k[s], pos[s], g)), qi))
    l0 = torch.from_numpy(np.log(np.asarray(init_scale, np.float64)).astype(np.float32))
    l = l0.clone().requires_grad_(True)
    phi = torch.zeros_like(l0, requires_grad=True)
    opt = torch.optim.Adam([l, phi], lr=lr)

    def err(lv, pv, part):
        return sum(score_error(qq, kk, lv, pv, kv, qi, type_k, order, rot) for qq, kk, qi in part)

    with torch.no_grad():
        scale = float(err(l0, torch.zeros_like(l0), data[:-1])) or 1.0
    for _ in range(steps):
        opt.zero_grad()
        loss = err(l, phi, data[:-1]) / scale
        loss.backward()
        opt.step()
    with torch.no_grad():
        zero = torch.zeros_like(l0)
        none = float(err(zero, zero, data[-1:])) or 1.0
        ini = float(err(l0, zero, data[-1:])) / none
        lrn = float(err(l, phi, data[-1:])) / none
    res = KResult(l.detach().double().numpy(), phi.detach().double().numpy(), "learned",
                  {"none": 1.0, "initial": ini, "learned": lrn})
    if not (lrn < ini and np.all(np.isfinite(res.log_scale)) and np.all(np.isfinite(res.angle))):
        res.log_scale, res.angle, res.choice = l0.double().numpy(), np.zeros_like(res.angle), "initial"
    res.seconds = time.time() - t0
    return res
