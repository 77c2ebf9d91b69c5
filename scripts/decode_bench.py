#!/usr/bin/env python3
"""Decode speed at depth of several caches of one file, measured interleaved in one process.

    python scripts/decode_bench.py FILE [--depths 8192,16384] [--caches f16,q4_0:post,q4_0:centred,q53_64/q4_0,q4_0:auto:stock,q4_0:auto::0+0,q4_0:auto:::f16]
                                        [--rounds 8] [--tokens 16] [--prefill 512] [--threads 2]

A cache `file` runs the file's own (per-layer) types; `CACHE@PATH` runs CACHE on another file (same tokenizer).
llama-bench runs one cache after another; on a shared machine whole runs then move by 20% and a ratio
of two runs says little. Here every cache (K[/V][:K_DOMAIN[:ENCODER[:S+W]]], V of K's type when not given; Model(k_domain=,
encoder=, kv_sinks=S, kv_window=W): ENCODER stock / lsq sets how q4_0 / q5_0 rows are written, S+W the exact sinks and
window, the file's default when not given; an empty field takes the default) gets
its own context (K[/V][:K_DOMAIN[:ENCODER[:S+W[:ROWS]]]]: ROWS the window rows' type, Model(kv_window_type=)), prefilled
once to each depth with the same WikiText-2 text; then each round decodes
--tokens tokens in every context in turn (and removes them again), so a slow spell of the machine falls
on all of them alike. With --prefill P each round also times a batch of P tokens at the depth (prefill at
depth). Printed: median tokens/s per cache and the median over rounds of each cache's ratios to the first
and to the second.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pykvq import Model  # noqa: E402
from pykvq.data import wikitext_test  # noqa: E402


def report(what: str, names: list[str], tps: np.ndarray) -> None:
    """Median tokens/s per cache, and the median over rounds of its ratio to the first and the second cache."""
    j = min(1, len(names) - 1)
    r1, r2 = tps / tps[:, :1], tps / tps[:, j:j + 1]
    print(f"  {what}:")
    for i, name in enumerate(names):
        print(f"  {name:16s} {np.median(tps[:, i]):8.2f} tok/s   x{np.median(r1[:, i]):.3f} of {names[0]}"
              f"   x{np.median(r2[:, i]):.3f} of {names[j]}   (rounds, of {names[j]}: {np.round(r2[:, i], 2).tolist()})",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--depths", default="8192,16384")
    ap.add_argument("--caches", default="f16,q4_0:post,q4_0:centred,q4_0:auto",
                    help="K[/V][:K_DOMAIN[:ENCODER[:S+W[:ROWS]]]], comma-separated; ratios are to the first and the second")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded per context and round")
    ap.add_argument("--prefill", type=int, default=0, help="also time a batch of this many tokens per round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    specs = [c.partition("@") for c in args.caches.split(",")]     # CACHE[@OTHER_FILE]
    caches = [[f or None for f in (c.split(":") + [None] * 4)[:5]] for c, _, _ in specs]
    caches = [((t.split("/") + [t])[:2], dom, enc, win, rows) for t, dom, enc, win, rows in caches]   # V = K unless given
    files = [path or args.file for _, _, path in specs]
    n_ctx = max(depths) + max(args.tokens, args.prefill) + 16

    models = []
    for ((k, v), dom, enc, win, rows), path in zip(caches, files):
        sinks, window = (int(x) for x in win.split("+")) if win else (None, None)
        k, v = (None if t == "file" else t for t in (k, v))
        models.append(Model(path, n_ctx=n_ctx, cache_type_k=k, cache_type_v=v, flash_attn=True,
                            n_threads=args.threads, k_domain=dom, encoder=enc, n_batch=512,
                            kv_sinks=sinks, kv_window=window, kv_window_type=rows))
    toks = models[0].tokenize(wikitext_test())
    need = max(depths) + max(args.tokens, args.prefill)
    if len(toks) < need:
        raise SystemExit(f"the text has {len(toks)} tokens, need {need}")
    names = [(k if k == v else f"{k}/{v}") + (f" {dom}" if dom else "") + (f" {enc}" if enc else "")
             + (f" win {win}" if win else "") + (f" {rows} rows" if rows else "")
             + (f" {Path(p).stem}" if p != args.file else "")
             for ((k, v), dom, enc, win, rows), p in zip(caches, files)]
    print(f"{Path(args.file).name}, {args.threads} threads, {args.rounds} rounds x {args.tokens} tokens per cache")
    filled = 0
    for d in depths:
        t0 = time.time()
        for m in models:
            for p in range(filled, d, 512):
                m.decode(toks[p:min(p + 512, d)], p)
        filled = d
        print(f"depth {d}: prefilled in {time.time() - t0:.0f} s", flush=True)
        tps = np.zeros((args.rounds, len(models)))
        pps = np.zeros((args.rounds, len(models)))
        for r in range(args.rounds):
            for i, m in enumerate(models):
                t0 = time.perf_counter()
                for k in range(args.tokens):
                    m.decode(toks[d + k:d + k + 1], d + k)
                tps[r, i] = args.tokens / (time.perf_counter() - t0)
                m.seq_rm(d, -1)
                if args.prefill:
                    t0 = time.perf_counter()
                    m.decode(toks[d:d + args.prefill], d)
                    pps[r, i] = args.prefill / (time.perf_counter() - t0)
                    m.seq_rm(d, -1)
        report(f"decode, {args.tokens} tokens one by one", names, tps)
        if args.prefill:
            report(f"prefill, a batch of {args.prefill}", names, pps)
    for m in models:
        m.close()


if __name__ == "__main__":
    main()
