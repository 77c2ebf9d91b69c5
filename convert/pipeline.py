"""Apply the converter's transforms to a GGUF held in memory.

Order: NEOX->NORM re-layout (only with K-sort), pair smoothing, K-sort, V/O
rotation. Exact on any storage type: re-layout and K-sort move whole Q/K rows,
smoothing scales Q/K rows by powers of two. The V/O rotation mixes rows and
columns, so W_v and W_o are dequantized and stored again in `requant_type`.
With --prerope-k the per-channel mean and scale of the pre-RoPE keys are then
measured in the resulting layout and stored beside the weights (prerope.py).
"""
from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from pykvq import cache_types
from pykvq.cache_info import window_bits
from pykvq.keys import Keys, Tensors, Values
from pykvq.progress import progress_bar
from pykvq.ref import q53

from . import (cache_domain, codebook, hadamard, invariant, ksort, layer_types, learn_k, learn_v, prerope, rows, smooth,
               window_weights)
from .calib import Calib
from .geometry import SUPPORTED_ARCHS, head_rows, pair_channels, pair_perms_to_channels
from .gguf_io import ConvertError, GGUFModel, Tensor
from .rope_layout import neox_to_norm

log = logging.getLogger("pykvq.convert")

VERSION = "0.1.0"
# heavy hitters (pykvq.cache.kv_heavy) are off unless --kv-heavy asks: inside a budget they are paid from it as the
# window is, and whether that pays depends on the model. 4096 tokens, KLD x stock q8_0, --bits 3 with 0.01 inside its
# 3.00 bits: SmolLM2 7.5x -> 6.1x, Qwen2.5-Coder-1.5B 3.0x -> 3.4x (heavy hitters gain only 3% there); at --bits 2.5
# the types are at their floor: SmolLM2 19x -> 23x. On top of the budget (3.08 bits) SmolLM2 gets 5.5x. --kv-heavy auto
# judges a file with HEAVY_TRIED against one without, as --kv-window auto judges lengths.
HEAVY_TRIED = 0.01


@dataclass
class Options:
    ksort: bool = False
    ksort_key: str = "auto"              # "weight" (paper: W_k pair row norm), "calib" (K pair RMS), "auto"
    smooth_qk: bool = False
    alpha: float | None = None           # fixed smoothing alpha; None: chosen per layer
    rotate_v: str = "none"               # "hadamard", "learned" or "none"
    learn_k: bool = False                # learned per-pair complex scale of Q/K (learn_k.py)
    learn_steps: int = 100               # gradient steps per layer for the learned transforms
    learn_rank: int | None = None        # rank-one factors of the learned V transform (None: head_dim)
    max_cond: float = learn_v.MAX_COND   # bound on cond(A) of the learned V transform
    learn_loss: str = "output"           # V objective: "output" (through W_o) or "fisher" (diagonal Fisher)
    learn_init: str = "hadamard"         # V starting point: "hadamard" or "identity"
    cache_type_k: str | None = None      # what the file is prepared for (None: a default per transform)
    cache_type_v: str | None = None
    requant_type: str = "q8_0"           # storage of tensors a transform must requantize
    codebooks: str = "auto"              # nuq codebooks: "fisher", "kmeans", "uniform", "none"; auto: fisher
                                         # when a nuq type is targeted (or kv_bits is set), else none
    q_norm: bool = True                  # Q-Norm folded into the codebooks
    kv_bits: float | None = None         # bits/value budget: per-layer K/V types from `ladder`
    ladder: tuple = layer_types.DEFAULT_LADDER
    ladder_k: tuple | None = None        # K's candidates when they differ from V's (None: `ladder`; the converter's
                                         # command line gives layer_types.DEFAULT_LADDER, V's VALUE_LADDER)
    ladder_k_auto: bool = False          # ladder_k is the pre-RoPE default: dropped where halves types cannot apply
    cpu_types: bool = False              # the default ladders may take CPU-only types (layer_types.CPU_VALUE_TYPES)
    prerope_k: bool = False              # pre-RoPE, centred K cache: blk.N.kvq_k_mean / kvq_k_scale (prerope.py)
    prerope_scale: str = prerope.DEFAULT_SCALE   # one of prerope.SCALES ("one": the mean only)
    prerope_power: float | None = None   # the fisher scale's power (None: prerope.fisher_power of the K types)
    kv_sinks: int = 4                    # the runtime's default exact sinks / window for a pre-RoPE file
    kv_window: int = 64                  # (pykvq.cache.kv_sinks / kv_window; 0: off)
    kv_window_type: str = "q8_0"         # their rows' type (pykvq.cache.kv_window_type): f16 or q8_0
    kv_heavy: float = 0.0                # and heavy hitters, this fraction of the context (pykvq.cache.kv_heavy)
    kv_bits_ctx: int = 0                 # > 0: kv_bits counts that window at this many cells (0: the cache alone)
    budget_weights: str = "window"       # kv_bits' errors per token: "window" (only what the file's window leaves
                                         # quantized: calib.py's backward pass, or window_weights.py), "uniform"

    def ladder_for(self, which: str) -> tuple:
        """The budget's candidate types for "k" or "v"."""
        return self.ladder_k if which == "k" and self.ladder_k is not None else self.ladder

    def k_candidates(self) -> tuple:
        """The types the file's keys may take: the budget's K ladder, else the one K type."""
        return self.ladder_for("k") if self.kv_bits is not None else (self.resolved_types()[0],)

    def halves_k(self) -> bool:
        """Whether the keys may be of a halves type (q53_64, q42_64): the file then lays every head's pairs out by
        importance, and the runtime turns every layer's keys within each half (llama_kvq_halves_k). A budget whose
        K ladder holds one is assumed to choose one (_refit_plain_k_codebooks when it does not)."""
        return any(t in q53.HALVES_TYPES for t in self.k_candidates())

    def fisher_power(self) -> float:
        """The fisher K scale's power: as given, else by the bits of the types the keys may take."""
        if self.prerope_power is not None:
            return self.prerope_power
        return prerope.fisher_power([layer_types.bits_per_value(t) for t in self.k_candidates()])

    def cheapest_bits(self) -> float:
        """The fewest bits/value a budget can reach: the mean of K's and V's cheapest candidate types."""
        return sum(min(layer_types.bits_per_value(t) for t in self.ladder_for(w)) for w in "kv") / 2

    def window_bits(self) -> float:
        """Bits/value the file's default window adds at kv_bits_ctx cells (its rows: the sinks, the window, the row
        being written and the heavy hitters, over the cells; the runtime's own count)."""
        return (window_bits(self.kv_sinks, self.kv_window, self.kv_bits_ctx, self.kv_window_type, self.kv_heavy)
                if self.prerope_k else 0.0)

    def cache_bits(self) -> float | None:
        """The budget the per-layer types share: kv_bits less what the window takes."""
        return None if self.kv_bits is None else self.kv_bits - self.window_bits()

    def window_weighted(self) -> bool:
        """Whether the budget's errors weigh each token by what the file's window leaves of it."""
        return (self.kv_bits is not None and self.budget_weights == "window" and self.prerope_k
                and (self.kv_sinks > 0 or self.kv_window > 0))

    def exact_positions(self) -> int:
        """Calibration positions the runtime reads exactly from every query (the file's default sinks): the K
        codebooks are fitted without them."""
        return self.kv_sinks if self.prerope_k and self.kv_sinks > 0 else 0

    def codebook_method(self) -> str:
        if self.codebooks != "auto":
            return self.codebooks
        k, v = self.resolved_types()
        return "fisher" if self.kv_bits is not None or _is_nuq(k) or _is_nuq(v) else "none"

    def needs_fisher(self) -> bool:
        return self.codebook_method() != "none" or self.kv_bits is not None

    def needs_samples(self) -> bool:
        """Whether calibration must keep every token's Q / K / V (not only per-channel moments)."""
        return (self.smooth_qk or self.learn_k or self.rotate_v == "learned" or self.needs_fisher())

    def needs_gradients(self) -> bool:
        """Whether calibration must take the loss's gradients (Fisher codebooks, budgets, the fisher K scale)."""
        return (self.needs_fisher() or self.rotate_v == "learned" or
                (self.prerope_k and (self.prerope_scale == "fisher" or self.halves_k())))

    def check_learning(self) -> None:
        """What the learned transforms cannot do (checked before calibration, to fail fast)."""
        type_k, type_v = self.resolved_types()
        if self.rotate_v == "learned" and type_v in cache_types.UNQUANTIZED:
            raise ConvertError(f"--rotate-v learned is learned for a quantized V cache type, got {type_v}")
        if self.learn_k and self.ksort:
            raise ConvertError("--learn-k with --ksort is not supported (the learned pair transform would have "
                               "to be learned through the sort); use one or the other")
        if self.learn_k and type_k in cache_types.UNQUANTIZED:
            raise ConvertError(f"--learn-k is learned for a quantized K cache type, got {type_k}")

    def resolved_types(self) -> tuple[str, str]:
        default = {w: "bfp4_32" if self.ksort else "q4_0" for w in "kv"}
        if self.kv_bits is not None:    # the uniform type nearest the budget from below, for logs / fallbacks
            for w in "kv":
                fit = [t for t in self.ladder_for(w) if layer_types.bits_per_value(t) <= self.cache_bits()]
                default[w] = max(fit or self.ladder_for(w), key=layer_types.bits_per_value)
        k = self.cache_type_k or default["k"]
        v = self.cache_type_v or (default["v"] if self.rotate_v != "none" or self.kv_bits is not None else k)
        for t in (k, v):
            cache_types.resolve(t)
        return k, v


@dataclass
class Report:
    alphas: list = field(default_factory=list)            # per layer: chosen alpha (None = not smoothed)
    requantized: list = field(default_factory=list)
    layer_types_k: list = field(default_factory=list)
    layer_types_v: list = field(default_factory=list)
    cb_errors: list = field(default_factory=list)          # per layer: {(kv, type): fisher-weighted error}
    window_share: list = field(default_factory=list)       # per layer: {"k"/"v": mean read weight} (window budgets)
    bits_per_value: float | None = None
    scale_stats: dict = field(default_factory=dict)       # f16 block scales rounded by smoothing (subnormals)
    prerope: dict = field(default_factory=dict)           # --prerope-k: scale method and summary statistics
    v_learned: list = field(default_factory=list)         # per layer (--rotate-v learned): learn_v.VResult
    k_learned: list = field(default_factory=list)         # per layer (--learn-k): learn_k.KResult


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


def check_file(m: GGUFModel, opts: Options, g) -> None:
    """What the file's metadata alone rules out for these options: raised before any calibration runs."""
    if m.meta(Keys.General.VERSION) is not None:
        raise ConvertError("the input was already converted by pykvq; convert the original instead")
    rope_scaling = str(m.arch_meta("rope.scaling.type", "none"))
    if opts.ksort and rope_scaling not in ("none", "linear"):
        raise ConvertError(f"K-sort with {rope_scaling} rope scaling is not supported (its ramp depends on "
                           "the pair's position)")
    if not opts.halves_k():
        return
    type_k, _ = opts.resolved_types()
    what = f"--cache-type-k {type_k}"
    if opts.cache_type_k is None and opts.kv_bits is not None:     # a budget's K ladder: name the type in it
        type_k = next(t for t in opts.ladder_for("k") if t in q53.HALVES_TYPES)
        what = f"{type_k} in --layer-types-k"
    why = None
    if not opts.prerope_k:
        why = (f"{what} needs --prerope-k: its wide halves are for the channels the loss reads most, measured in the "
               "pre-RoPE key domain")
    elif opts.ksort:
        why = f"--ksort with {what} is not supported: {type_k} lays the pairs out by importance itself"
    elif g.n_rot != g.head_dim or rope_scaling not in ("none", "linear"):
        why = (f"{what} moves rotary pairs, which needs full rotary (n_rot {g.n_rot}, head {g.head_dim}) and no "
               f"position-dependent rope scaling ({rope_scaling})")
    elif opts.ladder_k_auto and (g.arch not in SUPPORTED_ARCHS or any(g.head_dim % _block(t) for t in opts.ladder_k)):
        why = f"{type_k} needs an architecture in the converter's table and a head size its blocks divide"
    if why and opts.ladder_k_auto:      # the default ladder: leave the split types out, not the conversion
        log.info("keys split by importance (q42_64 / q53_64) left out of the budget's K types: %s", why)
        opts.ladder_k, opts.ladder_k_auto = layer_types.DEFAULT_LADDER, False
        check_file(m, opts, g)
    elif why:
        raise ConvertError(why)


def apply(m: GGUFModel, opts: Options, calib: Calib | None, *, progress: bool | None = None,
          geometry=None) -> Report:
    """Transform m in place; returns what was chosen per layer. geometry: the file's (convert.geometry), when
    the caller has it with the runtime's rope layout (an architecture outside the converter's table)."""
    from .geometry import geometry as geometry_of
    g = geometry or geometry_of(m)
    check_file(m, opts, g)
    rope_scaling = str(m.arch_meta("rope.scaling.type", "none"))
    if opts.smooth_qk and calib is None:
        raise ConvertError("smoothing needs calibration statistics")
    if opts.rotate_v != "none" and g.head_dim & (g.head_dim - 1):
        raise ConvertError(f"--rotate-v {opts.rotate_v} needs a power-of-two head size, got {g.head_dim}")
    type_k, type_v = opts.resolved_types()
    opts.check_learning()
    if opts.rotate_v == "learned" and (calib is None or calib.v is None):
        raise ConvertError("--rotate-v learned needs calibration V activations")
    if opts.learn_k and calib is None:
        raise ConvertError("--learn-k needs calibration text")
    if opts.prerope_k and calib is None:
        raise ConvertError("--prerope-k needs calibration text (the mean of the pre-RoPE keys)")
    if opts.prerope_scale not in prerope.SCALES:
        raise ConvertError(f"pre-RoPE K scale must be one of {', '.join(prerope.SCALES)}, got {opts.prerope_scale!r}")
    if (opts.rotate_v == "learned" or opts.learn_k) and len(learn_v.sequences(calib.pos)) < 2:
        raise ConvertError("learned transforms need at least 2 calibration sequences (one is held out): "
                           "--calib-seqs 2 or more")
    for which, t in (("K", type_k), ("V", type_v)):
        if g.head_dim % _block(t):
            raise ConvertError(f"cache type {t} ({which}) has blocks of {_block(t)}, which do not divide "
                               f"the head size {g.head_dim}")
    # q53_64 / q42_64 keys: every head's pairs laid out by importance (K-sort's machinery, another order)
    importance = opts.prerope_k and opts.halves_k()
    key_kind = opts.ksort_key if opts.ksort_key != "auto" else ("calib" if calib is not None else "weight")
    if importance:
        key_kind = "importance"
        if calib.gk is None and calib.km is None:
            raise ConvertError(f"--cache-type-k {type_k} needs Fisher calibration statistics (the keys' gradients)")
    if opts.ksort and key_kind == "calib" and calib is None:
        raise ConvertError("--ksort-key calib needs calibration text")

    rep = Report()
    method = opts.codebook_method()
    if opts.needs_fisher() and (calib is None or calib.gk is None):
        raise ConvertError("codebooks and per-layer types need Fisher calibration statistics")
    if opts.prerope_k and opts.prerope_scale == "fisher" and calib.gk is None and calib.km is None:
        raise ConvertError("--prerope-k-scale fisher needs Fisher calibration statistics (the keys' gradients)")
    for t in {*opts.ladder_for("k"), *opts.ladder_for("v")} if opts.kv_bits is not None else ():
        layer_types.bits_per_value(t)
        if g.head_dim % _block(t):
            raise ConvertError(f"--layer-types: {t} has blocks of {_block(t)}, which do not divide the head size "
                               f"{g.head_dim}")
    cb_k, cb_v = {}, {}
    hd, G = g.head_dim, g.group
    relayout = (opts.ksort or importance) and g.layout == "neox"
    k_quantized = type_k not in cache_types.UNQUANTIZED
    v_quantized = type_v not in cache_types.UNQUANTIZED
    # where the runtime will rotate the cache online (upstream's attn_rot, not undone by a baked transform);
    # a pre-RoPE key cache is rotated too: the centred keys, undone per K tile by flash attention
    online_rot_k = k_quantized and not opts.ksort and hd % 64 == 0
    online_rot_v = v_quantized and opts.rotate_v == "none" and hd % 64 == 0
    # the runtime turns V in blocks of 64, or of the widest V block past that (llama_kvq_v_rot_size): priced so
    rot_v_size = max([64] + [_block(t) for t in (opts.ladder_for("v") if opts.kv_bits is not None else (type_v,))
                             if t in cache_types.KVQ_TYPES])
    if relayout:
        p = neox_to_norm(g)
        relayout_rows = head_rows(p, g.n_head, hd), head_rows(p, g.n_head_kv, hd)
    gl = g.with_layout("norm") if relayout else g                          # the layout after re-layout
    ch = pair_channels(gl)                                                 # [P, 2]
    doms = []                                                              # per layer: its cache domain
    # a budget's pre-RoPE layers: the key scale at prerope.FISHER_POWER, the one a uniform >= 3.5-bit K type gets
    k_plain, plain_k = {}, opts.kv_bits is not None and _rescales_plain_k(opts)
    for i in progress_bar(range(g.n_layer), desc="transforming layers", enable=progress, unit="layer"):
        if relayout:
            _permute(m, i, *relayout_rows)

        s = np.ones((g.n_head_kv, g.n_pairs), np.float32)
        k_angle = None
        if opts.smooth_qk:
            if opts.alpha is None:
                # (its objective is the post-RoPE score error even with --prerope-k; with a per-channel
                # pre-RoPE scale the pair scales cancel in the K cache and only move Q's rounding)
                c = smooth.choose(calib.q[i], calib.k[i], calib.pos, g, type_k, ksort=opts.ksort,
                                  rotate=k_quantized and not opts.ksort and not opts.prerope_k)
                s = c.scales
                rep.alphas.append(c.alpha)
            else:
                s = smooth.fixed_scales(calib.q[i], calib.k[i], calib.pos, g, opts.alpha)
                rep.alphas.append(opts.alpha)
        kr = None
        if opts.learn_k:
            kr = learn_k.learn(calib.q[i], calib.k[i], calib.pos, g, type_k, s, rotate=online_rot_k,
                               steps=opts.learn_steps)
            rep.k_learned.append(kr)
        if kr is not None and kr.choice == "learned":       # a continuous scale and an angle: requantize W_q/W_k
            s, k_angle = np.exp(kr.log_scale), kr.angle
            _bake_pairs(m, i, kr, g, opts.requant_type, rep)
        elif opts.smooth_qk:                                 # powers of two: exact on the stored rows
            kf = np.ones((g.n_head_kv, hd), np.float32)
            kf[:, ch[:, 0]] = 1.0 / s
            kf[:, ch[:, 1]] = 1.0 / s
            _scale(m, i, np.repeat(1.0 / kf, G, axis=0).reshape(-1), kf.reshape(-1), rep.scale_stats)

        cp = None
        if opts.ksort or importance:
            if importance:          # what an error in the pair costs the loss: sum of F_c var_c (pykvq/ref/q53.py)
                d0 = cache_domain.Domain(k_scale=s if (opts.smooth_qk or opts.learn_k) else None, k_angle=k_angle,
                                         layout=gl.layout)
                _, k_std, _, fk = cache_domain.prerope_key_moments(calib, i, g, d0)
                imp = fk * k_std ** 2
                perm = q53.importance_layout(imp[:, ch[:, 0]] + imp[:, ch[:, 1]])
            else:
                key = calib.k_pair_rms(i) / s if key_kind == "calib" else \
                    ksort.weight_key(rows.to_f32(m.tensors[_name(i, "attn_k.weight")]), gl)
                perm = ksort.pair_order(key, g)
            cp = pair_perms_to_channels(perm, g)
            _permute(m, i, head_rows(np.repeat(cp, G, axis=0), g.n_head, hd), head_rows(cp, g.n_head_kv, hd))
            ff = ksort.freq_factors(perm, g)
            name = Tensors.ROPE_FREQS.format(bid=i)
            m.tensors[name] = Tensor(name, QT.F32, ff)

        vr = None
        if opts.rotate_v == "learned":
            wo = rows.to_f32(m.tensors[_name(i, "attn_output.weight")])
            d = learn_v.layer_data(calib.q[i], calib.k[i], calib.v[i], calib.pos, wo, g,
                                   gv=calib.gv[i] if opts.learn_loss == "fisher" else None)
            vr = learn_v.learn(d, g, type_v, steps=opts.learn_steps, rank=opts.learn_rank, max_cond=opts.max_cond,
                               loss=opts.learn_loss, init=opts.learn_init)
            rep.v_learned.append(vr)

        dom = cache_domain.Domain(k_scale=s if (opts.smooth_qk or opts.learn_k) else None, k_angle=k_angle,
                                  k_perm=cp, layout=gl.layout, rotate_v=opts.rotate_v == "hadamard",
                                  v_matrix=None if vr is None else (vr.a, vr.a_inv),
                                  rot_k=online_rot_k, rot_v=online_rot_v, rot_v_size=rot_v_size,
                                  rot_k_halves=importance)
        if opts.prerope_k:          # mean / scale of the keys the runtime centres: after every baked K transform
            k_mean, k_std, k_absmax, fk = cache_domain.prerope_key_moments(calib, i, g, dom)
            mean, scale = prerope.stats_from_moments(k_mean, k_std, k_absmax, opts.prerope_scale, fisher=fk,
                                                     power=opts.fisher_power())
            std = prerope.stats_from_moments(k_mean, k_std, None, "std")[1]
            out = [(Tensors.K_MEAN, mean), (Tensors.K_SCALE, scale)]
            if opts.prerope_scale != "std":     # the centred cache chooses its mean pairs by the std
                out.append((Tensors.K_STD, std))
            q_mean = cache_domain.prerope_query_mean(calib, i, g, dom)
            if q_mean is not None:              # the runtime's heavy-hitter score (--kv-heavy)
                out.append((Tensors.Q_MEAN, q_mean))
            for fmt, arr in out:
                name = fmt.format(bid=i)
                m.tensors[name] = Tensor(name, QT.F32, arr)
            dom = dataclasses.replace(dom, k_prerope=True, k_mean=mean, k_div=scale)
            _prerope_stats(rep, mean, std)
            if plain_k:             # the mean does not depend on the power: only the scale
                k_plain[i] = prerope.stats_from_moments(k_mean, k_std, k_absmax, "fisher", fisher=fk,
                                                        power=prerope.FISHER_POWER)[1]
        if opts.needs_fisher():
            # a budget weighs each uniform >= 3.5-bit K candidate in the scale it gets if chosen (FISHER_POWER)
            dom_plain = dataclasses.replace(dom, k_div=k_plain[i]) if i in k_plain else None
            _layer_codebooks(i, calib, g, dom, opts, method, type_k, type_v, cb_k, cb_v, rep, dom_plain)
        doms.append(dom)

        if opts.rotate_v != "none":
            wv, wo = m.tensors[_name(i, "attn_v.weight")], m.tensors[_name(i, "attn_output.weight")]
            bv = m.tensors.get(_name(i, "attn_v.bias"))
            args = (rows.to_f32(wv), None if bv is None else rows.to_f32(bv), rows.to_f32(wo))
            if vr is None:
                wv2, bv2, wo2 = hadamard.rotate_v(*args, g.n_head, g.n_head_kv, hd)
            else:
                wv2, bv2, wo2 = invariant.bake_v(*args, vr.a, vr.a_inv, g.n_head, g.n_head_kv, hd)
            _store(m, [(wv, wv2), (wo, wo2)], opts.requant_type, rep)
            if bv is not None:
                m.tensors[bv.name] = rows.from_f32(bv.name, bv2, "f32")

    # what is baked, for the runtime and for people
    m.set(Keys.General.VERSION, VERSION, VT.STRING)
    m.set(Keys.Baked.KSORT, bool(opts.ksort or importance), VT.BOOL)
    if opts.ksort or importance:
        m.set(Keys.Baked.KSORT_KEY, key_kind, VT.STRING)
    m.set(Keys.Baked.SMOOTH_QK, bool(opts.smooth_qk), VT.BOOL)
    if opts.smooth_qk:
        m.set(Keys.Baked.SMOOTH_ALPHA, [(-1.0 if a is None else float(a)) for a in rep.alphas],
              VT.ARRAY, VT.FLOAT32)
    m.set(Keys.Baked.ROTATE_V, opts.rotate_v, VT.STRING)
    if rep.v_learned:
        m.set(Keys.Baked.ROTATE_V_LAYERS, [r.choice for r in rep.v_learned], VT.ARRAY, VT.STRING)
        m.set(Keys.Baked.ROTATE_V_COND, [float(r.cond) for r in rep.v_learned], VT.ARRAY, VT.FLOAT32)
    m.set(Keys.Baked.LEARN_K, bool(opts.learn_k), VT.BOOL)
    if rep.k_learned:
        m.set(Keys.Baked.LEARN_K_LAYERS, [r.choice for r in rep.k_learned], VT.ARRAY, VT.STRING)
    if relayout:
        m.set(Keys.Rope.LAYOUT, Values.ROPE_LAYOUT_NORM, VT.STRING)
    if calib is not None:
        m.set(Keys.Calib.SOURCE, calib.source, VT.STRING)
    if opts.kv_bits is not None:
        if calib is not None and calib.candidates is not None:
            _measured_errors(calib.candidates, rep)
        _assign_layer_types(opts, rep, cb_k, cb_v)
        if k_plain:
            _rescale_plain_k_layers(m, k_plain, doms, rep)
        if importance and not any(t in q53.HALVES_TYPES for t in rep.layer_types_k):
            _refit_plain_k_codebooks(calib, g, doms, opts, method, rep, cb_k)
        type_k = max(set(rep.layer_types_k), key=rep.layer_types_k.count)
        type_v = max(set(rep.layer_types_v), key=rep.layer_types_v.count)
        m.set(Keys.Cache.LAYER_TYPES_K, rep.layer_types_k, VT.ARRAY, VT.STRING)
        m.set(Keys.Cache.LAYER_TYPES_V, rep.layer_types_v, VT.ARRAY, VT.STRING)
        rep.bits_per_value = layer_types.mean_bits(
            {(i, w): t for i, (a, b) in enumerate(zip(rep.layer_types_k, rep.layer_types_v)) for w, t in (("k", a), ("v", b))})
    else:
        rep.bits_per_value = (layer_types.bits_per_value(type_k) + layer_types.bits_per_value(type_v)) / 2 \
            if all(t in cache_types.CACHE_TYPES for t in (type_k, type_v)) else None
    for which, cbs in (("k", cb_k), ("v", cb_v)):
        for i, cb in cbs.items():
            padded = np.zeros(16, np.int8)
            padded[:len(cb)] = cb
            name = Tensors.CODEBOOK[which].format(bid=i)
            m.tensors[name] = Tensor(name, QT.I8, padded)
    if cb_k or cb_v:
        m.set(Keys.Cache.CODEBOOK_METHOD, method, VT.STRING)
        m.set(Keys.Cache.CODEBOOK_QNORM, bool(opts.q_norm), VT.BOOL)
        m.set(Keys.Cache.CODEBOOK_ROT_K, bool(online_rot_k), VT.BOOL)
        m.set(Keys.Cache.CODEBOOK_ROT_V, bool(online_rot_v), VT.BOOL)
    if opts.prerope_k:
        m.set(Keys.Cache.K_DOMAIN, Values.K_DOMAIN_PREROPE, VT.STRING)
        m.set(Keys.Cache.K_SCALE_METHOD, opts.prerope_scale, VT.STRING)
        m.set(Keys.Cache.KV_SINKS, int(opts.kv_sinks), VT.UINT32)
        m.set(Keys.Cache.KV_WINDOW, int(opts.kv_window), VT.UINT32)
        m.set(Keys.Cache.KV_WINDOW_TYPE, opts.kv_window_type, VT.STRING)
        if opts.kv_heavy > 0:
            m.set(Keys.Cache.KV_HEAVY, float(opts.kv_heavy), VT.FLOAT32)
            rep.prerope["kv_heavy"] = float(opts.kv_heavy)
        rep.prerope["scale"] = opts.prerope_scale
        rep.prerope["power"] = opts.fisher_power()
        rep.prerope["kv_sinks"], rep.prerope["kv_window"] = int(opts.kv_sinks), int(opts.kv_window)
        rep.prerope["kv_window_type"] = opts.kv_window_type
    m.set(Keys.Cache.TYPE_K, type_k, VT.STRING)
    m.set(Keys.Cache.TYPE_V, type_v, VT.STRING)
    return rep


def _prerope_stats(rep: Report, mean: np.ndarray, std: np.ndarray) -> None:
    """Largest |mean| / std, and largest / median std within a head, over the layers so far (for the log)."""
    r = rep.prerope
    r["max_mean_over_std"] = max(r.get("max_mean_over_std", 0.0), float(np.abs(mean / std).max()))
    spread = float((std.max(axis=1) / np.median(std, axis=1)).max())
    r["max_std_spread"] = max(r.get("max_std_spread", 0.0), spread)
    r["layers"] = r.get("layers", 0) + 1


def _store(m: GGUFModel, pairs: list, requant_type: str, rep: Report) -> None:
    """Store transformed f32 weights (old tensor, new values): requantized to requant_type."""
    for old, new in pairs:
        out_type = requant_type if old.quantized or requant_type in ("f32", "f16", "bf16") else "f32"
        m.tensors[old.name] = rows.from_f32(old.name, new, out_type)
        what = f"{old.name.split('.', 2)[2]}: {old.qtype.name} -> {m.tensors[old.name].qtype.name}"
        if what not in rep.requantized:
            rep.requantized.append(what)


def _bake_pairs(m: GGUFModel, i: int, kr, g, requant_type: str, rep: Report) -> None:
    """Layer i's learned pair transform into W_q / W_k (rows mix within a pair: requantized) and their biases."""
    pairs = []
    for what, sign, n_heads in (("attn_q", 1.0, g.n_head), ("attn_k", -1.0, g.n_head_kv)):
        w = m.tensors[_name(i, f"{what}.weight")]
        pairs.append((w, invariant.bake_pairs(rows.to_f32(w), kr.log_scale, kr.angle, sign, g, n_heads)))
        b = m.tensors.get(_name(i, f"{what}.bias"))
        if b is not None:
            m.tensors[b.name] = rows.from_f32(b.name, invariant.bake_pairs(rows.to_f32(b), kr.log_scale, kr.angle,
                                                                           sign, g, n_heads), "f32")
    _store(m, pairs, requant_type, rep)


def _assign_layer_types(opts: Options, rep: Report, cb_k: dict, cb_v: dict) -> None:
    """Budgeted choice over all layers; keep each slot's codebook of the chosen type."""
    errors = {}
    for which, per_layer in (("k", rep.layer_types_k), ("v", rep.layer_types_v)):
        for i, slot in enumerate(per_layer):
            errors[(i, which)] = slot[which]
    choice = layer_types.assign(errors, opts.cache_bits())
    n = len(rep.layer_types_k)
    rep.layer_types_k = [choice[(i, "k")] for i in range(n)]
    rep.layer_types_v = [choice[(i, "v")] for i in range(n)]
    for which, cbs in (("k", cb_k), ("v", cb_v)):
        for i in list(cbs):
            t = choice[(i, which)]
            if t in cbs[i]:
                cbs[i] = cbs[i][t]
            else:
                del cbs[i]


def _measured_errors(cp, rep: Report) -> None:
    """--sensitivity measure: each slot's candidate errors replaced by what the runtime measured them to cost."""
    cost = cp.costs()
    for which, per_layer in (("k", rep.layer_types_k), ("v", rep.layer_types_v)):
        for i, slot in enumerate(per_layer):
            for t in slot[which]:
                slot[which][t] = cost[(i, which, t)]


def _rescale_plain_k_layers(m: GGUFModel, k_plain: dict, doms: list, rep: Report) -> None:
    """A budget's file takes the fisher power of its ladder's fewest bits (FISHER_POWER_LOW); a layer whose chosen
    keys have no codebook and prerope.FISHER_POWER_BITS bits or more is scaled at prerope.FISHER_POWER instead, the
    power measured best for such keys (--kv-bits 3.5 at 4096 tokens, f32 weights: SmolLM2 0.00982 -> 0.00953, Qwen
    0.00593 -> 0.00568). A layer with a codebook keeps the scale it was fitted in. The budget weighed every such
    candidate in the scale it gets here (dom_plain in _layer_codebooks). k_plain: each layer's scale at that power."""
    n = 0
    for i, t in enumerate(rep.layer_types_k):
        if not _takes_plain_power(t):
            continue
        name = Tensors.K_SCALE.format(bid=i)
        m.tensors[name] = Tensor(name, QT.F32, k_plain[i])
        doms[i] = dataclasses.replace(doms[i], k_div=k_plain[i])
        n += 1
    rep.prerope["power_layers"] = n


def _rescales_plain_k(opts: Options) -> bool:
    """Whether a file's uniform >= 3.5-bit key layers get prerope.FISHER_POWER rather than the file's power."""
    return (opts.prerope_k and opts.prerope_scale == "fisher" and opts.prerope_power is None
            and opts.fisher_power() != prerope.FISHER_POWER)


def _takes_plain_power(type_name: str) -> bool:
    return not _is_nuq(type_name) and layer_types.bits_per_value(type_name) >= prerope.FISHER_POWER_BITS


def _refit_plain_k_codebooks(calib: Calib, g, doms: list, opts: Options, method: str, rep: Report,
                             cb_k: dict) -> None:
    """A budget that chose no halves K type leaves the runtime's K rotation head-wide: the chosen K codebooks were
    fitted within halves (Domain.rot_k_halves), so fit them again to the keys as that cache holds them."""
    for i, t in enumerate(rep.layer_types_k):
        if _is_nuq(t) and method != "none":
            x = cache_domain.keys(calib, i, g, dataclasses.replace(doms[i], rot_k_halves=False))
            fit = calib.pos >= opts.exact_positions()
            cb_k[i] = codebook.fit(x.x[fit], x.fisher[fit], t, method, q_norm=opts.q_norm)


def _is_nuq(type_name: str) -> bool:
    from pykvq.ref import nuq
    return type_name in nuq.FORMATS


def _layer_codebooks(i: int, calib: Calib, g, dom, opts: Options, method: str, type_k: str, type_v: str,
                     cb_k: dict, cb_v: dict, rep: Report, dom_plain=None) -> None:
    """Codebooks (and, with a budget, the candidate errors) of layer i's K and V. dom_plain: the key domain of the
    candidates that _rescale_plain_k_layers would rescale, their errors taken there."""
    errs = {"k": {}, "v": {}}               # each thread its own
    reads = None
    if opts.window_weighted() and calib.sensitivity == "forward":    # backprop: the gradients already know it
        if calib.q is None:
            raise ConvertError("--kv-bits-weights window needs calibration samples of Q and K")
        reads = dict(zip("kv", window_weights.read_weights(calib.q[i], calib.k[i], calib.pos, g, opts.kv_sinks,
                                                           opts.kv_window)))
        rep.window_share.append({w: float(a.mean()) for w, a in reads.items()})

    def slot(which, samples, uniform_type, out, types):
        cands = opts.ladder_for(which) if opts.kv_bits is not None else (uniform_type,)
        if not any(_is_nuq(t) for t in cands) and opts.kv_bits is None:
            return
        x = samples(calib, i, g, dom)
        # K codebooks leave out the positions the runtime keeps exact (the sinks: pre-RoPE keys far from the others,
        # with a large Fisher weight, that would pull entries to values the cache never holds). Measured at 4096 tokens
        # with the window (docs/RESULTS.md): 3-bit keys 5-17% lower KLD, 2-bit keys within +3%; V codebooks and the
        # budget's errors were no better without them (Qwen --kv-bits 3.6: 10% worse), so they keep every position.
        fit = calib.pos >= opts.exact_positions() if which == "k" else slice(None)
        cbs = {}
        x_plain = None
        for t in cands:
            if _is_nuq(t) and method != "none":
                cbs[t] = codebook.fit(x.x[fit], x.fisher[fit], t, method, q_norm=opts.q_norm)
            if opts.kv_bits is not None or t == uniform_type:     # the loss-increase estimate sum F (x - Q(x))^2
                xt = x
                if which == "k" and dom_plain is not None and _takes_plain_power(t):
                    if x_plain is None:
                        x_plain = samples(calib, i, g, dom_plain)
                    xt = x_plain
                f = xt.fisher if reads is None else xt.fisher * reads[which][:, :, None]
                y = codebook.roundtrip(xt.x, t, cbs.get(t))
                err = errs[which]
                err[t] = codebook.error_of(xt.x, y, f)
                if opts.kv_bits is not None and calib.slot_price:    # the runtime's price of this slot's errors
                    err[t] *= calib.slot_price[(i, which)]
                cp = calib.candidates
                if opts.kv_bits is not None and cp is not None:       # measured in the runtime instead
                    cp.add(i, which, t, xt.x[cp.rows], y[cp.rows], calib.pos[cp.rows], g,
                           dom_plain if xt is x_plain else dom)
        if opts.kv_bits is not None:
            # per-layer decisions are global (the budget is shared): record errors, decide after the loop
            types.append({which: {t: errs[which][t] for t in cands}})
            out[i] = cbs
        elif uniform_type in cbs:
            out[i] = cbs[uniform_type]

    jobs = (("k", cache_domain.keys, type_k, cb_k, rep.layer_types_k),
            ("v", cache_domain.values, type_v, cb_v, rep.layer_types_v))
    if calib.candidates is None:
        # K and V on two threads: their k-means, sorts and roundtrips are numpy calls that release the GIL
        # (Qwen2.5-Coder-1.5B --bits 3.5: 45 -> 30 s); each writes its own entries, so the result is the same
        with ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(slot, *j) for j in jobs]:
                f.result()
    else:                                   # the runtime's candidate probe collects in order
        for j in jobs:
            slot(*j)
    rep.cb_errors.append({f"{w}:{t}": e for w in "kv" for t, e in errs[w].items()})


def _block(type_name: str) -> int:
    return cache_types.block_size(type_name)
