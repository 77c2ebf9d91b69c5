#!/usr/bin/env python3
"""Fake-quantization study for --prerope-k: where (and how) keys should be quantized, and does centring V pay?

    python scripts/prerope_study.py [--model smollm2-135m] [--windows 8] [--ctx 512] [--out results/prerope_study]

The HF model (f32; for a GGUF model, the checkpoint the converter dequantizes for calibration) runs
with its K (or V) cache fake-quantized in numpy exactly as the runtime would store it; the other
cache stays f32. The metric is the next-token KLD against the same model unquantized, over windows of
held-out WikiText-2 test text (never calibrated on). Mean, scale and NUQ codebooks are calibrated as
the converter does (convert/calib.py: Canterbury text, 4 x 512 tokens, Fisher gradients).

K rows (V f32):
  post-RoPE  what the cache holds today: rotated keys in the file's NORM layout, optionally upstream's
             online 64-wide Hadamard (attn_rot_k), then the cache type
  pre-RoPE   k_pre (attn_k output + bias, NORM layout) -> (k - mean) / scale -> cache type ->
             c*scale + mean -> RoPE, per layer, KV head and channel (convert/prerope.py)
V rows (K f32): upstream's online V Hadamard stays on; "- mean" subtracts a calibrated per-layer,
  head, channel V mean before the cache (it comes back as one add on the attention output).

A NEOX-layout model (qwen2) runs too; its K rows quantize blocks of the NORM order the study works in,
not of the file's NEOX order the runtime quantizes (another grouping of channels into blocks and Hadamards):
close to the runtime, not the same. Its V rows are exact (V is in the file's order).

Writes OUT.json and OUT.md. Cost on 2 CPU cores: under a minute of calibration (cached under
$PYKVQ_CACHE/calib/stats) plus 1-2.5 s per window and row: about 16 min for the 25 rows at 16 windows
(use --threads 1 when the cores are shared; --only re-runs some rows into an existing JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from convert import cache_domain, codebook, prerope  # noqa: E402
from convert.calib import calibration_text, collect_cached, hf_to_norm  # noqa: E402
from convert.geometry import geometry  # noqa: E402
from convert.gguf_io import read_gguf  # noqa: E402
from convert.hadamard import hadamard  # noqa: E402
from pykvq.ref import nuq, roundtrip  # noqa: E402
from pykvq.ref.stock import _roundtrip_signed_max as roundtrip_signed  # noqa: E402


POWERS = (0.1, 0.15, 0.2, 0.35, 0.5)     # the Fisher scale's power sweep (0.25: the "F^1/4" rows; 0.15 the default)
# within-head bit widths per group of 32 channels (most important group first), by head size
MIXED_BITS = {64: [(5, 3), (6, 2)], 128: [(5, 5, 3, 3), (6, 4, 4, 2), (5, 4, 4, 3), (6, 5, 3, 2)]}


def rot(x: np.ndarray, n: int) -> np.ndarray:
    """Blocks of n channels times the orthonormal (symmetric, self-inverse) Sylvester Hadamard."""
    h = hadamard(n).astype(np.float32)
    return (x.reshape(*x.shape[:-1], -1, n) @ h).reshape(x.shape)


def fq(x: np.ndarray, qtype: str, cb=None) -> np.ndarray:
    """Fake quantization along the last axis (blocks of 32 / the type's block)."""
    if qtype in nuq.FORMATS:
        return nuq.roundtrip(x, qtype, cb).astype(np.float32)
    return roundtrip(x, qtype)


class Study:
    def __init__(self, model: str, n_seq: int, seq_len: int, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from convert.hf_checkpoint import hf_checkpoint
        from pykvq.registry import fetch
        torch.set_num_threads(threads)
        gguf = fetch(model)
        # the study works in the NORM order whatever the model's file layout: the hooks take HF channels to it
        # (hf_to_norm) and the calibration statistics are computed in it (cache_domain.Domain's default layout)
        self.g = geometry(read_gguf(gguf)).with_layout("norm")
        self.hf = hf_checkpoint(gguf)
        text, source = calibration_text("canterbury")
        t0 = time.time()
        self.calib = collect_cached(self.hf, text, self.g, n_seq=n_seq, seq_len=seq_len, source=source, fisher=True)
        print(f"calibration ({source.split(' ')[0]}, {n_seq} x {seq_len} tokens, Fisher): {time.time() - t0:.0f} s",
              flush=True)
        self.tok = AutoTokenizer.from_pretrained(self.hf)
        self.model = AutoModelForCausalLM.from_pretrained(self.hf, dtype=torch.float32).eval()
        self.idx = hf_to_norm(self.g)                     # NORM channel c = HF channel idx[c]
        self.inv = np.argsort(self.idx)
        self.k_fn = self.v_fn = self.post_fn = None       # per-layer fake quantizers (None: exact)
        self.layer = 0
        self._hook()

    # --- wiring: K before RoPE (k_proj output), K after RoPE (apply_rotary_pos_emb), V (v_proj output)
    def _hook(self):
        import torch
        g, study = self.g, self
        # the model's own modeling module (llama, qwen2, ...): its attention calls that module's apply_rotary_pos_emb
        ml = sys.modules[type(self.model.model.layers[0].self_attn).__module__]
        for i, layer in enumerate(self.model.model.layers):
            att = layer.self_attn
            att.register_forward_pre_hook(lambda _m, _a, i=i: setattr(study, "layer", i))

            def kv_hook(_m, _inp, out, which):
                fn = study.k_fn if which == "k" else study.v_fn
                if fn is None:
                    return None
                x = out[0].detach().numpy().reshape(out.shape[1], g.n_head_kv, g.head_dim)
                if which == "k":
                    x = fn(study.layer, x[..., study.idx])[..., study.inv]
                else:
                    x = fn(study.layer, x)
                return torch.from_numpy(np.ascontiguousarray(x, np.float32)).reshape(out.shape)
            att.k_proj.register_forward_hook(lambda m, a, o: kv_hook(m, a, o, "k"))
            att.v_proj.register_forward_hook(lambda m, a, o: kv_hook(m, a, o, "v"))
        orig = ml.apply_rotary_pos_emb

        def rope_hook(q, k, cos, sin, *a, **kw):
            q2, k2 = orig(q, k, cos, sin, *a, **kw)
            if study.post_fn is None:
                return q2, k2
            x = k2[0].detach().numpy().transpose(1, 0, 2)[..., study.idx]      # [T, n_kv, hd] NORM
            x = study.post_fn(study.layer, x)[..., study.inv].transpose(1, 0, 2)
            return q2, torch.from_numpy(np.ascontiguousarray(x, np.float32))[None]
        ml.apply_rotary_pos_emb = rope_hook

    def logprobs(self, ids: np.ndarray):
        import torch
        with torch.no_grad():
            out = self.model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False)
        return torch.log_softmax(out.logits[0].double(), dim=-1)

    def evaluate(self, windows: list, base: list, *, k_pre=None, k_post=None, v=None) -> dict:
        import torch
        self.k_fn, self.post_fn, self.v_fn = k_pre, k_post, v
        kl, top = [], []
        try:
            for ids, ref in zip(windows, base):
                lp = self.logprobs(ids)
                kl.append((torch.exp(ref) * (ref - lp)).sum(-1).numpy())
                top.append((lp.argmax(-1) == ref.argmax(-1)).numpy())
        finally:
            self.k_fn = self.post_fn = self.v_fn = None
        kl, top = np.concatenate(kl), np.concatenate(top)
        return {"kld": float(kl.mean()), "kld_se": float(kl.std() / np.sqrt(len(kl))),
                "p99": float(np.percentile(kl, 99)), "top1": float(top.mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=16, help="WikiText-2 test windows (default 16)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--calib-seqs", type=int, default=4)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", choices=("wikitext", "kjv"), default="wikitext",
                    help="evaluation text: WikiText-2 test (default) or the KJV Bible, to choose a setting on text "
                         "other than the suite's (writes STEM_<model>_kjv.*)")
    ap.add_argument("--out", default=str(ROOT / "results" / "prerope_study"),
                    help="output stem: writes STEM_<model>.json and .md")
    ap.add_argument("--only", default=None, metavar="TEXT[,TEXT]",
                    help="run only the rows whose setting contains one of these strings; the others are kept "
                         "from an existing STEM_<model>.json")
    args = ap.parse_args(argv)
    t_start = time.time()

    from pykvq.data import kjv_text, wikitext_test
    st = Study(args.model, args.calib_seqs, args.calib_len, args.threads)
    g, c = st.g, st.calib
    ids = st.tok(wikitext_test() if args.text == "wikitext" else kjv_text(), return_tensors="np")["input_ids"][0]
    stride = len(ids) // args.windows
    windows = [ids[w * stride: w * stride + args.ctx] for w in range(args.windows)]
    base = [st.logprobs(w) for w in windows]
    hd, n_layer = g.head_dim, g.n_layer
    text_name = "WikiText-2 test" if args.text == "wikitext" else "KJV Bible"
    print(f"evaluation: {text_name}, {args.windows} x {args.ctx} tokens", flush=True)

    # calibration statistics in the file layout (NORM for llama; no baked transforms in this study)
    dom0 = cache_domain.Domain()
    kp = [cache_domain.prerope_keys(c, i, g, dom0) for i in range(n_layer)]
    stats = {m: [prerope.stats(kp[i], m) for i in range(n_layer)] for m in prerope.SCALES if m != "fisher"}
    std_raw = [kp[i].astype(np.float64).std(axis=0) for i in range(n_layer)]

    def floored(f):
        out = []
        for i in range(n_layer):
            s = np.maximum(std_raw[i], f * np.median(std_raw[i], axis=1, keepdims=True))
            out.append((stats["std"][i][0], np.where(s > 0, s, 1.0).astype(np.float32)))
        return out
    stats["std, floor 0.25 median"] = floored(0.25)
    stats["std, no floor"] = floored(0.0)
    stats["q99.9"] = []                  # range-based like absmax, without the single most extreme token
    for i in range(n_layer):
        mean = stats["std"][i][0]
        r = np.percentile(np.abs(kp[i] - mean), 99.9, axis=0)
        r = np.maximum(r, prerope.STD_FLOOR * np.median(r, axis=1, keepdims=True))
        stats["q99.9"].append((mean, np.where(r > 0, r, 1.0).astype(np.float32)))
    v_mean = [c.v[i].astype(np.float64).mean(axis=0).astype(np.float32) for i in range(n_layer)]

    # Fisher-weighted scales (convert/prerope.py's fisher): s_c^4 ~ sigma_c^2 / F_c, F = E[(dL/dk_c)^2]
    def fisher_scale(x, f, mean, pair=False, clip=prerope.CLIP, power=0.25):
        if pair:
            f = np.repeat(0.5 * (f[..., 0::2] + f[..., 1::2]), 2, axis=-1)
        sd = np.sqrt(((x.astype(np.float64) - mean) ** 2).mean(axis=0))
        return prerope.fisher_scale(sd, f, clip, power).astype(np.float32)
    fk = [(c.gk[i].astype(np.float64) ** 2).mean(axis=0) for i in range(n_layer)] if c.gk is not None else None
    if fk is not None:
        stats["fisher"] = [(stats["std"][i][0], fisher_scale(kp[i], fk[i], stats["std"][i][0], power=0.25))
                           for i in range(n_layer)]
        stats["fisher, pairs"] = [(stats["std"][i][0], fisher_scale(kp[i], fk[i], stats["std"][i][0], pair=True, power=0.25))
                                  for i in range(n_layer)]
        stats["fisher, clip 4"] = [(stats["std"][i][0], fisher_scale(kp[i], fk[i], stats["std"][i][0], clip=4.0, power=0.25))
                                   for i in range(n_layer)]
        for a in POWERS:
            stats[f"fisher, power {a}"] = [(stats["std"][i][0], fisher_scale(kp[i], fk[i], stats["std"][i][0], power=a))
                                           for i in range(n_layer)]
        fv = [(c.gv[i].astype(np.float64) ** 2).mean(axis=0) for i in range(n_layer)]
        v_fscale = [fisher_scale(c.v[i], fv[i], 0.0, power=0.25) for i in range(n_layer)]

    def pre(qtype, st_name=None, hadamard_n=0, cbs=None, search=False):
        def fn(i, x):
            mean, scale = stats[st_name][i] if st_name else (0.0, 1.0)
            y = (x - mean) / scale
            if search:
                y = rot(sq_search(rot(y, hadamard_n), 4), hadamard_n)
            elif hadamard_n:
                y = rot(fq(rot(y, hadamard_n), qtype, None if cbs is None else cbs[i]), hadamard_n)
            else:
                y = fq(y, qtype, None if cbs is None else cbs[i])
            return y * scale + mean
        return fn

    def post(qtype, hadamard_n=0, cbs=None):
        def fn(i, x):
            cb = None if cbs is None else cbs[i]
            return rot(fq(rot(x, hadamard_n), qtype, cb), hadamard_n) if hadamard_n else fq(x, qtype, cb)
        return fn

    def vq(qtype, centre, hadamard_n=64, skip_first=False, fisher=False, search=False):
        def fn(i, x):
            m = np.broadcast_to(v_mean[i] if centre else 0.0, x.shape).copy()
            if skip_first:              # diagnostic: leave the first token of the window (the sink) uncentred
                m[0] = 0.0
            s = v_fscale[i] if fisher else 1.0      # exact when baked: W_v rows / s, W_o columns * s
            y = (x - m) / s
            quant = (lambda z, t: sq_search(z, 4)) if search else fq     # search: q4_0's levels and format
            y = rot(quant(rot(y, hadamard_n), qtype), hadamard_n) if hadamard_n else quant(y, qtype)
            return y * s + m
        return fn

    # within-head bit allocation: channels sorted by their Fisher-weighted variance F_c sigma_c^2 (what a
    # channel's error costs the loss per unit of relative error), groups of 32 each with its own bit width
    # (symmetric q*_0-style, one f16 scale per 32), Hadamard within a group; the groups' bits average 4
    # (+0.5 for the scales: 4.5 bits/value like q4_0). "auto" picks each head's widths by reverse water-filling.
    def sq(x, bits):
        if bits <= 0:
            return np.zeros_like(x)
        return roundtrip_signed(x, 2 ** (bits - 1))

    def sq_search(x, bits, fs=np.linspace(0.7, 1.2, 26)):
        """sq with each 32-block's scale chosen from fs x the signed-max rule's by least squared error."""
        half = 2 ** (bits - 1)
        b = x.reshape(-1, 32).astype(np.float32)
        vmax = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[:, None], axis=-1)
        best, err = np.zeros_like(b), np.full(len(b), np.inf)
        for f in fs:
            d = (vmax / -half * f).astype(np.float16).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.clip(np.round(np.where(d != 0, b / d, 0.0)), -half, half - 1) * d
            e = ((q - b) ** 2).sum(axis=1)
            better = e < err
            best[better], err[better] = q[better], e[better]
        return best.reshape(x.shape)

    def alloc(v, n_groups, total):
        """Integer bits per group (sum = total) by greedy water-filling on the groups' geometric-mean v."""
        gm = np.exp(np.log(np.maximum(v, 1e-30)).reshape(n_groups, -1).mean(axis=1))
        b = np.zeros(n_groups, int)
        for _ in range(total):                    # each bit quarters its group's error
            j = int(np.argmax(gm * 4.0 ** -b))
            b[j] += 1
        return b

    def mixed(st_name, bits=None, hadamard_n=32, pairs=True, search=False):
        order, widths = [], []
        for i in range(n_layer):
            mean, scale = stats[st_name][i]
            v = fk[i] * std_raw[i] ** 2                          # [n_kv, hd]
            if pairs:                                            # whole rotary pairs (2j, 2j+1): what K-sort can bake
                vp = v[:, 0::2] + v[:, 1::2]
                po = np.argsort(-vp, axis=1, kind="stable")
                o = np.stack([2 * po, 2 * po + 1], axis=-1).reshape(v.shape)
                v = np.repeat(vp / 2, 2, axis=1)
            else:
                o = np.argsort(-v, axis=1)
            order.append(o)
            ng = hd // 32
            if bits is None:
                widths.append([alloc(np.take_along_axis(v, o[h:h + 1], 1)[0], ng, 4 * ng) for h in range(g.n_head_kv)])
            else:
                widths.append([np.asarray(bits)] * g.n_head_kv)

        def fn(i, x):
            mean, scale = stats[st_name][i]
            y = (x - mean) / scale
            out = np.empty_like(y)
            for h in range(g.n_head_kv):
                o = order[i][h]
                yh = y[:, h, o]
                span = max(32, hadamard_n)                  # a Hadamard wider than a group spans groups of equal width
                for s0 in range(0, hd, span):
                    bs = {int(b) for b in widths[i][h][s0 // 32: (s0 + span) // 32]}
                    assert len(bs) == 1, "a Hadamard spans groups of different widths"
                    b = bs.pop()
                    blk = yh[:, s0: s0 + span]
                    quant = sq_search if search else sq
                    blk = rot(quant(rot(blk, hadamard_n), b), hadamard_n) if hadamard_n else quant(blk, b)
                    out[:, h, o[s0: s0 + span]] = blk
            return out * scale + mean
        fn.widths = widths
        return fn

    # V bit allocation: V's channels can be permuted freely (baked into W_v's rows and W_o's columns: exact, no
    # RoPE to keep pairs together), so single channels sorted by F_c sigma_c^2 (F from dL/dv) fill the wide groups
    def vmixed(bits, hadamard_n=32, by_fisher=True):
        order = []
        for i in range(n_layer):
            imp = c.v[i].astype(np.float64).var(axis=0) * (fv[i] if by_fisher else 1.0)    # [n_kv, hd]
            order.append(np.argsort(-imp, axis=1, kind="stable"))

        def fn(i, x):
            out = np.empty_like(x)
            for h in range(g.n_head_kv):
                o = order[i][h]
                yh = x[:, h, o]
                for j, b in enumerate(bits):
                    blk = yh[:, 32 * j: 32 * (j + 1)]
                    out[:, h, o[32 * j: 32 * (j + 1)]] = rot(sq(rot(blk, hadamard_n), b), hadamard_n)
            return out
        return fn

    # centred post-RoPE (PYKVQ_K_DOMAIN=centred): quantize H R(p)(k - m_S), m_S = the mean's top-k pairs per head
    # by energy (NORM pairs 2j, 2j+1); the windows start at position 0
    theta = g.freq_base ** (-2.0 * np.arange(hd // 2) / g.n_rot)
    if g.rope_freqs is not None:
        theta = theta / g.rope_freqs

    def rope_mean(m, n_tok):
        ang = np.arange(n_tok)[:, None] * theta[None]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        out = np.empty((n_tok,) + m.shape)
        out[..., 0::2] = m[None, :, 0::2] * c - m[None, :, 1::2] * s
        out[..., 1::2] = m[None, :, 0::2] * s + m[None, :, 1::2] * c
        return out.astype(np.float32)

    def top_pairs(m, k):
        if k is None:
            return m
        e = m[:, 0::2] ** 2 + m[:, 1::2] ** 2
        keep = np.zeros_like(e, bool)
        np.put_along_axis(keep, np.argsort(-e, axis=1)[:, :k], True, 1)
        out = np.zeros_like(m)
        out[:, 0::2], out[:, 1::2] = np.where(keep, m[:, 0::2], 0), np.where(keep, m[:, 1::2], 0)
        return out

    def centred(qtype, k_pairs=None):
        ms = [top_pairs(stats["one"][i][0].astype(np.float64), k_pairs) for i in range(n_layer)]

        def fn(i, x):
            r = rope_mean(ms[i], x.shape[0])
            return rot(fq(rot(x - r, 64), qtype), 64) + r
        return fn

    # NUQ codebooks fitted as the converter fits them (Fisher + Q-Norm) in each domain
    def fit_cbs(dom, qtype="nuq4"):
        out = []
        for i in range(n_layer):
            x = cache_domain.keys(c, i, g, dom)
            out.append(codebook.fit(x.x, x.fisher, qtype, "fisher", q_norm=True))
        return out
    def selected(label):
        return not args.only or any(t in label for t in args.only.split(","))

    cb_post, cb_pre = None, {}
    if selected("Fisher codebook"):
        t0 = time.time()
        cb_post = fit_cbs(cache_domain.Domain(rot_k=True))
        for name in ("std", "absmax"):
            cb_pre[name] = []
            for i in range(n_layer):
                d = cache_domain.Domain(k_prerope=True, k_mean=stats[name][i][0], k_div=stats[name][i][1])
                x = cache_domain.keys(c, i, g, d)
                cb_pre[name].append(codebook.fit(x.x, x.fisher, "nuq4", "fisher", q_norm=True))
        print(f"nuq4 codebooks fitted in both domains: {time.time() - t0:.0f} s", flush=True)

    rows = [
        ("K", "post-RoPE q8_0 + online Hadamard", 8.5, dict(k_post=post("q8_0", 64))),
        ("K", "post-RoPE q4_0 + online Hadamard (stock default)", 4.5, dict(k_post=post("q4_0", 64))),
        ("K", "post-RoPE q4_0, no rotation", 4.5, dict(k_post=post("q4_0"))),
        ("K", "pre-RoPE q4_0, nothing else", 4.5, dict(k_pre=pre("q4_0"))),
        ("K", "pre-RoPE q4_0, minus mean (scale 1)", 4.5, dict(k_pre=pre("q4_0", "one"))),
        ("K", "pre-RoPE q4_0, (x - mean) / std (floor 0.01 median)", 4.5, dict(k_pre=pre("q4_0", "std"))),
        ("K", "pre-RoPE q4_0, (x - mean) / pow2(std)", 4.5, dict(k_pre=pre("q4_0", "pow2"))),
        ("K", "pre-RoPE q4_0, (x - mean) / std, no floor", 4.5, dict(k_pre=pre("q4_0", "std, no floor"))),
        ("K", "pre-RoPE q4_0, (x - mean) / std (floor 0.25 median)", 4.5,
         dict(k_pre=pre("q4_0", "std, floor 0.25 median"))),
        ("K", "pre-RoPE q4_0, (x - mean) / 99.9th percentile of |x - mean|", 4.5, dict(k_pre=pre("q4_0", "q99.9"))),
        ("K", "pre-RoPE q4_0, (x - mean) / max |x - mean|", 4.5, dict(k_pre=pre("q4_0", "absmax"))),
        ("K", "pre-RoPE q4_0, minus mean, 64-wide Hadamard (not in the contract)", 4.5,
         dict(k_pre=pre("q4_0", "one", 64))),
        ("K", "pre-RoPE q4_0, (x - mean) / std, 64-wide Hadamard (not in the contract)", 4.5,
         dict(k_pre=pre("q4_0", "std", 64))),
        ("K", "pre-RoPE q4_0, (x - mean) / max |x - mean|, 64-wide Hadamard (not in the contract)", 4.5,
         dict(k_pre=pre("q4_0", "absmax", 64))),
        ("K", "pre-RoPE q4_0, (x - mean) * F^1/4 / std^1/2 (Fisher-weighted), 64-wide Hadamard", 4.5,
         dict(k_pre=pre("q4_0", "fisher", 64))),
        ("K", "pre-RoPE q4_0, (x - mean) * F^1/4 / std^1/2, F pair-averaged, 64-wide Hadamard", 4.5,
         dict(k_pre=pre("q4_0", "fisher, pairs", 64))),
        ("K", "pre-RoPE q4_0, (x - mean) * F^1/4 / std^1/2 clipped to 4x median, 64-wide Hadamard", 4.5,
         dict(k_pre=pre("q4_0", "fisher, clip 4", 64))),
        *[("K", f"pre-RoPE q4_0, (x - mean) * F^{a} / std^{1 - 2 * a:g} (power sweep), 64-wide Hadamard", 4.5,
           dict(k_pre=pre("q4_0", f"fisher, power {a}", 64))) for a in POWERS],
        *[("K", "pre-RoPE q4_0, (x - mean) * F^0.15 / std^0.7, 128-wide Hadamard (the runtime's q4_0 on a 128 head)", 4.5,
           dict(k_pre=pre("q4_0", "fisher, power 0.15", 128)))] * (hd == 128),
        ("K", "pre-RoPE mixed bits auto, channels (not pairs) sorted: groups of 32 by F sigma^2, fisher 0.15, 32-wide Hadamard",
         4.5, dict(k_pre=mixed("fisher, power 0.15", pairs=False))),
        *[("K", f"pre-RoPE mixed bits {b}: groups of 32 by F sigma^2, (x - mean) * F^0.15 / std^0.7, 32-wide Hadamard",
           4.5, dict(k_pre=mixed("fisher, power 0.15", b))) for b in MIXED_BITS.get(hd, ())],
        *[("K", "pre-RoPE mixed bits (5, 5, 3, 3), 64-wide Hadamard over each 64 of one width (a q53_128 layout)", 4.5,
           dict(k_pre=mixed("fisher, power 0.15", (5, 5, 3, 3), hadamard_n=64)))] * (hd == 128),
        *[("K", "pre-RoPE mixed bits (5, 5, 3, 3), 64-wide Hadamard over each 64 of one width, each 32-block's scale by least squares (search)", 4.5,
           dict(k_pre=mixed("fisher, power 0.15", (5, 5, 3, 3), hadamard_n=64, search=True)))] * (hd == 128),
        *[("K", "pre-RoPE mixed bits (5, 3), 32-wide Hadamard, each 32-block's scale by least squares (search)", 4.5,
           dict(k_pre=mixed("fisher, power 0.15", (5, 3), search=True)))] * (hd == 64),
        ("K", "pre-RoPE mixed bits auto (water-filling per head): groups of 32 by F sigma^2, fisher 0.15, 32-wide Hadamard",
         4.5, dict(k_pre=mixed("fisher, power 0.15"))),
        ("K", "pre-RoPE q4_0 groups of 32 by F sigma^2, fisher 0.15, 32-wide Hadamard (the mixed rows' 4-bit control)",
         4.5, dict(k_pre=mixed("fisher, power 0.15", [4] * (hd // 32)))),
        ("K", "centred post-RoPE q4_0 + online Hadamard: minus R(p) mean, every pair", 4.5,
         dict(k_post=centred("q4_0"))),
        ("K", "centred post-RoPE q4_0 + online Hadamard: minus R(p) mean, top 8 pairs per head", 4.5,
         dict(k_post=centred("q4_0", 8))),
        ("K", "centred post-RoPE q4_0 + online Hadamard: minus R(p) mean, top 4 pairs per head", 4.5,
         dict(k_post=centred("q4_0", 4))),
        ("K", "centred post-RoPE q4_0 + online Hadamard: minus R(p) mean, top 2 pairs per head", 4.5,
         dict(k_post=centred("q4_0", 2))),
        ("K", "centred post-RoPE q4_0 + online Hadamard: minus R(p) mean, top pair per head", 4.5,
         dict(k_post=centred("q4_0", 1))),
        ("K", "post-RoPE nuq4 + online Hadamard, fallback codebook", 4.5, dict(k_post=post("nuq4", 64))),
        ("K", "post-RoPE nuq4 + online Hadamard, Fisher codebook (converter today)", 4.5,
         dict(k_post=post("nuq4", 64, cb_post))),
        ("K", "pre-RoPE nuq4, (x - mean) / std, fallback codebook", 4.5, dict(k_pre=pre("nuq4", "std"))),
        ("K", "pre-RoPE nuq4, (x - mean) / std, Fisher codebook", 4.5,
         dict(k_pre=pre("nuq4", "std", cbs=cb_pre.get("std")))),
        ("K", "pre-RoPE nuq4, (x - mean) / max |x - mean|, Fisher codebook", 4.5,
         dict(k_pre=pre("nuq4", "absmax", cbs=cb_pre.get("absmax")))),
        ("V", "q4_0 + online Hadamard (stock default)", 4.5, dict(v=vq("q4_0", False))),
        ("V", "q4_0 + online Hadamard, each block's scale by least squares (search; a q4_0 encoder, stock format)", 4.5,
         dict(v=vq("q4_0", False, search=True))),
        ("K", "pre-RoPE q4_0, (x - mean) * F^0.15 / std^0.7, online Hadamard, each block's scale by least squares (search)", 4.5,
         dict(k_pre=pre("q4_0", "fisher, power 0.15", hd, search=True))),
        ("V", "q4_0 + online Hadamard, minus V mean", 4.5, dict(v=vq("q4_0", True))),
        ("V", "q4_0 + online Hadamard, minus V mean except the window's first token (diagnostic)", 4.5,
         dict(v=vq("q4_0", True, skip_first=True))),
        ("V", "q4_0 + online Hadamard, * F^1/4 / std^1/2 (Fisher-weighted, baked into W_v / W_o)", 4.5,
         dict(v=vq("q4_0", False, fisher=True))),
        ("V", "q4_0, no rotation", 4.5, dict(v=vq("q4_0", False, 0))),
        ("V", "q4_0 + 32-wide Hadamard in groups of 32 channels by F sigma^2 (the V mixed rows' 4-bit control)", 4.5,
         dict(v=vmixed([4] * (hd // 32)))),
        *[("V", f"mixed bits {b}: channels sorted by F sigma^2 (permutation baked into W_v / W_o), 32-wide Hadamard",
           4.5, dict(v=vmixed(b))) for b in MIXED_BITS.get(hd, ())],
        *[("V", f"mixed bits {b}: channels sorted by sigma^2 alone, 32-wide Hadamard", 4.5,
           dict(v=vmixed(b, by_fisher=False))) for b in MIXED_BITS.get(hd, ())[:1]],
        ("V", "q4_0, no rotation, minus V mean", 4.5, dict(v=vq("q4_0", True, 0))),
    ]
    out = Path(args.out)
    stem = f"{out.name}_{args.model}" + ("" if args.text == "wikitext" else f"_{args.text}")
    old = {}
    if args.only and (out.parent / f"{stem}.json").is_file():
        old = {(r["cache"], r["setting"]): r for r in json.loads((out.parent / f"{stem}.json").read_text())["rows"]}
    results = []
    for which, label, bits, kw in rows:
        if not selected(label):
            if (which, label) in old:
                results.append(old[(which, label)])
            continue
        t0 = time.time()
        r = st.evaluate(windows, base, **kw)
        results.append({"cache": which, "setting": label, "bits": bits, **r, "seconds": round(time.time() - t0, 1)})
        print(f"{which} {label:75s} KLD {r['kld']:.4f} ± {r['kld_se']:.4f}  p99 {r['p99']:.3f}  "
              f"top1 {100 * r['top1']:.1f}%  ({time.time() - t0:.0f} s)", flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "text": text_name, "windows": args.windows, "ctx": args.ctx, "calib": c.source,
            "calib_tokens": f"{args.calib_seqs} x {args.calib_len}", "seconds": round(time.time() - t_start)}
    (out.parent / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    (out.parent / f"{stem}.md").write_text(render(meta, results))
    print(f"wrote {out.parent / stem}.json/.md in {meta['seconds']} s")
    return 0


def render(meta: dict, results: list) -> str:
    md = [f"# Pre-RoPE key cache: fake-quantization study ({meta['model']})", "",
          f"Next-token KLD vs the unquantized model (f32 HF forward), {meta.get('text', 'WikiText-2 test')}, {meta['windows']} windows x "
          f"{meta['ctx']} tokens (all positions); mean/scale/codebooks calibrated on {meta['calib'].split(' (')[0]} "
          f"({meta['calib_tokens']} tokens). The other cache is exact. s.e. is over tokens (not paired). "
          f"`python scripts/prerope_study.py --windows {meta['windows']}`.", "",
          "| cache | setting | bits | mean KLD (± s.e.) | p99 KLD | same top-1 |", "|---|---|---|---|---|---|"]
    for r in results:
        setting = r["setting"].replace("|", "\\|")
        md.append(f"| {r['cache']} | {setting} | {r['bits']} | {r['kld']:.4f} ± {r['kld_se']:.4f} | "
                  f"{r['p99']:.3f} | {100 * r['top1']:.1f}% |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    sys.exit(main())
