#!/usr/bin/env python3
"""CPU flash attention before / after (issue 9): llama-bench prefill and decode at depth.

    python scripts/fattn_results.py [--model smollm2-135m] [--types f16,q8_0,q4_0,bfp4_32,nuq4,nuq3o,nuq2o]
                                    [--depths 0,4096,16384] [--before q8_0,q4_0,bfp4_32,nuq4]
                                    [--before-depths 0,4096] [--tests pp,tg] [--threads N] [--name fattn]

Each row is one llama-bench invocation (K and V of one type, flash attention on):
  <type>          pykvq's flash attention for quantized caches (the default)
  <type>@prerope  the same type on the model converted with --prerope-k (a suite setting: any
                  <type>@<transform> runs on its converted file, made once and cached)
  <type> per-row  the same binary with GGML_KVQ_FA=0: upstream's per-row path (before)
  f16             upstream's f16 path (split-KV decode, tiled prefill): the baseline
  f16 (pykvq)     GGML_KVQ_FA=all: f16 through pykvq's path, for reference
pp = pp512 at depth d (prefill 512 tokens after d), tg = tg32 at depth d. Ratios are to
f16 and to stock q4_0 measured in the same run. Rows are appended to
results/fattn_<model>.json as they finish, so a long run can be stopped and resumed
(rows already there are skipped); the markdown table is rewritten each time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from pykvq.registry import fetch
from pykvq.suite.speed import cpu_name

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "build" / "bin" / "llama-bench"


def run_bench(model: Path, t: str, env: dict, threads: int, depths: list[int], tests: list[str]) -> list[dict]:
    cmd = [str(BENCH), "-m", str(model), "-ctk", t, "-ctv", t, "-fa", "1", "-t", str(threads), "-r", "1",
           "-p", "512" if "pp" in tests else "0", "-n", "32" if "tg" in tests else "0",
           "-d", ",".join(map(str, depths)), "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
    return json.loads(out)


def model_for(model: Path, label: str) -> Path:
    """The file a row runs on: the model, or for <type>@<transform> the model converted that way."""
    if "@" not in label:
        return model
    from pykvq.suite.converted import for_setting
    from pykvq.suite.settings import parse_setting
    return for_setting(model, parse_setting(label.split(" ")[0]))[0]


def test_name(r: dict) -> str:
    return f"pp512 @ d{r['n_depth']}" if r["n_prompt"] else f"tg32 @ d{r['n_depth']}"


def table(rows: dict, meta: dict, depths: list[int], tests: list[str]) -> str:
    cols = [f"{k}{'512' if k == 'pp' else '32'} @ d{d}" for k in tests for d in depths]
    labels = list(dict.fromkeys(label for label, _ in rows))
    md = [f"{meta['model']}, CPU ({meta['machine']}, {meta['threads']} threads), llama-bench, flash attention on, "
          "1 rep; tokens/s with ratios to f16 (upstream path) and stock q4_0 (pykvq path) from the same run. "
          "'per-row' = GGML_KVQ_FA=0, upstream's per-row path for quantized caches (before); "
          "'f16 (pykvq)' = GGML_KVQ_FA=all.", "",
          "| cache (K and V) | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for label in labels:
        cells = []
        for c in cols:
            v, f, q = rows.get((label, c)), rows.get(("f16", c)), rows.get(("q4_0", c))
            if v is None:
                cells.append("-")
                continue
            rel = [f"{v / f:.2f}× f16"] if f else []
            rel += [f"{v / q:.2f}× q4_0"] if q and label != "q4_0" else []
            plain = label.partition("@")[0]          # <type>@<transform>: also to the type unconverted
            if plain != label and plain != "q4_0" and rows.get((plain, c)):
                rel.append(f"{v / rows[(plain, c)]:.2f}× {plain}")
            cells.append(f"{v:.1f} ({', '.join(rel)})" if rel else f"{v:.1f}")
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--types", default="f16,q8_0,q4_0,bfp4_32,nuq4,nuq3o,nuq2o")
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--before", default="q8_0,q4_0,bfp4_32,nuq4",
                    help="types also run on upstream's per-row path (GGML_KVQ_FA=0)")
    ap.add_argument("--before-depths", default="0,4096",
                    help="depths for the per-row rows (filling 16k on the per-row path takes minutes per type)")
    ap.add_argument("--f16-pykvq", action="store_true", help="add the f16 (pykvq) row")
    ap.add_argument("--tests", default="pp,tg")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--table-only", action="store_true", help="rewrite the table from the saved rows, run nothing")
    ap.add_argument("--name", default="fattn", help="results/<name>_<model>.json|md (rows there are not run again)")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    bdepths = [int(d) for d in args.before_depths.split(",")]
    tests = args.tests.split(",")
    model = fetch(args.model, progress=True)

    runs = [(t, t.partition("@")[0], {}, depths) for t in args.types.split(",")]
    if args.f16_pykvq:
        runs.append(("f16 (pykvq)", "f16", {"GGML_KVQ_FA": "all"}, depths))
    runs += [(f"{t} per-row", t, {"GGML_KVQ_FA": "0"}, bdepths) for t in args.before.split(",") if t]

    out = ROOT / "results" / f"{args.name}_{args.model}"
    out.parent.mkdir(exist_ok=True)
    jpath = Path(f"{out}.json")
    saved = json.loads(jpath.read_text()) if jpath.exists() else {"rows": []}
    rows = {(r["cache"], r["test"]): r["tokens_per_s"] for r in saved["rows"]}
    meta = {"model": model.name, "threads": args.threads, "machine": platform.machine(),
            "cpu": cpu_name()}
    for label, t, env, ds in [] if args.table_only else runs:
        for d in ds:
            for k in tests:
                col = f"{k}{'512' if k == 'pp' else '32'} @ d{d}"
                if (label, col) in rows:
                    continue
                t0 = time.time()
                print(f"{label:>16} {col} ...", end=" ", flush=True)
                for r in run_bench(model_for(model, label), t, env, args.threads, [d], [k]):
                    rows[(label, test_name(r))] = r["avg_ts"]
                print(f"{rows.get((label, col), float('nan')):.2f} t/s ({time.time() - t0:.0f} s)", flush=True)
                jpath.write_text(json.dumps({"meta": meta, "rows": [
                    {"cache": a, "test": b, "tokens_per_s": v} for (a, b), v in rows.items()]}, indent=1))
                Path(f"{out}.md").write_text(table(rows, meta, depths, tests))
    Path(f"{out}.md").write_text(table(rows, meta, depths, tests))
    print(table(rows, meta, depths, tests))


if __name__ == "__main__":
    main()
