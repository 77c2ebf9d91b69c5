#!/usr/bin/env python3
"""Converter transforms x cache types vs the original model on an f16 cache.

    python scripts/converter_results.py [--model smollm2-135m] [--chunks 16] [--n-ctx 512]

Converts the model once per transform set (cached under $PYKVQ_CACHE/converted),
then measures KLD / p99 KLD / same-top-1 / PPL on WikiText-2 test for each
(transforms, K type, V type), all against the *unconverted* model with an f16
cache, over the same chunks (pykvq.model.kld_sweep). Online rotation is left at
auto, which the converted files steer: K-sorted keys are not rotated online,
a baked V Hadamard turns the online V rotation off, everything else keeps
upstream's rule (on for quantized caches). Writes results/converter_<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from pykvq import Model
from pykvq.data import wikitext_test
from pykvq.model import kld_sweep
from pykvq.models import fetch
from pykvq.suite.converted import converted as suite_converted

ROOT = Path(__file__).resolve().parent.parent

# transform set -> converter flags
VARIANTS = {
    "none": [],
    "ksort": ["--ksort", "--ksort-key", "weight"],
    "ksort+smooth": ["--ksort", "--smooth-qk"],
    "ksort+smooth+vrot": ["--ksort", "--smooth-qk", "--rotate-v", "hadamard"],
    "smooth+vrot": ["--smooth-qk", "--rotate-v", "hadamard"],
}
# (variant, K type, V type)
ROWS = ([("none", t, t) for t in ("q8_0", "q4_0", "bfp4_32", "bfp4_64")]
        + [(v, t, t) for v in ("ksort", "ksort+smooth", "ksort+smooth+vrot") for t in ("bfp4_32", "bfp4_64", "q4_0")]
        + [("ksort+smooth+vrot", "f16", "f16")]
        + [("smooth+vrot", t, t) for t in ("q4_0", "bfp4_32")])


def converted(src: Path, variant: str, flags: list[str] | None = None) -> tuple[Path, dict]:
    """(path, {"seconds", "stdout"}) of src converted with a variant (flags default to VARIANTS')."""
    if variant != "none" and flags is None:
        flags = VARIANTS[variant]
        if "smooth" in variant:
            flags = flags + ["--cache-type-k", "bfp4_32" if "ksort" in variant else "q4_0"]
    return suite_converted(src, None if variant == "none" else variant, flags or [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--only", default=None, help="comma-separated variants to run (default: all)")
    args = ap.parse_args()
    src = fetch(args.model, progress=True)
    rows = [r for r in ROWS if args.only is None or r[0] in args.only.split(",")]
    files, conv = {}, {}
    for variant in dict.fromkeys(r[0] for r in rows):
        files[variant], report = converted(src, variant)
        conv[variant] = {"seconds": report["seconds"], "log": report["stdout"]}
        print(f"{variant}: {files[variant]} ({report['seconds']} s)", flush=True)
    base = Model(src, n_ctx=args.n_ctx, cache_type_k="f16", cache_type_v="f16", flash_attn=True)
    cands = {}
    for variant, k, v in rows:
        label = f"{variant} | {k}/{v}"
        cands[label] = Model(files[variant], n_ctx=args.n_ctx, cache_type_k=k, cache_type_v=v, flash_attn=True)
    t0 = time.time()
    res = kld_sweep(base, cands, wikitext_test(), n_ctx=args.n_ctx, n_chunks=args.chunks, progress=True)
    out_rows = [{"transforms": "none", "cache": "f16", "bits_per_value": 16.0, "mean_kld": 0.0, "p99_kld": 0.0,
                 "same_top1": 1.0, "ppl": next(iter(res.values())).ppl_base, "rotation": "-"}]
    for (variant, k, v), (label, m) in zip(rows, cands.items()):
        r = res[label]
        rot = [w for w, on in m.attn_rotation.items() if on]
        out_rows.append(dict(r.as_dict(), transforms=variant, cache=k if k == v else f"{k}/{v}",
                             bits_per_value=m.kv_cache_info().bits_per_value,
                             rotation="+".join(rot) if rot else "off"))
    meta = {"model": src.name, "text": "WikiText-2 raw test", "n_ctx": args.n_ctx,
            "n_chunks": next(iter(res.values())).n_chunks, "n_tokens": next(iter(res.values())).n_tokens,
            "flash_attn": True, "seconds": round(time.time() - t0, 1), "machine": platform.machine(),
            "threads": os.cpu_count(), "conversion": conv}
    out = {ext: ROOT / "results" / f"converter_{args.model}.{ext}" for ext in ("json", "md")}
    out["json"].write_text(json.dumps({"meta": meta, "rows": out_rows}, indent=1))
    md = [f"{meta['model']}, {meta['text']}, ctx {meta['n_ctx']}, {meta['n_chunks']} chunks "
          f"({meta['n_tokens']} scored tokens), flash attention on; KLD against the *unconverted* model "
          "with an f16 cache. Online rotation at auto (steered by the file's keys).", "",
          "| transforms | cache (K and V) | bits/value | online rotation | mean KLD | p99 KLD | same top-1 | PPL |",
          "|---|---|---|---|---|---|---|---|"]
    for r in out_rows:
        md.append(f"| {r['transforms']} | {r['cache']} | {r['bits_per_value']:.2f} | {r['rotation']} | "
                  f"{r['mean_kld']:.4f} | {r['p99_kld']:.3f} | {100 * r['same_top1']:.1f}% | {r['ppl']:.3f} |")
    md += ["", "Conversion time (s): " + ", ".join(f"{k} {v['seconds']}" for k, v in conv.items() if k != "none")]
    out["md"].write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
