#!/usr/bin/env python3
"""Serving benchmarks, printed as ratios against f16 in the same run.

1. llama-server, 4 parallel clients, each with its own ~N-token WikiText prompt (a few thousand tokens of
   context per slot) asking for M tokens: aggregate decode tokens/s, prompt tokens/s, wall time per cache type.
2. llama.cpp's RPC backend: llama-bench decode (tg) and prefill (pp) tokens/s locally and with every layer on
   two loopback ggml-rpc-server workers, per cache type, and the KLD of the RPC run against the local one
   (llama-perplexity, 2 x 512 tokens of WikiText).

    .venv/bin/python scripts/serve_bench.py [--types f16,q4_0,nuq4] [--prompt-tokens 2000] [--threads 2]
    .venv/bin/python scripts/serve_bench.py --model FILE.gguf --skip-server --types q4_0   # e.g. a --prerope-k file
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pykvq import Model  # noqa: E402
from pykvq.data import wikitext_test, wikitext_test_path  # noqa: E402
from pykvq.registry import fetch  # noqa: E402
from pykvq.serve import RpcWorkers, Server  # noqa: E402

BIN = REPO / "build" / "bin"


def prompts(model: Path, n_tokens: int, n: int) -> list[str]:
    """n disjoint WikiText passages of about n_tokens tokens each."""
    text = wikitext_test()
    with Model(model, n_ctx=256) as m:
        toks = m.tokenize(text[: 12 * n_tokens * n], add_special=False)
        return [m.detokenize(toks[i * n_tokens:(i + 1) * n_tokens]) for i in range(n)]


def server_run(model: Path, cache: str, texts: list[str], n_predict: int, threads: int) -> dict:
    n_ctx = len(texts) * (int(1.3 * len(texts[0]) / 3) + n_predict + 256)
    with Server(model, cache_type_k=cache, cache_type_v=cache, n_parallel=len(texts), n_ctx=n_ctx,
                threads=threads) as srv:
        body = lambda t: {"prompt": t, "n_predict": n_predict, "temperature": 0.0, "ignore_eos": True,  # noqa: E731
                          "cache_prompt": False}
        srv.post("/completion", {"prompt": "warm up", "n_predict": 4})
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(len(texts)) as ex:
            res = list(ex.map(lambda t: srv.post("/completion", body(t), timeout=3600), texts))
        wall = time.perf_counter() - t0
    gen = sum(r["tokens_predicted"] for r in res)
    prompt = sum(r["timings"]["prompt_n"] for r in res)
    return {"cache": cache, "wall_s": wall, "gen_tokens": gen, "prompt_tokens": prompt,
            "gen_tps": gen / sum(r["timings"]["predicted_ms"] / 1000 for r in res) * len(res),
            "total_tps": (gen + prompt) / wall}


def rpc_kld(model: Path, cache: str, threads: int, endpoints: str) -> float:
    """Mean KLD of the RPC run's logits against the local run's (2 chunks of 512 tokens). The local run does not
    repack weights (-nr), as the workers do not: repacked Q4_K matmuls round differently (Qwen2.5-1.5B with a
    q4_0 pre-RoPE cache: KLD 0.008 between local runs with and without repacking)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "local.kld"
        common = [str(BIN / "llama-perplexity"), "-m", str(model), "-f", str(wikitext_test_path()), "-c", "512",
                  "--chunks", "2", "-b", "512", "-ctk", cache, "-ctv", cache, "-fa", "on", "-t", str(threads),
                  "--kl-divergence-base", str(base)]
        subprocess.run([*common, "-ngl", "0", "-nr"], capture_output=True, text=True, check=True)
        res = subprocess.run([*common, "--rpc", endpoints, "-ngl", "99", "--kl-divergence"],
                             capture_output=True, text=True, check=True)
        return float(re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", res.stdout + res.stderr).group(1))


def rpc_bench(model: Path, cache: str, threads: int, depth: int) -> dict:
    out = {}
    with RpcWorkers(2, threads=max(1, threads // 2)) as workers:
        out["kld"] = rpc_kld(model, cache, threads, workers.endpoints)
        for where, extra in (("local", ["-ngl", "0"]), ("rpc", ["-rpc", workers.endpoints, "-ngl", "99"])):
            cmd = [str(BIN / "llama-bench"), "-m", str(model), "-ctk", cache, "-ctv", cache, "-fa", "1",
                   "-p", "512", "-n", "32", "-d", str(depth), "-r", "2", "-t", str(threads), "-o", "json", *extra]
            rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            for r in rows:
                out[f"{where}_{'pp' if r['n_prompt'] > 0 else 'tg'}"] = r["avg_ts"]
    return {"cache": cache, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="f16,q4_0,nuq4")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--predict", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2048, help="KV depth for the RPC decode benchmark")
    ap.add_argument("--skip-rpc", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--model", default="smollm2-135m", help="a registry name or a GGUF path")
    args = ap.parse_args()
    model = Path(args.model) if Path(args.model).is_file() else fetch(args.model)
    types = args.types.split(",")
    if not args.skip_server:
        server_table(model, types, args)
    if args.skip_rpc:
        return 0
    print(f"\nRPC ({model.name}): llama-bench, two loopback workers vs local, depth {args.depth}; "
          "KLD of the RPC run against the local run (2 x 512 tokens)")
    print("| cache | local tg | rpc tg | rpc/local | local pp512 | rpc pp512 | rpc/local | KLD rpc vs local |")
    print("|---|---|---|---|---|---|---|---|")
    for t in types:
        r = rpc_bench(model, t, args.threads, args.depth)
        print(f"| {t} | {r['local_tg']:.1f} | {r['rpc_tg']:.1f} | {r['rpc_tg'] / r['local_tg']:.2f}x | "
              f"{r['local_pp']:.1f} | {r['rpc_pp']:.1f} | {r['rpc_pp'] / r['local_pp']:.2f}x | {r['kld']:.2e} |",
              flush=True)
    return 0


def server_table(model: Path, types: list[str], args) -> None:
    texts = prompts(model, args.prompt_tokens, args.clients)
    print(f"llama-server, {args.clients} parallel clients, ~{args.prompt_tokens}-token prompts, "
          f"{args.predict} tokens each, {args.threads} threads")
    rows = [server_run(model, t, texts, args.predict, args.threads) for t in types]
    base = rows[0]
    print("| cache | wall s | decode tok/s (sum of slots) | vs f16 | prompt+decode tok/s | vs f16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['wall_s']:.1f} | {r['gen_tps']:.1f} | {r['gen_tps'] / base['gen_tps']:.2f}x "
              f"| {r['total_tps']:.1f} | {r['total_tps'] / base['total_tps']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
