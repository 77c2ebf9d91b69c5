"""Learn an invertible V transform per KV head (see invariant.py for what is baked).

Objective (loss="output"): the attention output's error through W_o on calibration text,

    L(A) = sum_h sum_q || W_o,h A^-1 sum_t P_h[q, t] (Q(A v_t) - A v_t) ||^2

with P_h the attention probabilities of query head h (from the calibration Q, K
with RoPE), Q the target cache type's quantizer (ste.py: exact forward,
straight-through gradient). loss="fisher" weighs the error in the model's own V
space by the diagonal Fisher information of the LM loss instead (KVQuant's
sensitivity), L(A) = sum_t sum_i (dL/dv_t,i)^2 (A^-1 (Q(A v_t) - A v_t))_i^2 and A = sherman_morrison.matrix(u, v, B), B the
Hadamard matrix (the initial point; u small, v zero) or I. The last calibration
sequence is held out: A is kept only when it beats Hadamard there, else the
layer falls back to Hadamard. Guard rails: every Sherman–Morrison denominator
stays >= DENOM_MIN and cond(A) <= max_cond (penalties while learning; checked
after, in float64, with A A^-1 = I).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from . import sherman_morrison as sm
from . import ste
from .geometry import Geometry
from .hadamard import hadamard
from .smooth import rope_norm

DENOM_MIN = 0.25
MAX_COND = 100.0


@dataclass
class VData:
    """One layer's calibration sample, per sequence."""
    v: list            # [T, n_kv, hd] values as the cache order holds them
    p: list            # [n_head, n_query, T] attention probabilities of the sampled queries
    m: np.ndarray      # [n_head, hd, hd] W_o,h^T W_o,h: the output error's metric
    fisher: list | None = None   # [T, n_kv, hd] (dL/dv)^2 per sequence (loss="fisher")


@dataclass
class VResult:
    a: np.ndarray                  # [n_kv, hd, hd] the transform to bake (learned or the fallback)
    a_inv: np.ndarray
    choice: str                    # "learned" or "hadamard"
    cond: float                    # largest cond(A) over the layer's heads
    heldout: dict = field(default_factory=dict)   # held-out output error, relative to no transform
    reason: str = ""
    seconds: float = 0.0


def sequences(pos: np.ndarray) -> list[slice]:
    """The calibration sequences (each starts at position 0)."""
    starts = list(np.flatnonzero(pos == 0)) + [len(pos)]
    return [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]


def query_positions(t: int, n_query: int) -> np.ndarray:
    """n_query evenly spaced positions of a t-token sequence (all of them if t <= n_query)."""
    return np.unique(np.linspace(0, t - 1, min(n_query, t)).astype(np.int64))


def attention_probs(q: np.ndarray, k: np.ndarray, pos: np.ndarray, g: Geometry, n_query: int) -> np.ndarray:
    """Causal softmax(q k^T / sqrt(hd)) [n_head, n_query, T] of one sequence's pre-RoPE NORM q, k, for
    n_query evenly spaced query positions."""
    qr, kr = rope_norm(q, pos, g), rope_norm(k, pos, g)
    t = len(pos)
    qi = query_positions(t, n_query)
    kv = np.arange(g.n_head) // g.group
    s = np.einsum("qhd,thd->hqt", qr[qi].astype(np.float64), kr[:, kv].astype(np.float64)) / np.sqrt(g.head_dim)
    s = np.where(np.arange(t)[None, None, :] > qi[None, :, None], -np.inf, s)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    return (s / s.sum(axis=-1, keepdims=True)).astype(np.float32)


def layer_data(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, wo: np.ndarray, g: Geometry,
               n_query: int = 128, gv: np.ndarray | None = None) -> VData:
    """VData from one layer's calibration q, k (pre-RoPE, NORM), v, W_o [n_embd, n_head*hd] (f32) and,
    for loss="fisher", the LM loss's gradient w.r.t. v."""
    seqs = sequences(pos)
    w = wo.reshape(wo.shape[0], g.n_head, g.head_dim).astype(np.float64)
    m = np.einsum("ehd,ehf->hdf", w, w).astype(np.float32)
    fisher = None if gv is None else [(gv[s].astype(np.float64) ** 2).astype(np.float32) for s in seqs]
    return VData([v[s] for s in seqs], [attention_probs(q[s], k[s], pos[s], g, n_query) for s in seqs], m, fisher)


def fisher_error(a, a_inv, v, f, type_v: str):
    """Torch: the diagonal-Fisher-weighted error of one sequence, in the model's V space."""
    import torch
    e = ste.error(torch.einsum("tnd,ned->tne", v, a), type_v)
    back = torch.einsum("tne,nfe->tnf", e, a_inv)               # A^-1 e
    return (f * back.pow(2)).sum() / v.shape[0]


def output_error(a, a_inv, v, p, m, kv, type_v: str):
    """Torch: L(A) of one sequence, summed over heads and mean over the sampled queries."""
    import torch
    x = torch.einsum("tnd,ned->tne", v, a)                      # the cache holds A v
    e = ste.error(x, type_v)[:, kv]                             # [T, n_head, hd]
    y = torch.einsum("hqt,the->hqe", p, e)
    z = torch.einsum("hqe,hfe->hqf", y, a_inv[kv])              # A^-1 y: back in the model's space
    return torch.einsum("hqf,hfg,hqg->", z, m, z) / p.shape[1]


def learn(d: VData, g: Geometry, type_v: str, *, steps: int = 100, rank: int | None = None, init: str = "hadamard",
          max_cond: float = MAX_COND, lr: float = 1e-2, seed: int = 0, loss: str = "output") -> VResult:
    """Learn one layer's A on every sequence but the last; choose on the last (held out)."""
    import torch
    t0 = time.time()
    if len(d.v) < 2:
        raise ValueError("learning a V transform needs at least 2 calibration sequences (one is held out)")
    hd, n = g.head_dim, g.n_head_kv
    r = rank or hd
    kv = torch.from_numpy(np.arange(g.n_head) // g.group)
    hn = hadamard(hd)
    h = torch.from_numpy(hn.astype(np.float32))
    base = h if init == "hadamard" else torch.eye(hd)
    tv = [torch.from_numpy(np.ascontiguousarray(x, np.float32)) for x in d.v]
    tp = [torch.from_numpy(x) for x in d.p]
    tm = torch.from_numpy(d.m)
    if loss == "fisher":
        if d.fisher is None:
            raise ValueError('loss="fisher" needs the calibration gradients w.r.t. V')
        tp = [torch.from_numpy(x) for x in d.fisher]
    train = list(zip(tv[:-1], tp[:-1]))
    gen = torch.Generator().manual_seed(seed)
    u = (torch.randn(n, r, hd, generator=gen) * (0.1 / np.sqrt(hd))).requires_grad_(True)
    w = torch.zeros(n, r, hd, requires_grad=True)
    opt = torch.optim.Adam([u, w], lr=lr)

    def loss_of(a, a_inv, data):
        if loss == "fisher":
            return sum(fisher_error(a, a_inv, x, f, type_v) for x, f in data)
        return sum(output_error(a, a_inv, x, p, tm, kv, type_v) for x, p in data)

    with torch.no_grad():
        scale = float(loss_of(base.expand(n, hd, hd), base.T.expand(n, hd, hd), train)) or 1.0
    for _ in range(steps):
        opt.zero_grad()
        a, a_inv = sm.matrix(u, w, base), sm.inverse(u, w, base)
        sv = torch.linalg.svdvals(a)
        log_cond = torch.log(sv[:, 0] / sv[:, -1])
        c = sm.denominators(u, w)
        total = (loss_of(a, a_inv, train) / scale
                + 10.0 * torch.relu(DENOM_MIN - c).pow(2).sum()
                + 10.0 * torch.relu(log_cond - np.log(max_cond)).pow(2).sum()
                + 0.1 * torch.log(sv).mean(-1).pow(2).sum())           # L is blind to A's overall size
        total.backward()
        opt.step()

    with torch.no_grad():
        a = sm.matrix(u, w, base).double().numpy()
        a_inv = sm.inverse(u, w, base).double().numpy()
        c = sm.denominators(u, w).numpy()
        held = [(tv[-1], tp[-1])]
        eye = torch.eye(hd).expand(n, hd, hd)
        none = float(loss_of(eye, eye, held)) or 1.0
        hh = h.expand(n, hd, hd)
        had = float(loss_of(hh, hh, held)) / none
        lrn = float(loss_of(torch.from_numpy(a.astype(np.float32)), torch.from_numpy(a_inv.astype(np.float32)),
                            held)) / none
    conds = np.linalg.cond(a)
    res = VResult(a, a_inv, "learned", float(conds.max()), {"none": 1.0, "hadamard": had, "learned": lrn})
    inv_err = np.abs(a @ a_inv - np.eye(hd)).max()
    if c.min() < DENOM_MIN / 2 or inv_err > 1e-4 or not np.all(np.isfinite(a)):
        res.reason = f"not safely invertible (min 1+v.u {c.min():.3f}, |A A^-1 - I| {inv_err:.1e})"
    elif res.cond > max_cond * 1.05:
        res.reason = f"cond {res.cond:.1f} > {max_cond:g}"
    elif lrn >= had:
        res.reason = "does not beat Hadamard on held-out text"
    if res.reason:
        res.a = res.a_inv = np.broadcast_to(hn, (n, hd, hd)).copy()
        res.choice, res.cond = "hadamard", 1.0
    res.seconds = time.time() - t0
    return res
