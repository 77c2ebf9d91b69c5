#!/usr/bin/env python3
"""Flash attention alone (one FLASH_ATTN_EXT node on the CPU backend): decode time per call for a
post-RoPE, a pre-RoPE and a centred post-RoPE K cache of the same type, and f16, at one depth. An op-level companion to
llama-bench (scripts/fattn_results.py) for kernel work: no model, so runs in seconds.

    python scripts/fa_op_bench.py [--n-kv 8192] [--shape smollm2|qwen] [--types q4_0,nuq4] [--reps 50] [--centre-pairs 12] [--rot 64]
    python scripts/fa_op_bench.py --file CONVERTED.gguf [--layers 0,10,20]

--file takes the shape, the rotary frequencies and, per layer, the mean pairs the runtime keeps
(pykvq.ref.prerope.centre_pairs) from a file converted with --prerope-k, and sums the chosen layers' calls.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ggml_graph import Graph  # noqa: E402
from pykvq._lib import ffi  # noqa: E402
from pykvq.ref import prerope  # noqa: E402
from test_fattn import cache_like, fa_node, quantize  # noqa: E402

SHAPES = {"smollm2": dict(D=64, H=9, Hkv=3), "qwen": dict(D=128, H=12, Hkv=2)}


def file_layers(path: str, layers: str | None):
    """(shape, [(mean with only the kept pairs, w)] per chosen layer) of a --prerope-k file."""
    from convert.geometry import geometry
    from convert.gguf_io import read_gguf
    from pykvq.keys import Tensors
    f = read_gguf(path)
    g = geometry(f)
    D, H, Hkv = g.head_dim, g.n_head, g.n_head_kv
    mode = prerope.NEOX if g.layout == "neox" else prerope.NORM
    w, _ = prerope.rope_freqs(g.n_rot, g.freq_base, n_cols=Hkv)
    out = []
    for il in ([int(x) for x in layers.split(",")] if layers else range(g.n_layer)):
        mean = np.asarray(f.tensors[Tensors.K_MEAN.format(bid=il)].data, np.float32)
        scale = np.asarray(f.tensors[Tensors.K_SCALE.format(bid=il)].data, np.float64)
        kept = prerope.centre_pairs(mean, scale ** 2, D, mode)
        a, b = prerope.pair_index(D, mode)
        m = np.zeros_like(mean)
        for h in range(Hkv):
            m[h, a[kept[h]]], m[h, b[kept[h]]] = mean[h, a[kept[h]]], mean[h, b[kept[h]]]
        out.append((m, w.astype(np.float32), mode))
    return dict(D=D, H=H, Hkv=Hkv), out


def time_fa(kt, vt, *, pre, D, H, Hkv, n_kv, reps, threads, rot, centred=0, layer=None):
    rng = np.random.default_rng(0)
    Q = rng.standard_normal((1, H, 1, D)).astype(np.float32)
    kb, _ = quantize(kt, cache_like(rng, 1, Hkv, n_kv, D))
    vb, _ = quantize(vt, cache_like(rng, 1, Hkv, n_kv, D))
    g = Graph(64 << 20)
    try:
        fa = fa_node(g, Q, kt, kb, vt, vb, Hkv, np.zeros((1, 1, n_kv), np.float32), 1.0 / np.sqrt(D))
        # the same tensors in every mode, attached or not: the work buffer then lies at the same address
        # (a different layout alone moved the post-RoPE time by 10%)
        w, _ = prerope.rope_freqs(D, 10000.0, n_cols=Hkv)
        mean, mode = np.zeros((Hkv, D), np.float32), 0
        if centred:     # the first `centred` pairs of each head carry a mean (the runtime keeps about a third)
            mean[:, :2 * centred] = 1.0
        if layer is not None:
            mean, w, mode = layer
        pos = g.tensor("i32", n_kv, 1, data=np.arange(n_kv, dtype=np.int32))
        mt = g.tensor("f32", D, Hkv, data=mean)
        st = g.tensor("f32", D, Hkv, data=np.ones((Hkv, D), np.float32))
        wt = g.tensor("f32", D // 2, Hkv, data=w.astype(np.float32))
        if centred:
            g.L.ggml_kvq_fa_set_centred(fa, pos, mt, wt, D, mode, 1.0, rot)
        elif pre:
            g.L.ggml_kvq_fa_set_prerope(fa, pos, mt, st, wt, D, 2, 1.0, rot)
        g.L.ggml_build_forward_expand(g.gf, fa)
        # one thread: CPU time of this thread (robust when other jobs share the cores); else wall time
        clock = time.thread_time if threads == 1 else time.perf_counter
        g.compute_cpu_backend(n_threads=threads)     # warm-up: thread pool, first touch of the work buffer
        best = float("inf")
        for _ in range(3):
            t0 = clock()
            g.compute_cpu_backend(n_threads=threads, reps=reps)
            best = min(best, (clock() - t0) / reps)
        return best
    finally:
        g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-kv", type=int, default=8192)
    ap.add_argument("--shape", choices=SHAPES, default="smollm2")
    ap.add_argument("--types", default="q4_0,nuq4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="1 (default): timed by thread CPU time")
    ap.add_argument("--centre-pairs", type=int, default=12, help="pairs per head with a mean, centred cache")
    ap.add_argument("--rot", type=int, default=64,
                    help="the +H columns' Hadamard block (the runtime takes the largest power of two dividing the head: 128 on Qwen)")
    ap.add_argument("--file", default=None, help="a --prerope-k file: its shape, frequencies and kept mean pairs")
    ap.add_argument("--layers", default=None, help="with --file: comma-separated layers (default: all, summed)")
    args = ap.parse_args()
    layers = [None]
    if args.file:
        sh, layers = file_layers(args.file, args.layers)
        args.shape = Path(args.file).name
    else:
        sh = SHAPES[args.shape]
    kw = dict(n_kv=args.n_kv, reps=args.reps, threads=args.threads, **sh)

    def over_layers(*a, **k):
        return sum(time_fa(*a, layer=ly, **k, **kw) for ly in layers)
    f16 = time_fa("f16", "f16", pre=False, rot=0, **kw) * len(layers)
    print(f"shape {args.shape} {sh}, n_kv {args.n_kv}, {args.threads} thread(s); us per FA call"
          + (f", summed over {len(layers)} layers" if args.file else ""))
    print(f"{'':>8} {'post':>10} {'pre':>10} {'pre+H':>10} {'centred+H':>10}  pre+H/post  centred+H/post  centred+H/f16")
    for t in args.types.split(","):
        post = time_fa(t, t, pre=False, rot=0, **kw) * len(layers)
        pre = over_layers(t, t, pre=True, rot=0)
        preh = over_layers(t, t, pre=True, rot=args.rot)
        cen = over_layers(t, t, pre=True, rot=args.rot, centred=args.centre_pairs)
        print(f"{t:>8} {post*1e6:10.1f} {pre*1e6:10.1f} {preh*1e6:10.1f} {cen*1e6:10.1f}  {post/preh:9.2f}x "
              f"{post/cen:14.2f}x {f16/cen:14.2f}x")
    print(f"(f16: {f16*1e6:.1f} us)")


if __name__ == "__main__":
    main()
