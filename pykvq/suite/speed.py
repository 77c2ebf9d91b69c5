"""Speed and memory per cache type: prefill and decode tokens/s at depth, KV bytes, peak RSS.

Measured through the API in one pass per type, the way llama-bench defines
its tests: the cache is filled to each depth d in turn; at d, `tg` single
tokens are decoded and timed (tg<n> @ d) and removed again, then one batch of
`pp` tokens is decoded and timed (pp<n> @ d) and kept, and filling goes on to
the next depth. So one fill to the largest depth gives every figure. Each
type runs in its own process, so its peak RSS (weights touched + KV cache +
compute buffers) is its own. Ratios to f16 and stock q4_0 come from the same
run (see report.py).

"f16" decodes through pykvq's CPU flash attention (fattn.cpp takes f16 decode);
the row "f16 (upstream kernel)" runs the same binary with GGML_KVQ_FA=0, i.e.
what stock llama.cpp does, so both baselines are in every table.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from .store import ResultStore


def _say(msg: str) -> None:
    print(f"[pykvq bench] {msg}", file=sys.stderr, flush=True)


def peak_rss() -> int | None:
    """This process's peak RSS in bytes (VmHWM: per address space, so it starts afresh at exec,
    unlike ru_maxrss, which a spawned child inherits from its parent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(path: str, model_kwargs: dict, depths: list[int], pp: int, tg: int, threads: int | None,
            n_gpu_layers: int, rss_only: bool = False) -> dict:
    """Tokens/s of pp@d and tg@d for every depth d (in this process); with rss_only, only the
    peak RSS of a context of the same size after a warm-up batch (the KV buffer is cleared at
    creation and the compute buffers reserved, so that is already the peak)."""
    import numpy as np

    from ..data import eval_text
    from ..model import Model
    n_ctx = max(depths) + pp + tg + 8
    m = Model(path, n_ctx=n_ctx, flash_attn=True, n_threads=threads, n_gpu_layers=n_gpu_layers, **model_kwargs)
    text, _ = eval_text()
    toks = m.tokenize(text[:400_000], add_special=False)
    need = max(depths) + pp + tg
    toks = np.resize(np.asarray(toks, dtype=np.int32), need).tolist()
    m._decode(toks[:pp], 0)           # warm-up: graph allocation, weights paged in
    m._decode(toks[pp:pp + 1], pp)
    m.reset()
    out, pos = {}, 0
    for d in [] if rss_only else sorted(set(depths)):
        if pos > d:                   # depths closer than pp: drop the overshoot
            m.seq_rm(d, -1)
            pos = d
        while pos < d:
            n = min(m.n_batch, d - pos)
            m._decode(toks[pos:pos + n], pos)
            pos += n
        t0 = time.perf_counter()
        for j in range(tg):
            m._decode(toks[d + j:d + j + 1], d + j)
        out[f"tg{tg} @ d{d}"] = tg / (time.perf_counter() - t0)
        m.seq_rm(d, -1)
        t0 = time.perf_counter()
        m._decode(toks[d:d + pp], d)
        out[f"pp{pp} @ d{d}"] = pp / (time.perf_counter() - t0)
        pos = d + pp
    info = m.kv_cache_info()
    res = {"tokens_per_s": out, "kv_bytes_per_token": info.bytes_per_token,
           "bits_per_value": info.bits_per_value, "n_ctx": m.n_ctx, "cache_k": m.cache_type_k,
           "cache_v": m.cache_type_v, "active": m.transforms(), "peak_rss_bytes": peak_rss()}
    m.close()
    return res


UPSTREAM_F16 = "f16 (upstream kernel)"


def run_child(args: dict, env: dict | None = None) -> dict:
    """measure() in a fresh process; adds its peak RSS (bytes)."""
    cmd = [sys.executable, "-m", "pykvq.suite.speed", json.dumps(args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    stdout = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark process for {args['label']} failed (exit {proc.returncode})")
    res = json.loads(stdout.strip().splitlines()[-1])
    if res.get("peak_rss_bytes") is None:      # no /proc: ru_maxrss (may include the parent's at spawn)
        res["peak_rss_bytes"] = ru.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return res


def run(src: Path, settings: list, out: Path, *, depths: list[int], pp: int = 512, tg: int = 32,
        threads: int | None = None, n_gpu_layers: int = 0, upstream_f16: bool = True) -> ResultStore:
    """Settings (suite.settings.Setting: cache types, and a converted file where the setting has a
    transform, e.g. q4_0@prerope) measured each in its own process."""
    from .converted import for_setting
    from .settings import parse_setting
    threads = threads or os.cpu_count() or 1
    config = {"model": src.name, "model_bytes": src.stat().st_size, "depths": sorted(set(depths)), "pp": pp,
              "tg": tg, "threads": threads, "n_gpu_layers": n_gpu_layers, "machine": platform.machine(),
              "cpu": cpu_name(), "flash_attn": True}
    store = ResultStore(out, config)
    rows = [(s.label, s, None) for s in settings]
    labels = [s.label for s in settings]
    if upstream_f16 and "f16" in labels and not n_gpu_layers:
        rows.insert(labels.index("f16") + 1, (UPSTREAM_F16, parse_setting("f16"), {"GGML_KVQ_FA": "0"}))
    for label, s, env in rows:
        if label in store:
            continue
        path, _ = for_setting(src, s)
        _say(f"{label}: depths {','.join(map(str, config['depths']))}, pp{pp} / tg{tg} ...")
        t0 = time.time()
        res = run_child({"label": label, "path": str(path), "model_kwargs": s.model_kwargs(), "depths": config["depths"],
                         "pp": pp, "tg": tg, "threads": threads, "n_gpu_layers": n_gpu_layers}, env)
        res.update(label=label, k=s.k, v=s.v, transform=s.transform, seconds=round(time.time() - t0, 1))
        store.put(label, res)
        _say(f"{label}: " + ", ".join(f"{c} {t:.1f}" for c, t in res["tokens_per_s"].items())
             + f" t/s; peak RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB ({res['seconds']:.0f} s)")
    return store


def cpu_name() -> str:
    """The CPU model line of /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    print(json.dumps(measure(a["path"], a["model_kwargs"], a["depths"], a["pp"], a["tg"], a["threads"],
                             a["n_gpu_layers"], a.get("rss_only", False))))
