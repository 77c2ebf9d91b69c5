#!/usr/bin/env python3
"""Fake-quantization study for long contexts (issue 40): an exact recent window and sinks, keys grouped along
tokens per channel, fewer bits, measured at 4096 tokens before anything is built into the runtime.

    python scripts/longctx_study.py [--model smollm2-135m] [--ctx 4096] [--windows 2] [--out results/longctx_study]

The HF model (f32, as scripts/prerope_study.py runs it) attends through a function of ours that holds, for every
layer, both the exact keys / values and their fake-quantized cache rows, and for each query t reads a key s exactly
when s is a sink (s < S) or inside the recent window, else its quantized row. With token groups of G, a key
leaves the window only when its whole group has (its group ends at or before t - W + 1), as a runtime that
quantizes complete groups would. The metric is the next-token KLD against the unquantized model over the second
half of each window (as llama-perplexity scores a chunk), on WikiText-2 test text never calibrated on.

Key rows are quantized pre-RoPE as the runtime's --prerope-k cache holds them: (k - mean) / scale with the
converter's Fisher scale, then per token blocks of 32 (upstream's online Hadamard over the head, then the type),
or per channel along groups of G tokens (KIVI's asymmetric min / max, f16 scale and minimum per group, no
Hadamard), or per token with each head's channels split by importance (`mix<hi><lo>`: the rotary pairs of
largest F_c var_c in hi bits, the rest in lo bits, q53_64's layout and rule at other widths, a `t` before a width
coding that half as one 32-value trellis block (tcq*_64's rule: `mix4t2` is q4t2_64's kind); `lsq<b>`: b bits,
the head's Hadamard, scales by least squares). Values: per token, Hadamard over the head, then the type (the
runtime's); or split by importance (`vmix<hi><lo>`: channels ordered by w_c E[v_c^2]; `vklt<hi><lo>`: halves of
the w-whitened eigenbasis of E[v v^T]; `vsc<b>`: channels scaled by sqrt(w_c) before the Hadamard), where a trailing
F / W / I picks w: the backward pass's diagonal Fisher (default), W_o's column norms, or 1. The post-RoPE q8_0
row is stock llama.cpp's q8_0 cache (with its Hadamard) for the ratio the issue's targets are stated in. A row's
`salient` fraction of each KV head's tokens past the sinks is also read exactly: by the attention they receive from
every query (an oracle, the future included), by the attention received from the queries before each one (H2O's
rule), or by their own rounding error.

Bits per value count the window and sinks as f16 at the context length used. Cost: ~1 min per row and window
on 2 cores for SmolLM2 at 4096 tokens.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from convert import cache_domain, prerope  # noqa: E402
from pykvq.ref import roundtrip, scale_search  # noqa: E402
from pykvq.ref.stock import _roundtrip_signed_max as roundtrip_signed  # noqa: E402
from prerope_study import rot  # noqa: E402  (blocks of n channels times the Hadamard)


@dataclass(frozen=True)
class Row:
    name: str
    k: str                 # "q8_0@post" | per-token type ("q4_0", "int3", "lsq3") | "grp<b>x<G>" (token groups)
                           # | "mix<hi><lo>" (each head's 64 channels split by importance: hi / lo-bit halves)
    v: str                 # per-token type
    window: int = 0        # W recent tokens exact
    sinks: int = 0         # S first tokens exact
    vwindow: int | None = None   # the values' own window (None: W); keys and values can keep different windows
    wtype: str = "f16"     # how the window and sinks are held: f16 (exact) or q8_0 (per token, the head's Hadamard)
    salient: float = 0.0   # this fraction of each KV head's other tokens also read exactly (heavy hitters)
    sal_by: str = "oracle"  # which: "oracle" (most attention received from every query, the future's included:
                            # a bound), "h2o" (most received from the queries before each one) or "err" (largest
                            # own rounding error, known when the row is written); "evict*": what a runtime can do,
                            # a token chosen when it leaves the window, from a store that only loses members
                            # (H2O's running sums: "evict" per KV head, "evictl" one store per layer for all
                            # heads' rows, "evictm" one for the model by every layer's and head's attention,
                            # "evictf" per head with each score frozen when the token leaves); "qbar" / "qbarl"
                            # (per head / per layer): the same store by a static score, each key's logit against
                            # the text's mean query before RoPE; "qbarm" one store for the model by the sum of every
                            # layer's and head's standardized score, "qbarc" / "qbarlc" (per head / per layer)
                            # against the mean of the queries up to the key's own, "qbarlx" per layer against
                            # another text's mean query (what a file could hold)

    def vwin(self) -> int:
        return self.window if self.vwindow is None else self.vwindow

    def group(self) -> int:
        return int(self.k.split("x")[1]) if self.k.startswith("grp") else 1


def type_bits(t: str) -> float:
    if t.startswith("grp"):
        b, g = t[3:].split("x")
        return int(b) + 32 / int(g)                   # f16 scale and minimum per group
    if t.startswith(("mix", "vmix", "vklt")):
        hi, lo = re.findall(r"t?\d", t.rstrip("FWI"))[-2:]
        return (int(hi[-1]) + int(lo[-1])) / 2 + 0.5  # an f16 scale per half of 32
    if t.startswith("vsc"):
        return int(t[3]) + 0.5
    if t.startswith("lsq"):
        return int(t[3]) + 0.5
    if t.startswith(("tcq", "nuq")):
        from pykvq.cache_types import bits_per_value
        return bits_per_value(t)
    return {"q8_0": 8.5, "q4_0": 4.5, "int3": 3.5, "int2": 2.5, "f16": 16.0}[t.split("@")[0]]


def row_bits(r: Row, ctx: int) -> float:
    wb = type_bits(r.wtype)
    ek, ev = min(ctx, r.window + r.sinks), min(ctx, r.vwin() + r.sinks)
    bk, bv = (type_bits(x) * (1 - r.salient) + wb * r.salient for x in (r.k, r.v))
    return ((ctx - ek) * bk + ek * wb + (ctx - ev) * bv + ev * wb) / (2 * ctx)


def lsq_blocks(x: np.ndarray, bits: int) -> np.ndarray:
    """q*_0's rule at `bits` with each 32-block's scale by least squares (pykvq/ref/scale_search.py), read back."""
    half = 1 << (bits - 1)
    d, q = scale_search.quantize(x.reshape(-1, 32), half)
    return ((q.astype(np.float32) - half) * d.astype(np.float32)[:, None]).reshape(x.shape)


def trellis_blocks(x: np.ndarray, k: int) -> np.ndarray:
    """x [..., n]: each row of n a tail-biting trellis block (tcq*_64's rule and tables at n values), read back."""
    from pykvq.ref import tcq
    n = x.shape[-1]
    v = x.reshape(-1, n).astype(np.float32)
    rms = np.sqrt((v.astype(np.float64) ** 2).mean(axis=1))
    z = (v / np.where(rms > 0, rms, 1)[:, None]).astype(np.float32)
    lut = tcq.levels(k)
    free = tcq.viterbi(z, k, lut, None, n // 2)
    y = lut[tcq.viterbi(z, k, lut, free[:, n // 2 - 1] >> k, 0)].astype(np.float64)
    yy = (y * y).sum(axis=1)
    d = ((v * y).sum(axis=1) / np.where(yy > 0, yy, 1)).astype(np.float16).astype(np.float32)
    return (d[:, None] * y).astype(np.float32).reshape(x.shape)


def half_code(y: np.ndarray, spec: str) -> np.ndarray:
    """One half's code: "<b>" is q*_0's rule at b bits with scales by least squares, "t<b>" a b-bit trellis."""
    return trellis_blocks(y, int(spec[1])) if spec[0] == "t" else lsq_blocks(y, int(spec))


def importance_split(x: np.ndarray, order: np.ndarray, hi, lo) -> np.ndarray:
    """x [T, n_kv, hd]: per head, the channels order[h][:hd/2] (the important rotary pairs) in hi bits and the rest in
    lo bits, each 32 turned by its own 32-wide Hadamard, scales by least squares (q53_64's rule at other widths);
    hi / lo as half_code names them (a trellis half: "t2")."""
    out = np.empty_like(x)
    n = x.shape[-1] // 2
    for h in range(x.shape[1]):
        o = order[h]
        y = x[:, h, o]
        out[:, h, o] = np.concatenate([rot(half_code(rot(y[:, :n], 32), str(hi)), 32),
                                       rot(half_code(rot(y[:, n:], 32), str(lo)), 32)], axis=1)
    return out


def per_token(x: np.ndarray, t: str, hd: int) -> np.ndarray:
    """x [..., hd]: the online Hadamard over the head, then the type along it (blocks of 32)."""
    if t.startswith("lsq"):
        return rot(lsq_blocks(rot(x, hd), int(t[3])), hd)
    if t.startswith("tcq"):        # the trellis types through the library's codec (numpy's rule, bit for bit; faster)
        from convert.codebook import library_roundtrip
        return rot(library_roundtrip(rot(x, hd), t), hd)
    if t.startswith("int"):        # symmetric, one f16 scale per 32 (q*_0's rule at b bits)
        q = lambda z: roundtrip_signed(z, 2 ** (int(t[3:]) - 1))  # noqa: E731
    else:
        q = lambda z: roundtrip(z, t, lsq=t in ("q4_0", "q5_0"))  # noqa: E731
    return rot(q(rot(x, hd)), hd)


def token_groups(x: np.ndarray, bits: int, g: int) -> np.ndarray:
    """x [T, n_kv, hd]: per channel, groups of g tokens, asymmetric min / max with bits (f16 scale and min)."""
    T = x.shape[0]
    n = (T + g - 1) // g * g
    xp = np.concatenate([x, np.repeat(x[-1:], n - T, axis=0)]) if n > T else x
    b = xp.reshape(n // g, g, *x.shape[1:]).astype(np.float32)
    lo = b.min(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
    d = ((b.max(axis=1, keepdims=True) - lo) / (2 ** bits - 1)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.clip(np.round((b - lo) / d), 0, 2 ** bits - 1), 0)
    return (q * d + lo).reshape(n, *x.shape[1:])[:T]


def v_transforms(v: np.ndarray, fv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's V samples [T, n_kv, hd] and channel weights w [n_kv, hd] (a diagonal Fisher or a stand-in) -> per
    head (the channel order by w_c E[v_c^2], most important first; T [n_kv, hd, hd] and its inverse): z = T v is the
    w-whitened V in the eigenbasis of its second moment, sorted by eigenvalue, so an error of z weighs alike in every
    channel (to the diagonal weights' approximation) and the first channels carry the most."""
    x = v.astype(np.float64)
    sq = (x ** 2).mean(axis=0)
    order = np.argsort(-(fv * sq), axis=1, kind="stable")
    n_kv, hd = fv.shape
    t = np.empty((n_kv, hd, hd))
    ti = np.empty_like(t)
    for h in range(n_kv):
        w = np.sqrt(np.maximum(fv[h], 1e-30))
        u = x[:, h] * w
        lam, vec = np.linalg.eigh(u.T @ u / len(u))
        vec = vec[:, np.argsort(-lam)]
        t[h] = vec.T * w[None]                 # z = U^T diag(w) v
        ti[h] = vec / w[:, None]               # v = diag(1/w) U z
    return order, t, ti


class Harness:
    """The study's model with an attention function that mixes exact and quantized rows per (query, key)."""

    def __init__(self, model: str, threads: int):
        import torch
        from prerope_study import Study
        from transformers import AttentionInterface
        st = Study(model, 4, 512, threads)
        self.st, self.g = st, st.g
        self.recv_model, self.qbar_model, self.text, self.qbar, self.qmean = {}, {}, None, {}, {}
        c, g = st.calib, st.g
        dom = cache_domain.Domain()
        self.kstats, self.korder = [], []
        for i in range(g.n_layer):
            kp = cache_domain.prerope_keys(c, i, g, dom)
            f = cache_domain.prerope_key_fisher(c, i, g, dom)
            self.kstats.append(prerope.stats(kp, "fisher", f))
            imp = f * kp.astype(np.float64).var(axis=0)          # what an error in the channel costs: F_c var_c
            po = np.argsort(-(imp[:, 0::2] + imp[:, 1::2]), axis=1, kind="stable")   # whole NORM pairs, as baked
            self.korder.append(np.stack([2 * po, 2 * po + 1], axis=-1).reshape(imp.shape))
        from convert.calib import value_sensitivity
        # V's channel weights: the backward pass's diagonal Fisher ("F"), W_o's column norms ("W"), or none ("I")
        self.vmaps = {}
        for kind in "FWI":
            maps = []
            for i in range(g.n_layer):
                if kind == "F":
                    fv = (c.gv[i].astype(np.float64) ** 2).mean(axis=0)
                elif kind == "W":
                    wo = st.model.model.layers[i].self_attn.o_proj.weight.detach().numpy()
                    fv = value_sensitivity(wo, g)
                else:
                    fv = np.ones((g.n_head_kv, g.head_dim))
                maps.append((*v_transforms(c.v[i], fv), np.sqrt(np.maximum(fv, 1e-30))))
            self.vmaps[kind] = maps
        self.row: Row | None = None
        self.kq: dict[int, np.ndarray] = {}
        self.kw: dict[int, np.ndarray] = {}
        self.kerr: dict[int, np.ndarray] = {}
        ml = sys.modules[type(st.model.model.layers[0].self_attn).__module__]
        prev, h = ml.apply_rotary_pos_emb, self

        def rope(q, k, cos, sin, *a, **kw):
            q2, k2 = prev(q, k, cos, sin, *a, **kw)
            r = h.row
            if r is None or r.sal_by.startswith("qbar"):   # a static score per key: the mean query's logit
                n_kv, hd = k.shape[1], k.shape[-1]
                if r is not None and r.sal_by in ("qbarc", "qbarlc"):   # the mean of the queries up to the key's own
                    qc = torch.cumsum(q[0], 1) / torch.arange(1, q.shape[2] + 1)[None, :, None]
                    sc = torch.einsum("grtd,gtd->gt", qc.reshape(n_kv, -1, q.shape[2], hd), k[0])
                else:                                       # qbarlx: the mean query of another text (a file's)
                    qm = q[0].mean(1)
                    if r is None:
                        h.qmean.setdefault(h.text, {})[st.layer] = qm.detach()
                    elif r.sal_by == "qbarlx":
                        qm = next(v[st.layer] for t, v in h.qmean.items() if t != h.text)
                    sc = torch.einsum("grd,gtd->gt", qm.reshape(n_kv, -1, hd), k[0])   # [n_kv, T]
                h.qbar[st.layer] = sc.detach()
                if r is None:                               # qbarm: every layer's and head's, each standardized
                    z = (sc - sc.mean(1, keepdim=True)) / sc.std(1, keepdim=True)
                    h.qbar_model[h.text] = h.qbar_model[h.text] + z.sum(0).detach()
            if r is not None:                        # the quantized cache's keys, after RoPE, for the attention
                i = st.layer
                if r.k.endswith("@post"):
                    x = k2[0].detach().numpy().transpose(1, 0, 2)
                    kq = per_token(x, r.k.split("@")[0], g.head_dim)
                    h.kq[i] = torch.from_numpy(np.ascontiguousarray(kq.transpose(1, 0, 2), np.float32))[None]
                else:
                    x = k[0].detach().numpy().transpose(1, 0, 2)[..., st.idx]        # [T, n_kv, hd] NORM
                    mean, scale = h.kstats[i]
                    y0 = (x - mean) / scale                  # what the cache quantizes
                    y = y0
                    if r.k.startswith("grp"):
                        y = token_groups(y, *map(int, r.k[3:].split("x")))
                    elif r.k.startswith("mix"):
                        y = importance_split(y, h.korder[i], *re.findall(r"t?\d", r.k[3:]))
                    else:
                        y = per_token(y, r.k, g.head_dim)
                    h.kerr[i] = ((y - y0) ** 2).sum(-1)                                      # [T, n_kv]
                    xq = torch.from_numpy(np.ascontiguousarray((y * scale + mean)[..., st.inv].transpose(1, 0, 2),
                                                               np.float32))[None]
                    h.kq[i] = prev(q, xq, cos, sin, *a, **kw)[1]
                    if r.wtype != "f16":             # the window's rows held in another type (pre-RoPE, as the cache)
                        y8 = per_token(y0, r.wtype, g.head_dim)
                        x8 = torch.from_numpy(np.ascontiguousarray((y8 * scale + mean)[..., st.inv].transpose(1, 0, 2),
                                                                   np.float32))[None]
                        h.kw[i] = prev(q, x8, cos, sin, *a, **kw)[1]
            return q2, k2
        ml.apply_rotary_pos_emb = rope

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
            from transformers.models.llama.modeling_llama import repeat_kv
            r, i = h.row, st.layer
            n_rep = module.num_key_value_groups
            T = query.shape[2]
            t = torch.arange(T)[:, None]
            sidx = torch.arange(T)[None, :]
            s_e = torch.matmul(query, repeat_kv(key, n_rep).transpose(2, 3)) * scaling
            if r is None:
                mask_q = None
                s = s_e
            else:
                v_np = value[0].detach().numpy().transpose(1, 0, 2)                  # [T, n_kv, hd]
                vq = torch.from_numpy(np.ascontiguousarray(h.quant_v(v_np, r.v, i).transpose(1, 0, 2),
                                                           np.float32))[None]
                s_q = torch.matmul(query, repeat_kv(h.kq[i], n_rep).transpose(2, 3)) * scaling
                if r.wtype != "f16":
                    s_e = torch.matmul(query, repeat_kv(h.kw[i], n_rep).transpose(2, 3)) * scaling
                    value = torch.from_numpy(np.ascontiguousarray(h.quant_v(v_np, r.wtype, i).transpose(1, 0, 2),
                                                                  np.float32))[None]
                G = r.group()
                mask_q = ((sidx // G + 1) * G <= t - r.window + 1) & (sidx >= r.sinks)   # keys read quantized
                s = torch.where(mask_q, s_q, s_e)
                mask_q = (sidx <= t - r.vwin()) & (sidx >= r.sinks)                       # values read quantized
                if r.salient > 0:
                    keep = h.salient_tokens(r, i, s_e, t, sidx, v_np, vq, n_rep)             # [H, T] read exactly
                    s = torch.where(keep, s_e, s)
                    mask_q = mask_q & ~keep
            s = s.masked_fill(sidx > t, float("-inf"))      # causal (one unpadded sequence; the mask given is unused)
            p = torch.softmax(s, dim=-1, dtype=torch.float32)
            if r is None:
                h.recv_model[h.text] = h.recv_model[h.text] + p[0].sum(0)          # [T(q), T(k)]
            if mask_q is None:
                o = torch.matmul(p, repeat_kv(value, n_rep))
            else:
                mq = mask_q.to(p.dtype)
                o = torch.matmul(p * (1 - mq), repeat_kv(value, n_rep)) + torch.matmul(p * mq, repeat_kv(vq, n_rep))
            return o.transpose(1, 2).contiguous(), None
        AttentionInterface.register("pykvq_longctx", attention)
        st.model.config._attn_implementation = "pykvq_longctx"

    def salient_tokens(self, r: Row, i: int, s_e, t, sidx, v_np, vq, n_rep):
        """Which (query, key) pairs read the key exactly, broadcast to [1, n_head, T, T]: the r.salient fraction of
        each KV head's tokens past the sinks (h2o: of the tokens before each query, by their attention so far)."""
        import torch
        T = s_e.shape[-1]
        if r.sal_by in ("h2o", "oracle", "evict", "evictl", "evictf"):   # the exact attention, summed over each KV head's group
            p = torch.softmax(s_e.masked_fill(sidx > t, float("-inf")), dim=-1, dtype=torch.float32)
            a = p[0].reshape(-1, n_rep, T, T).sum(1)                                 # [n_kv, T(q), T(k)]
        if r.sal_by == "evictm":                  # one store for the model: every layer's and head's attention
            a = self.recv_model[self.text][None].expand(s_e.shape[1] // n_rep, T, T)
            return self.evicted_store(r, torch.cumsum(a, dim=1) - a, n_rep)
        if r.sal_by.startswith("evict"):
            return self.evicted_store(r, torch.cumsum(a, dim=1) - a, n_rep)
        if r.sal_by == "qbarm":
            return self.evicted_store(r, self.qbar_model[self.text][None, None, :].expand(s_e.shape[1] // n_rep, T, T),
                                      n_rep)
        if r.sal_by.startswith("qbar"):           # static: each key's logit against the mean query (pre-RoPE)
            return self.evicted_store(r, self.qbar[i][:, None, :].expand(-1, T, T), n_rep)
        if r.sal_by == "h2o":                     # causal: attention received from the queries before each one
            a = torch.cumsum(a, dim=1) - a                                           # from queries u < t
            a[:, :, :r.sinks] = -1.0
            n = torch.clamp(torch.round(r.salient * torch.arange(T)), min=1).long()  # of the tokens so far
            srt = torch.sort(a, dim=-1, descending=True).values
            thr = torch.gather(srt, 2, (n - 1)[None, :, None].expand(a.shape[0], T, 1))
            keep = (a >= thr) & (a > 0)
            return keep.repeat_interleave(n_rep, dim=0)[None]                      # [1, H, T, T]
        if r.sal_by == "oracle":
            score = a.sum(1)                                                         # [n_kv, T] received
        else:                                                                        # own rounding error, K and V
            ev = ((vq[0].numpy() - v_np.transpose(1, 0, 2)) ** 2).sum(-1)            # [n_kv, T]
            ek = self.kerr[i].T
            score = torch.from_numpy(ek / ek.mean(1, keepdims=True) + ev / ev.mean(1, keepdims=True))
        score[:, :r.sinks] = -1.0
        n = max(1, int(round(r.salient * T)))
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep.scatter_(1, torch.topk(score, n, dim=1).indices, True)
        return keep.repeat_interleave(n_rep, dim=0)[None, :, None, :]             # [1, H, 1, T]

    @staticmethod
    def evicted_store(r: Row, recv, n_rep: int):
        """keep [1, H, T, T] of a store filled as tokens leave the window: token e = t - W, first read quantized by
        query t, joins while the store holds fewer than round(salient * t) tokens, else takes the place of the member
        with the least attention received (from queries < t; "evictf": what a member had received when it left the
        window) if it has more; a member that loses its place is quantized for good. recv [n_kv, T(q), T(k)]."""
        import torch
        recv = recv.numpy()
        n_kv, T, _ = recv.shape
        # (evictm: every head holds the same score, so one of them chooses)
        per_layer = r.sal_by in ("evictl", "qbarl", "qbarlc", "qbarlx")
        groups = [[0]] if r.sal_by in ("evictm", "qbarm") else [list(range(n_kv))] if per_layer else \
            [[g] for g in range(n_kv)]
        keep = np.zeros((n_kv, T, T), dtype=bool)
        for g in groups:
            mem, frozen = [], []                       # members, and their scores when they left the window
            for t in range(r.window + r.sinks, T):
                e = t - r.window
                se = float(recv[g, t, e].sum())
                cap = max(1, round(r.salient * t))
                if len(mem) < cap:
                    mem.append(e)
                    frozen.append(se)
                else:
                    sc = frozen if r.sal_by == "evictf" else recv[g, t][:, mem].sum(0)
                    m = int(np.argmin(sc))
                    if se > sc[m]:
                        mem[m], frozen[m] = e, se
                for h in (range(n_kv) if r.sal_by in ("evictm", "qbarm") else g):
                    keep[h, t, mem] = True
        return torch.from_numpy(keep).repeat_interleave(n_rep, dim=0)[None]        # [1, H, T, T]

    def quant_v(self, v: np.ndarray, t: str, i: int) -> np.ndarray:
        """v [T, n_kv, hd] of layer i read back from the cache type t: per_token's types, or split by importance
        (`vmix<hi><lo>`: channels ordered by w_c E[v_c^2]; `vklt<hi><lo>`: the whitened eigenbasis of
        v_transforms), or `vsc<b>`: each channel scaled by sqrt(w_c) before the head's Hadamard."""
        hd = v.shape[-1]
        if t.startswith("v"):                      # a trailing F / W / I names the channel weights (default F)
            kind = t[-1] if t[-1] in "FWI" else "F"
            t = t.rstrip("FWI")
            order, tm, ti, w = self.vmaps[kind][i]
        if t.startswith("vmix"):
            return importance_split(v, order, int(t[4]), int(t[5]))
        if t.startswith("vklt"):
            z = np.einsum("hed,nhd->nhe", tm, v)
            zq = importance_split(z, np.tile(np.arange(hd), (v.shape[1], 1)), int(t[4]), int(t[5]))
            return np.einsum("hed,nhd->nhe", ti, zq)
        if t.startswith("vsc"):
            return per_token(v * w[None], "lsq" + t[3], hd) / w[None]
        return per_token(v, t, hd)

    def logprobs(self, ids: np.ndarray, row: Row | None):
        self.row, self.kq = row, {}
        self.text = hash(ids.tobytes())           # the text's attention received, every head's (evictm's score)
        if row is None:
            self.recv_model[self.text] = self.qbar_model[self.text] = 0.0
        try:
            return self.st.logprobs(ids)
        finally:
            self.row, self.kq = None, {}


def render(meta: dict, results: list) -> str:
    """The markdown table; ratios against the row of today's product (pre-RoPE q4_0 / q4_0, no window) when present.
    No ratio to the fake-quantized q8_0: it leaves out the runtime's own rounding (Q in q8_0 for K·Q, f16
    arithmetic), which dominates stock q8_0's KLD in llama.cpp, so it reads ~40x below the runtime's."""
    ref = next((x["kld"] for x in results if x["k"] == "q4_0" and x["v"] == "q4_0" and not x["window"]
                and not x["sinks"]), None)
    lines = [f"# Long-context fake-quant study: {meta['model']}, {meta['windows']} x {meta['ctx']} tokens", "",
             f"KLD against the unquantized model over {meta['scored']} of each window ({meta['text']}); "
             "bits per value with the window and sinks counted as f16 at this context.", "",
             "| K / V | bits/value | KLD | ÷ pre-RoPE q4_0 / q4_0 | p99 | same top-1 |", "|---|---|---|---|---|---|"]
    for x in results:
        ratio = f"{x['kld'] / ref:.2f}" if ref else "–"
        lines.append(f"| {x['name']} | {x['bits']:.2f} | {x['kld']:.4f} ± {x['kld_se']:.4f} | {ratio} | "
                     f"{x['p99']:.3f} | {x['top1']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=2, help="WikiText-2 test windows of --ctx tokens (default 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="row names separated by semicolons")
    ap.add_argument("--out", default=str(ROOT / "results" / "longctx_study"))
    ap.add_argument("--render", default=None, metavar="JSON", help="only rewrite the .md of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.render:
        d = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(render(d["meta"], d["results"]))
        return 0
    import torch

    from pykvq.data import wikitext_test
    W, S = 128, 4
    rows = [
        Row("q8_0 post-RoPE (stock)", "q8_0@post", "q8_0"),
        Row("q4_0 / q4_0", "q4_0", "q4_0"),
        Row("q4_0 / q4_0 + window 128, sinks 4", "q4_0", "q4_0", W, S),
        Row("q4_0 / q4_0 + sinks 4", "q4_0", "q4_0", 0, S),
        Row("q4_0 / q4_0 + window 128", "q4_0", "q4_0", W, 0),
        Row("q4_0 / q4_0 + window 32, sinks 4", "q4_0", "q4_0", 32, S),
        Row("K groups 4b x 64 / q4_0 + window 128, sinks 4", "grp4x64", "q4_0", W, S),
        Row("int3 / int3", "int3", "int3"),
        Row("int3 / int3 + window 128, sinks 4", "int3", "int3", W, S),
        Row("K groups 3b x 128 / int3 + window 128, sinks 4", "grp3x128", "int3", W, S),
        Row("K groups 3b x 64 / int3 + window 128, sinks 4", "grp3x64", "int3", W, S),
        Row("K groups 2b x 64 / int3 + window 128, sinks 4", "grp2x64", "int3", W, S),
        Row("q4_0 / int3 + window 128, sinks 4", "q4_0", "int3", W, S),
        Row("int3 / int2 + window 128, sinks 4", "int3", "int2", W, S),
        # keys alone (V q8_0), the runtime's default window: halves split by importance (q53_64's layout), other widths
        *[Row(f"K {k} / q8_0 + window 64, sinks 4", k, "q8_0", 64, S)
          for k in ("q4_0", "mix53", "lsq3", "mix42", "mix43", "mix52", "mix32")],
        # keys split by importance with a trellis-coded half (32 values, tcq*_64's rule and tables), same bits
        *[Row(f"K {k} / q8_0 + window 64, sinks 4", k, "q8_0", 64, S) for k in ("mix4t2", "mixt3t2", "mix4t3")],
        # keys alone at 3 bits and below: token groups (per channel) against per-token blocks at the same bits
        *[Row(f"K {k} / q8_0 + window 64, sinks 4", k, "q8_0", 64, S)
          for k in ("int2", "grp2x64", "grp2x32", "grp3x128", "grp2x128")],
        # values alone (K q8_0) at 3.5 bits: uniform, or split by importance (channels or a whitened eigenbasis)
        *[Row(f"V {v} / K q8_0 + window 64, sinks 4", "q8_0", v, 64, S)
          for v in ("lsq3", "vsc3", "vmix42", "vklt42", "vklt42I", "vklt42W", "vmix42W", "vsc3W", "lsq2", "vklt32I")],
        # trellis-coded against nuq at the same bits, keys alone and values alone (2026-12-01: the rows there came from a
        # free-start prototype with a full 256-level table; these are the committed types)
        *[Row(f"K {k} / V {v} + window 64, sinks 4", k, v, 64, S)
          for k, v in (("q8_0", "nuq2_64"), ("q8_0", "tcq2_64"), ("q8_0", "nuq3_64"), ("q8_0", "tcq3_64"),
                       ("nuq2_64", "q8_0"), ("tcq2_64", "q8_0"), ("tcq3_64", "q8_0"))],
        # the window split: keys' and values' own lengths, or held in q8_0 (the 3.5-bit pair's kinds of K / V)
        *[Row(f"mix42 / lsq3 + window K {kw} V {vw}{' in q8_0' if wt != 'f16' else ''}, sinks 4", "mix42", "lsq3",
              kw, S, vw, wt)
          for kw, vw, wt in ((64, 64, "f16"), (0, 0, "f16"), (64, 0, "f16"), (0, 64, "f16"), (128, 0, "f16"),
                             (0, 128, "f16"), (16, 16, "f16"), (128, 128, "q8_0"), (64, 64, "q8_0"))],
    ]
    # heavy hitters: a few tokens past the window read exactly, by attention received (from every query: a bound;
    # from the queries before each: H2O's rule) or by own rounding error
    rows += [Row(f"{k} / {v} + window 64, sinks 4, {fr:.0%} salient by {by}", k, v, 64, S, salient=fr, sal_by=by)
             for k, v in (("q8_0", "tcq2_64"), ("mix32", "q8_0"))
             for fr, by in ((0.0, "oracle"), (0.01, "oracle"), (0.03, "oracle"), (0.03, "err"), (0.01, "h2o"),
                            (0.03, "h2o"))]
    # what a runtime can keep: chosen as tokens leave the window (per head, one store per layer, frozen scores), the
    # store's rows in f16 or in the window's q8_0
    rows += [Row(f"{k} / {v} + window 64, sinks 4{' in q8_0' if wt != 'f16' else ''}, {fr:.0%} salient by {by}", k, v, 64,
                 S, wtype=wt, salient=fr, sal_by=by)
             for k, v in (("mix32", "q8_0"),)
             for fr, by, wt in ((0.0, "evict", "q8_0"), (0.01, "qbarlx", "q8_0"), (0.03, "qbarlx", "q8_0"),
                                (0.01, "qbarlx", "f16"), (0.01, "qbarl", "f16"), (0.01, "qbarlc", "f16"),
                                (0.01, "qbar", "f16"), (0.01, "qbarc", "f16"), (0.01, "qbarm", "f16"),
                                (0.01, "evict", "f16"), (0.01, "evictl", "f16"), (0.01, "evictf", "f16"),
                                (0.01, "evictm", "f16"), (0.01, "evictl", "q8_0"), (0.01, "evictm", "q8_0"),
                                (0.03, "evictm", "q8_0"))]
    if args.only:
        keep = set(args.only.split(";"))
        rows = [r for r in rows if r.name in keep]
    h = Harness(args.model, args.threads)
    ids = h.st.tok(wikitext_test(), return_tensors="np")["input_ids"][0]
    stride = len(ids) // args.windows
    windows = [ids[w * stride: w * stride + args.ctx] for w in range(args.windows)]
    first = args.ctx // 2
    t0 = time.time()
    base = [h.logprobs(w, None)[first:] for w in windows]
    print(f"{args.model}: {args.windows} x {args.ctx} tokens, f32 base {time.time() - t0:.0f} s", flush=True)
    results = []
    for r in rows:
        t0 = time.time()
        kl, top = [], []
        for w, ref in zip(windows, base):
            lp = h.logprobs(w, r)[first:]
            kl.append((torch.exp(ref) * (ref - lp)).sum(-1).numpy())
            top.append((lp.argmax(-1) == ref.argmax(-1)).numpy())
        kl, top = np.concatenate(kl), np.concatenate(top)
        res = {**asdict(r), "bits": row_bits(r, args.ctx), "kld": float(kl.mean()),
               "kld_se": float(kl.std() / np.sqrt(len(kl))), "p99": float(np.percentile(kl, 99)),
               "top1": float(top.mean()), "seconds": time.time() - t0}
        results.append(res)
        print(f"{r.name:52s} {res['bits']:.2f} b  KLD {res['kld']:.4f} ± {res['kld_se']:.4f}  p99 {res['p99']:.3f}  "
              f"top1 {res['top1']:.1%}  ({res['seconds']:.0f} s)", flush=True)
    out = Path(f"{args.out}_{args.model}_ctx{args.ctx}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "ctx": args.ctx, "windows": args.windows, "scored": f"positions {first}..{args.ctx - 1}",
            "text": "WikiText-2 raw test"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    out.with_suffix(".md").write_text(render(meta, results))
    print(f"wrote {out}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
