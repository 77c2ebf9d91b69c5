#!/usr/bin/env python3
"""Cache types vs an f16 cache on WikiText-2 test: KLD / p99 / same-top-1 / PPL.

    python scripts/quality_results.py [--model smollm2-135m] [--chunks 16] [--n-ctx 512]
                                      [--set bfp|core|stock] [--plot]

Writes results/quality_<model>.json and .md (and a plot with --plot). Every
setting is compared with the same model on an f16 cache, in one pass over the
same chunks (pykvq.model.kld_sweep). Rotation = upstream's online Hadamard
rotation of the cache, set per context (Model(attn_rot_k=..., attn_rot_v=...)).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from pykvq import Model
from pykvq.model import kld_sweep
from pykvq.data import wikitext_test
from pykvq.models import fetch

ROOT = Path(__file__).resolve().parent.parent
PAIRED = ["q8_0", "q5_0", "q4_0", "q4_1", "iq4_nl", "bfp8_32", "bfp4_32", "bfp4_64"]
K_ONLY = [("q8_0", (True,)), ("q4_0", (True, False)), ("iq4_nl", (True,)), ("bfp8_32", (True,)),
          ("bfp4_32", (True, False)), ("bfp4_64", (True, False))]
SETS = {
    # every type for K and V with rotation on and off, plus K-only rows (V f16)
    "bfp": [(t, t, rot) for t in PAIRED for rot in (True, False)]
           + [(k, "f16", rot) for k, rots in K_ONLY for rot in rots],
    # the rows that matter most, for the slow model
    "core": [(t, t, rot) for t in ("q8_0", "q4_0", "iq4_nl", "bfp8_32", "bfp4_32", "bfp4_64") for rot in (True, False)]
            + [(k, "f16", rot) for k in ("q4_0", "bfp4_32") for rot in (True, False)],
    "stock": [(t, t, True) for t in ("q8_0", "q5_0", "q4_0")] + [("q4_0", "q4_0", False), ("q8_0", "q4_0", True)],
}


def setting_label(k, v, rot):
    kv = k if k == v else (f"{k} K, f16 V" if v == "f16" else f"{k} K + {v} V")
    return f"{kv} (rot {'on' if rot else 'off'})"


def open_model(path, n_ctx, k, v, rotation):
    r = "on" if rotation else "off"
    return Model(path, n_ctx=n_ctx, cache_type_k=k, cache_type_v=v, flash_attn=True,
                 attn_rot_k=r, attn_rot_v=r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--set", default="bfp", choices=sorted(SETS), help="which settings to run")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated setting labels to run (default: all)")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON")
    args = ap.parse_args()
    if args.replot:
        replot(ROOT / "results" / f"quality_{args.model}.json")
        return
    settings = [(setting_label(*s), *s) for s in SETS[args.set]]
    settings = [s for s in settings if args.only is None or s[0] in args.only.split(",")]

    path = fetch(args.model, progress=True)
    base = open_model(path, args.n_ctx, "f16", "f16", False)
    cands = {label: open_model(path, args.n_ctx, k, v, rot) for label, k, v, rot in settings}
    t0 = time.time()
    res = kld_sweep(base, cands, wikitext_test(), n_ctx=args.n_ctx, n_chunks=args.chunks, progress=True)
    ppl = next(iter(res.values())).ppl_base
    rows = [{"cache": "f16", "bits_per_value": 16.0, "mean_kld": 0.0, "p99_kld": 0.0, "same_top1": 1.0,
             "ppl": ppl, "rotation": "-"}]
    for label, k, v, rot in settings:
        r, m = res[label], cands[label]
        rows.append(dict(r.as_dict(), cache=label, bits_per_value=m.kv_cache_info().bits_per_value,
                         rotation=m.transforms().split(": ")[1]))
    meta = {"model": path.name, "text": "WikiText-2 raw test", "n_ctx": args.n_ctx,
            "n_chunks": res[settings[0][0]].n_chunks, "n_tokens": res[settings[0][0]].n_tokens,
            "flash_attn": True, "seconds": round(time.time() - t0, 1), "machine": platform.machine(),
            "threads": os.cpu_count()}
    stem = ROOT / "results" / f"quality_{args.model}"
    stem.parent.mkdir(exist_ok=True)
    out = {ext: stem.parent / f"{stem.name}.{ext}" for ext in ("json", "md", "png")}
    out["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"{meta['model']}, {meta['text']}, ctx {meta['n_ctx']}, {meta['n_chunks']} chunks "
          f"({meta['n_tokens']} scored tokens), flash attention on, KLD against an f16 cache.", "",
          "| cache | bits/value (K+V) | online rotation | mean KLD | p99 KLD | same top-1 | PPL |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['cache']} | {r['bits_per_value']:.2f} | {r['rotation']} | {r['mean_kld']:.4f} | "
                  f"{r['p99_kld']:.3f} | {100 * r['same_top1']:.1f}% | {r['ppl']:.3f} |")
    out["md"].write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if args.plot:
        plot(rows, out["png"], meta)


def plot(rows, path, meta):
    """KLD vs bits/value for K+V rows: filled = rotation on, hollow = off; red = pykvq types."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows[1:]:
        if " K" in r["cache"]:          # K-only rows are in the table, not the plot
            continue
        name, rot = r["cache"].split(" (rot ")
        ours = name.startswith(("bfp", "nuq"))
        on = rot.startswith("on")
        color = "tab:red" if ours else "tab:blue"
        ax.scatter(r["bits_per_value"], r["mean_kld"], s=46, color=color if on else "white",
                   edgecolors=color, linewidths=1.5, zorder=3)
        ax.annotate(name, (r["bits_per_value"], r["mean_kld"]), textcoords="offset points",
                    xytext=(6, -3 if on else 3), fontsize=8, color=color)
    ax.scatter([], [], color="gray", label="rotation on")
    ax.scatter([], [], color="white", edgecolors="gray", label="rotation off")
    ax.scatter([], [], color="tab:blue", label="stock llama.cpp")
    ax.scatter([], [], color="tab:red", label="pykvq")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_yscale("log")
    ax.set_xlabel("KV-cache bits per value (K and V the same type)")
    ax.set_ylabel("mean KLD vs f16 cache (log scale)")
    ax.set_title(f"{meta['model']}, WikiText-2 test, ctx {meta['n_ctx']}, {meta['n_tokens']} scored tokens",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(json_path: Path) -> None:
    d = json.loads(json_path.read_text())
    plot(d["rows"], json_path.with_suffix(".png"), d["meta"])


if __name__ == "__main__":
    main()
