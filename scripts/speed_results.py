#!/usr/bin/env python3
"""CPU decode / prefill speed of cache types with llama-bench, as ratios in one run.

    python scripts/speed_results.py [--model smollm2-135m] [--types f16,q8_0,q4_0,bfp8_32,bfp4_32,bfp4_64]
                                    [--depths 0,4096,16384] [--threads N] [--reps 1]

Decode = tg32 at each depth; prefill = pp512 at depth 0 (prefill at depth runs
the per-row flash-attention path for every quantized type; issue 9 replaces it).
Every type runs in the same invocation of this script, one llama-bench per type
(K and V of that type, flash attention on, upstream rotation at its default),
and is reported as a ratio to f16 and to q4_0. Writes results/speed_<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from pykvq.models import fetch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "build" / "bin" / "llama-bench"


def llama_bench(model: Path, t: str, threads: int, reps: int, *test: str) -> list[dict]:
    """llama-bench rows for K and V of type t, flash attention on."""
    cmd = [str(BENCH), "-m", str(model), "-ctk", t, "-ctv", t, "-fa", "1", "-t", str(threads),
           "-r", str(reps), "-o", "json", *test]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def bench(model: Path, t: str, depths: list[int], threads: int, reps: int) -> list[dict]:
    """pp512 at depth 0, then tg32 at each depth."""
    return llama_bench(model, t, threads, reps, "-p", "512", "-n", "0", "-d", "0") + tg(model, t, depths, threads, reps)


def tg(model: Path, t: str, depths: list[int], threads: int, reps: int) -> list[dict]:
    if not depths:
        return []
    return llama_bench(model, t, threads, reps, "-p", "0", "-n", "32", "-d", ",".join(map(str, depths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--types", default="f16,q8_0,q4_0,bfp8_32,bfp4_32,bfp4_64")
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--deep-types", default="f16,q4_0,bfp4_32",
                    help="types that also run the deepest depth (filling it is quadratic; 'all' for every type)")
    args = ap.parse_args()
    types = args.types.split(",")
    depths = [int(d) for d in args.depths.split(",")]
    model = fetch(args.model, progress=True)

    t0 = time.time()
    speed = {}  # (type, test) -> tokens/s
    deep = types if args.deep_types == "all" else args.deep_types.split(",")
    for t in types:
        print(f"llama-bench {t} ...", flush=True)
        rows = bench(model, t, depths[:-1], args.threads, args.reps)
        if t in deep:
            rows += tg(model, t, depths[-1:], args.threads, args.reps)
        for r in rows:
            test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']} @ d{r['n_depth']}"
            speed[(t, test)] = r["avg_ts"]
            print(f"  {test:>14}: {r['avg_ts']:9.2f} t/s", flush=True)
    tests = ["pp512"] + [f"tg32 @ d{d}" for d in depths]

    bpv = {t: cache_bytes(model, t) for t in types}
    md = [f"{model.name}, CPU ({platform.machine()}, {args.threads} threads), llama-bench, flash attention on, "
          f"{args.reps} rep(s); prefill = pp512 at depth 0, decode = tg32 at depth d. "
          "Ratios are to f16 and to q4_0 measured in the same run.", "",
          "| cache (K and V) | bits/value | KV bytes/token | " + " | ".join(tests) + " |",
          "|---|---|---|" + "---|" * len(tests)]
    for t in types:
        cells = []
        for test in tests:
            v = speed.get((t, test))
            f, q = speed.get(("f16", test)), speed.get(("q4_0", test))
            cells.append(f"{v:.1f} ({v / f:.2f}× f16, {v / q:.2f}× q4_0)" if v and f and q else "-")
        md.append(f"| {t} | {bpv[t][0]:.2f} | {bpv[t][1]} | " + " | ".join(cells) + " |")
    out = ROOT / "results" / f"speed_{args.model}"
    out.parent.mkdir(exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({
        "meta": {"model": model.name, "threads": args.threads, "reps": args.reps, "machine": platform.machine(),
                 "seconds": round(time.time() - t0, 1)},
        "rows": [{"cache": t, "test": test, "tokens_per_s": v} for (t, test), v in speed.items()]}, indent=1))
    Path(f"{out}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def cache_bytes(model: Path, t: str) -> tuple[float, int]:
    """(bits per value, KV bytes per token over all layers) of a K+V cache of type t."""
    from pykvq import Model
    with Model(model, n_ctx=256, cache_type_k=t, cache_type_v=t, flash_attn=True) as m:
        info = m.kv_cache_info()
        return info.bits_per_value, info.bytes_per_token_layer * info.n_layer


if __name__ == "__main__":
    main()
