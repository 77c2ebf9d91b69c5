"""The quality matrix: every setting against the same model with an f16 cache.

The f16 baseline is evaluated once per (model, text, chunking) into a
llama-perplexity base-logits file under $PYKVQ_CACHE/eval, then every setting
is scored against it (mean / p99 KLD, same top-1, PPL, exact bits/value).
Converted settings are compared with the *unconverted* model's f16 cache, so
a transform's own effect counts. Rows are saved as they finish; a rerun skips
the settings already in the file.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..model import Model
from ..paths import cache_dir
from .converted import for_setting
from .settings import Setting
from .store import ResultStore


def _say(msg: str) -> None:
    print(f"[pykvq eval] {msg}", file=sys.stderr, flush=True)


def base_logits(src: Path, text: str, text_id: str, n_ctx: int, chunks: int,
                progress: bool | None) -> tuple[Path, float]:
    """The f16-cache base-logits file for (model, text, n_ctx, chunks), computed once, and the
    f16 cache's exact PPL (kept beside it: the file's 16-bit log-probs give it only to ~1%)."""
    path = cache_dir() / "eval" / f"{src.stem}.{text_id}.ctx{n_ctx}.c{chunks}.kld"
    ppl_path = path.with_suffix(".ppl.json")
    if not (path.is_file() and ppl_path.is_file()):
        path.parent.mkdir(parents=True, exist_ok=True)
        _say(f"f16 baseline logits -> {path}")
        nlls: list = []
        with Model(src, n_ctx=n_ctx, cache_type_k="f16", cache_type_v="f16", flash_attn=True) as base:
            base.save_logits(path, text, n_ctx=n_ctx, n_chunks=chunks, progress=progress, nll_out=nlls)
        ppl_path.write_text(json.dumps({"ppl": float(np.exp(np.concatenate(nlls).mean()))}))
    return path, json.loads(ppl_path.read_text())["ppl"]


def evaluate(m: Model, base: Path, chunks: int, progress: bool | None) -> dict:
    """One setting's row (without its identity fields)."""
    t0 = time.time()
    r = m.kl_divergence(baseline=base, n_chunks=chunks, progress=progress)
    info = m.kv_cache_info()
    return dict(r.as_dict(), kld_se=float(r.kld.std(ddof=1) / np.sqrt(len(r.kld))),
                median_kld=r.median_kld, bits_per_value=info.bits_per_value,
                kv_bytes_per_token=info.bytes_per_token,
                cache_k=info.type_summary("k"), cache_v=info.type_summary("v"),
                active=m.transforms(), seconds=round(time.time() - t0, 1))


def run(src: Path, settings: list[Setting], out: Path, *, text: str, text_name: str, n_ctx: int = 512,
        chunks: int = 16, progress: bool | None = None) -> ResultStore:
    """Evaluate settings on src; rows go to out (JSON), resumed if out holds the same config."""
    text_id = hashlib.sha256(text.encode()).hexdigest()[:12]
    config = {"model": src.name, "model_bytes": src.stat().st_size, "text": text_name, "text_sha": text_id,
              "n_ctx": n_ctx, "chunks": chunks, "flash_attn": True}
    store = ResultStore(out, config)
    base, base_ppl = base_logits(src, text, text_id, n_ctx, chunks, progress)
    todo = [s for s in settings if s.label not in store]
    if len(todo) < len(settings):
        _say(f"{len(settings) - len(todo)} of {len(settings)} settings already in {out}")
    for i, s in enumerate(todo):
        path, conv = for_setting(src, s)
        _say(f"[{i + 1}/{len(todo)}] {s.label}")
        with Model(path, n_ctx=n_ctx, flash_attn=True, **s.model_kwargs(evaluation=True)) as m:
            row = evaluate(m, base, chunks, progress)
            wb = s.window_bits(m.n_ctx, m.setting("kv_window_type") or "f16")   # its rows at the context used
            if wb:
                row.update(window_bits=wb, bits_per_value=row["bits_per_value"] + wb)
        row.update(label=s.label, k=s.k, v=s.v, transform=s.transform, rotation=s.rotation, stock=s.stock,
                   convert_seconds=conv["seconds"])
        store.put(s.label, row)
        _say(f"{s.label}: {row['bits_per_value']:.3f} bits/value, KLD {row['mean_kld']:.4f} "
             f"(p99 {row['p99_kld']:.3f}), same top-1 {100 * row['same_top1']:.1f}%, PPL {row['ppl']:.3f}")
    if store.rows and store.rows.get("f16", {}).get("ppl") != base_ppl:
        any_row = next(r for label, r in store.rows.items() if label != "f16")
        store.put("f16", dict(label="f16", k="f16", v="f16", transform="none", rotation="auto", stock=True,
                              bits_per_value=16.0, mean_kld=0.0, p99_kld=0.0, median_kld=0.0, kld_se=0.0,
                              same_top1=1.0, ppl=base_ppl, ppl_base=base_ppl,
                              n_tokens=any_row["n_tokens"], n_chunks=any_row["n_chunks"], n_ctx=n_ctx,
                              cache_k="f16", cache_v="f16", active="baseline", seconds=0.0,
                              convert_seconds=0.0))
    return store
