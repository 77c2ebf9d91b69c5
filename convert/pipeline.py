"""Apply the converter's transforms to a GGUF held in memory.

Order: NEOX->NORM re-layout (only with K-sort), pair smoothing, K-sort, V/O
rotation. Exact on any storage type: re-layout and K-sort move whole Q/K rows,
smoothing scales Q/K rows by powers of two. The V/O rotation mixes rows and
columns, so W_v and W_o are dequantized and stored again in `requant_type`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from pykvq import cache_types
from pykvq.progress import progress_bar

from . import hadamard, ksort, rows, smooth
from .calib import Calib
from .geometry import head_rows, pair_channels, pair_perms_to_channels
from .gguf_io import ConvertError, GGUFModel, Tensor
from .rope_layout import neox_to_norm

VERSION = "0.1.0"


@dataclass
class Options:
    ksort: bool = False
    ksort_key: str = "auto"              # "weight" (paper: W_k pair row norm), "calib" (K pair RMS), "auto"
    smooth_qk: bool = False
    alpha: float | None = None           # fixed smoothing alpha; None: chosen per layer
    rotate_v: str = "none"               # "hadamard" or "none"
    cache_type_k: str | None = None      # what the file is prepared for (None: a default per transform)
    cache_type_v: str | None = None
    requant_type: str = "q8_0"           # storage of tensors a transform must requantize

    def resolved_types(self) -> tuple[str, str]:
        default = "bfp4_32" if self.ksort else "q4_0"
        k = self.cache_type_k or default
        v = self.cache_type_v or (default if self.rotate_v != "none" else k)
        for t in (k, v):
            cache_types.resolve(t)
        return k, v


@dataclass
class Report:
    alphas: list = field(default_factory=list)            # per layer: chosen alpha (None = not smoothed)
    requantized: list = field(default_factory=list)
    scale_stats: dict = field(default_factory=dict)       # f16 block scales rounded by smoothing (subnormals)


def _name(i: int, what: str) -> str:
    return f"blk.{i}.{what}"


def _get(m: GGUFModel, name: str, required: bool = True) -> Tensor | None:
    t = m.tensors.get(name)
    if t is None and required:
        raise ConvertError(f"tensor {name} not found (fused QKV weights are not supported)")
    return t


def _permute(m: GGUFModel, i: int, q_rows: np.ndarray, k_rows: np.ndarray) -> None:
    for what, r in (("attn_q.weight", q_rows), ("attn_q.bias", q_rows),
                    ("attn_k.weight", k_rows), ("attn_k.bias", k_rows)):
        t = _get(m, _name(i, what), required=what.endswith("weight"))
        if t is not None:
            m.tensors[t.name] = rows.permute_rows(t, r)


def _scale(m: GGUFModel, i: int, q_f: np.ndarray, k_f: np.ndarray, stats: dict) -> None:
    for what, f in (("attn_q.weight", q_f), ("attn_q.bias", q_f),
                    ("attn_k.weight", k_f), ("attn_k.bias", k_f)):
        t = _get(m, _name(i, what), required=what.endswith("weight"))
        if t is not None:
            m.tensors[t.name] = rows.scale_rows(t, f, stats)


def apply(m: GGUFModel, opts: Options, calib: Calib | None, *, progress: bool | None = None) -> Report:
    """Transform m in place; returns what was chosen per layer."""
    from .geometry import geometry
    g = geometry(m)
    if m.meta("pykvq.version") is not None:
        raise ConvertError("the input was already converted by pykvq; convert the original instead")
    rope_scaling = str(m.arch_meta("rope.scaling.type", "none"))
    if opts.ksort and rope_scaling not in ("none", "linear"):
        raise ConvertError(f"K-sort with {rope_scaling} rope scaling is not supported (its ramp depends on "
                           "the pair's position)")
    if opts.smooth_qk and calib is None:
        raise ConvertError("smoothing needs calibration statistics")
    if opts.rotate_v != "none" and g.head_dim & (g.head_dim - 1):
        raise ConvertError(f"--rotate-v hadamard needs a power-of-two head size, got {g.head_dim}")
    type_k, type_v = opts.resolved_types()
    for which, t in (("K", type_k), ("V", type_v)):
        if g.head_dim % _block(t):
            raise ConvertError(f"cache type {t} ({which}) has blocks of {_block(t)}, which do not divide "
                               f"the head size {g.head_dim}")
    key_kind = opts.ksort_key if opts.ksort_key != "auto" else ("calib" if calib is not None else "weight")
    if opts.ksort and key_kind == "calib" and calib is None:
        raise ConvertError("--ksort-key calib needs calibration text")

    rep = Report()
    hd, G = g.head_dim, g.group
    relayout = opts.ksort and g.layout == "neox"
    k_quantized = type_k not in cache_types.UNQUANTIZED
    if relayout:
        p = neox_to_norm(g)
        relayout_rows = head_rows(p, g.n_head, hd), head_rows(p, g.n_head_kv, hd)
    gl = g.with_layout("norm") if relayout else g                          # the layout after re-layout
    ch = pair_channels(gl)                                                 # [P, 2]
    for i in progress_bar(range(g.n_layer), desc="transforming layers", enable=progress, unit="layer"):
        if relayout:
            _permute(m, i, *relayout_rows)

        s = np.ones((g.n_head_kv, g.n_pairs), np.float32)
        if opts.smooth_qk:
            if opts.alpha is None:
                c = smooth.choose(calib.q[i], calib.k[i], calib.pos, g, type_k, ksort=opts.ksort,
                                  rotate=k_quantized and not opts.ksort)
                s = c.scales
                rep.alphas.append(c.alpha)
            else:
                s = smooth.fixed_scales(calib.q[i], calib.k[i], calib.pos, g, opts.alpha)
                rep.alphas.append(opts.alpha)
            kf = np.ones((g.n_head_kv, hd), np.float32)
            kf[:, ch[:, 0]] = 1.0 / s
            kf[:, ch[:, 1]] = 1.0 / s
            _scale(m, i, np.repeat(1.0 / kf, G, axis=0).reshape(-1), kf.reshape(-1), rep.scale_stats)

        if opts.ksort:
            if key_kind == "calib":
                key = calib.k_pair_rms(i) / s
            else:
                key = ksort.weight_key(rows.to_f32(m.tensors[_name(i, "attn_k.weight")]), gl)
            perm = ksort.pair_order(key, g)
            cp = pair_perms_to_channels(perm, g)
            _permute(m, i, head_rows(np.repeat(cp, G, axis=0), g.n_head, hd), head_rows(cp, g.n_head_kv, hd))
            ff = ksort.freq_factors(perm, g)
            m.tensors[_name(i, "kvq_rope_freqs")] = Tensor(_name(i, "kvq_rope_freqs"), QT.F32, ff)

        if opts.rotate_v == "hadamard":
            wv, wo = m.tensors[_name(i, "attn_v.weight")], m.tensors[_name(i, "attn_output.weight")]
            bv = m.tensors.get(_name(i, "attn_v.bias"))
            wv2, bv2, wo2 = hadamard.rotate_v(rows.to_f32(wv), None if bv is None else rows.to_f32(bv),
                                              rows.to_f32(wo), g.n_head, g.n_head_kv, hd)
            for old, new in ((wv, wv2), (wo, wo2)):
                out_type = opts.requant_type if old.quantized or opts.requant_type in ("f32", "f16", "bf16") else "f32"
                m.tensors[old.name] = rows.from_f32(old.name, new, out_type)
                if i == 0:
                    rep.requantized.append(f"{old.name.split('.', 2)[2]}: {old.qtype.name} -> "
                                           f"{m.tensors[old.name].qtype.name}")
            if bv is not None:
                m.tensors[bv.name] = rows.from_f32(bv.name, bv2, "f32")

    # what is baked, for the runtime and for people
    m.set("pykvq.version", VERSION, VT.STRING)
    m.set("pykvq.baked.ksort", bool(opts.ksort), VT.BOOL)
    if opts.ksort:
        m.set("pykvq.baked.ksort_key", key_kind, VT.STRING)
    m.set("pykvq.baked.smooth_qk", bool(opts.smooth_qk), VT.BOOL)
    if opts.smooth_qk:
        m.set("pykvq.baked.smooth_alpha", [(-1.0 if a is None else float(a)) for a in rep.alphas],
              VT.ARRAY, VT.FLOAT32)
    m.set("pykvq.baked.rotate_v", opts.rotate_v, VT.STRING)
    if relayout:
        m.set("pykvq.rope.layout", "norm", VT.STRING)
    if calib is not None:
        m.set("pykvq.calib.source", calib.source, VT.STRING)
    m.set("pykvq.cache.type_k", type_k, VT.STRING)
    m.set("pykvq.cache.type_v", type_v, VT.STRING)
    return rep


def _block(type_name: str) -> int:
    from pykvq.ref import bfp
    if type_name in bfp.FORMATS:
        return bfp.FORMATS[type_name].block
    return 1 if type_name in cache_types.UNQUANTIZED else 32
