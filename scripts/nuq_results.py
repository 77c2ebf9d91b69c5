#!/usr/bin/env python3
"""NUQ cache types: codebooks, outliers, per-layer types vs stock types (KVQuant ablation).

    python scripts/nuq_results.py [--model smollm2-135m] [--chunks 16] [--n-ctx 512] [--only GROUPS]

Every row is measured against the *unconverted* model with an f16 cache over the
same WikiText-2 test chunks (pykvq.model.kld_sweep): mean / p99 KLD, same top-1,
PPL, and the cache's true bits/value. Converted files (codebooks, transforms,
per-layer types) are cached under $PYKVQ_CACHE/converted; calibration statistics
under $PYKVQ_CACHE/calib/stats, so the model is calibrated once. Online rotation
stays at auto (on for quantized caches unless a baked transform replaces it),
and the codebooks are fitted in that same domain. Writes results/nuq_<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from converter_results import ROOT, converted  # noqa: E402

from pykvq import Model  # noqa: E402
from pykvq.data import wikitext_test  # noqa: E402
from pykvq.model import kld_sweep  # noqa: E402
from pykvq.models import fetch  # noqa: E402

NUQ = ("nuq4", "nuq3", "nuq2", "nuq3o", "nuq2o")


def ct(t: str) -> list[str]:
    return ["--cache-type-k", t, "--cache-type-v", t]


# group -> [(label, variant, converter flags, K, V)]; K/V None = the file's own (per-layer) types
GROUPS = {
    "stock": [(f"{t} (stock)", "none", [], t, t) for t in ("q8_0", "q4_0", "bfp4_32")],
    "fallback": [(f"{t}, fallback codebook", "none", [], t, t) for t in NUQ],
    "fisher": [(f"{t}, Fisher + Q-Norm", f"cb-fisher-{t}", ct(t), t, t) for t in NUQ],
    "ablation": [
        (f"{b}: {what}", f"cb-{name}-{t}", ct(t) + flags, t, t)
        for b, (t3, t3o) in (("3-bit", ("nuq3", "nuq3o")), ("2-bit", ("nuq2", "nuq2o")))
        for what, name, flags, t in (
            ("uniform", "uniform", ["--codebooks", "uniform", "--no-qnorm"], t3),
            ("NUQ (k-means)", "kmeans", ["--codebooks", "kmeans", "--no-qnorm"], t3),
            ("NUQ + Fisher", "fisherNQ", ["--codebooks", "fisher", "--no-qnorm"], t3),
            ("+ outliers", "fisherNQ", ["--codebooks", "fisher", "--no-qnorm"], t3o),
            ("+ Q-Norm", "fisher", [], t3o))],
    "transforms": [
        (f"smooth+vrot, {t} Fisher", f"smooth+vrot+cb-{t}", ["--smooth-qk", "--rotate-v", "hadamard"] + ct(t), t, t)
        for t in ("nuq4", "nuq3o", "nuq2o")],
    "mixed": [(f"per-layer types, budget {b}", f"mixed-{b}", ["--kv-bits", str(b)], None, None)
              for b in (2.75, 3.6, 4.5)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--only", default=None, help=f"comma-separated groups ({', '.join(GROUPS)}; default all)")
    args = ap.parse_args()
    src = fetch(args.model, progress=True)
    groups = args.only.split(",") if args.only else list(GROUPS)
    rows = [(g, *r) for g in groups for r in GROUPS[g]]
    files, conv = {}, {}
    for _, _, variant, flags, _, _ in rows:
        if variant not in files:
            files[variant], rep = converted(src, variant, flags)
            conv[variant] = rep["seconds"]
            print(f"{variant}: {files[variant].name} ({rep['seconds']} s)", flush=True)
    base = Model(src, n_ctx=args.n_ctx, cache_type_k="f16", cache_type_v="f16", flash_attn=True)
    cands = {label: Model(files[variant], n_ctx=args.n_ctx, cache_type_k=k, cache_type_v=v, flash_attn=True)
             for _, label, variant, _, k, v in rows}
    t0 = time.time()
    res = kld_sweep(base, cands, wikitext_test(), n_ctx=args.n_ctx, n_chunks=args.chunks, progress=True)
    any_r = next(iter(res.values()))
    out_rows = [{"group": "f16", "setting": "f16 cache", "bits_per_value": 16.0, "mean_kld": 0.0, "p99_kld": 0.0,
                 "same_top1": 1.0, "ppl": any_r.ppl_base, "rotation": "-"}]
    for (group, label, variant, _, _, _), m in zip(rows, cands.values()):
        rot = [w for w, on in m.attn_rotation.items() if on]
        out_rows.append(dict(res[label].as_dict(), group=group, setting=label,
                             bits_per_value=m.kv_cache_info().bits_per_value,
                             rotation="+".join(rot) if rot else "off"))
    meta = {"model": src.name, "text": "WikiText-2 raw test", "n_ctx": args.n_ctx, "n_chunks": any_r.n_chunks,
            "n_tokens": any_r.n_tokens, "flash_attn": True, "seconds": round(time.time() - t0, 1),
            "machine": platform.machine(), "threads": os.cpu_count(), "conversion_seconds": conv}
    prev = ROOT / "results" / f"nuq_{args.model}.json"
    if args.only and prev.exists():         # keep the other groups' rows from an earlier run
        old = json.loads(prev.read_text())["rows"]
        out_rows = out_rows + [r for r in old if r["group"] not in groups and r["group"] != "f16"]
    prev.write_text(json.dumps({"meta": meta, "rows": out_rows}, indent=1))
    md = [f"{meta['model']}, {meta['text']}, ctx {meta['n_ctx']}, {meta['n_chunks']} chunks "
          f"({meta['n_tokens']} scored tokens), flash attention on; KLD against the unconverted model "
          "with an f16 cache. Online rotation at auto.", "",
          "| group | setting | bits/value | online rotation | mean KLD | p99 KLD | same top-1 | PPL |",
          "|---|---|---|---|---|---|---|---|"]
    order = ["f16"] + list(GROUPS)
    for r in sorted(out_rows, key=lambda r: order.index(r["group"])):
        md.append(f"| {r['group']} | {r['setting']} | {r['bits_per_value']:.3f} | {r['rotation']} | "
                  f"{r['mean_kld']:.4f} | {r['p99_kld']:.3f} | {100 * r['same_top1']:.1f}% | {r['ppl']:.3f} |")
    (ROOT / "results" / f"nuq_{args.model}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
