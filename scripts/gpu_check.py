#!/usr/bin/env python3
"""Every check and measurement of the CUDA backend that needs a GPU, in one command:

    make gpu-check                       # or: python3 scripts/gpu_check.py
    python3 scripts/gpu_check.py --model path/to/model.gguf --steps ops,fallback,kld,bench
    python3 scripts/gpu_check.py --list                  # the steps; --dry-run: the commands, none run

Standard library only (the lent GPU machines have no pykvq venv); model paths default to
pykvq's registry when pykvq imports. On a lent machine with a 10-minute limit per command, run
`--steps build` until it finishes (the build resumes), then the other steps; a model that is larger
than what one call may carry travels in parts (`split -b 60M`, one part per call, `cat` there).
Steps (each writes $OUT or results/gpu/):

  build     cmake -DPYKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=<arch> -DPYKVQ_BACKEND_OPS=ON into
            build-cuda/, targets pykvq and test-backend-ops
  ops       test-backend-ops -b CUDA0 on SET_ROWS / CPY / FLASH_ATTN_EXT for the pykvq types
            (GPU against the CPU backend, NMSE bounds of test-backend-ops) and ROPE (all cases):
            every case must be OK and none "not supported" (supports_op claims them all)
  perf      test-backend-ops perf -o FLASH_ATTN_EXT: decode (one query row) over 256 / 8k / 32k cells in
            SmolLM2's and Qwen2.5-1.5B's head shapes, pykvq's types and the pre-RoPE K cache next to
            f16 / q8_0 / q4_0 (native/tests/kvq-backend-ops.inc), as µs per call and ratios; printed,
            not failed on (--perf-backend CPU runs it on any machine)
  ncu       Nsight Compute on one decode call per case (head 64 and 128, 8k cells): upstream's f16 / q4_0
            vector kernel next to pykvq's nuq4, bfp4_32 and the pre-RoPE q4_0 cache; each kernel's duration,
            registers, occupancy, memory throughput and warp stalls as text (ncu-*.txt) and one table;
            skipped with a note where ncu cannot read the counters (gVisor machines)
  graphs    whether CUDA graphs replay the decode of a pykvq cache: llama-bench tg32 with and without
            GGML_CUDA_DISABLE_GRAPHS=1 for f16 / q4_0 / nuq4 / bfp4_32, and the graph log lines (warmup
            complete / reset, graph reused) of a verbose llama-completion; printed, not failed on
  fallback  llama-completion -ngl 99 -fa on per cache setting: the scheduler's graph split count
            must equal the f16 cache's (a pykvq op left to the CPU adds splits), and the
            generated text is printed
  pykvq     `python -m pykvq generate -ngl 99` per cache setting through the CUDA libllama
            (PYKVQ_LIB=build-cuda/bin); skipped where pykvq's venv (cffi) is missing
  kld       llama-perplexity --kl-divergence against an f16-cache base: the same settings on CPU
            (-ngl 0) and GPU (-ngl 99); mean KLD must agree within max(5%, 2e-3)
  ksort     the model K-sorted by the converter (per-head RoPE factors: CUDA's 2-D rope, fused
            norm+rope included): KLD GPU vs CPU for f16 / q4_0 / nuq4 / bfp4_32 caches
  bench     llama-bench -ngl 99 -fa 1, tg32 at depths 0 / 8192 / 32768 and pp512, each setting
            as a ratio to f16 in the same run; the issue's targets are checked and printed
  prerope   the model converted with --prerope-k (or --prerope-model), fully offloaded: the log
            must show every quantized-K layer pre-RoPE and the graph splits equal f16's (no CPU
            fallback); KLD GPU vs CPU (same bound as kld; q53_64, q42_64 and q32_64 keys and q4_0 in the
            centred domain too; the window's rows in q8_0, also in batches of 1) and, for reference, the post-RoPE cache's (PYKVQ_K_DOMAIN=post) on the GPU; llama-bench tg32 / pp512 at --prerope-depths, pre-RoPE
            as a ratio to post-RoPE of the same type and to f16 (issue 20: decode >= 0.95x post,
            >= 1.0x f16; prefill >= 0.9x f16), printed, not failed on
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = ["build", "ops", "perf", "ncu", "graphs", "fallback", "pykvq", "kld", "ksort", "bench", "prerope"]
# stock baselines first; "K/V" = different K and V types
SETTINGS = ["f16", "q8_0", "q4_0", "bfp8_32", "bfp4_32", "bfp4_64", "nuq4", "nuq3", "nuq2", "nuq3o", "nuq2o",
            "q8_0/nuq4", "q8_0/nuq3o", "f16/nuq3"]
KVQ_RE = "bfp|nuq|q53|q42|q32|prerope|centred|enc=lsq"   # test-backend-ops -p: every case of ours
FOUR_BIT = ["bfp4_32", "bfp4_64", "nuq4"]
THREE_BIT = ["nuq3", "nuq3o"]
# pre-RoPE K caches (the K type's layers go pre-RoPE; an f16 K stays upstream's)
PREROPE_SETTINGS = ["q4_0", "nuq4", "bfp4_32", "q8_0/nuq4", "nuq3", "q53_64/q4_0"]
# the budgets' other key types with the values the default budgets pair them with (3.5 / 3.0 bits): KLD only, not benched
HALVES_SETTINGS = ["q42_64/nuq3_64", "q32_64/nuq2_64"]
WINDOW_Q8_SETTINGS = ["q4_0", "q42_64/nuq3_64"]   # the prerope step's KLD with the window's rows in q8_0 too
UB1_SETTINGS = ["q4_0", "q53_64/q4_0"]   # the prerope step's KLD with -ub 1 too (every query through the decode kernel)
DRY_RUN = False
# the key domain through the tools' environment fallback of --kv-domain (a pre-RoPE file's CUDA-held layers stayed
# post-RoPE unless asked until the H200 of 2026-11-28 found them right at every batch size: the KLD runs still ask)
DOMAIN_ENV = {"pre": {"PYKVQ_K_DOMAIN": "pre"}, "post": {"PYKVQ_K_DOMAIN": "post"},
              "centred": {"PYKVQ_K_DOMAIN": "centred"}}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], env_set: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """cmd with env_set added to the environment; with --dry-run only logged (rc 0, no output)."""
    log(" ".join([f"{k}={v}" for k, v in (env_set or {}).items()] + [str(c) for c in cmd]))
    if DRY_RUN:
        return subprocess.CompletedProcess(cmd, 0, "", "")
    if env_set:
        kw["env"] = dict(kw.get("env") or os.environ, **env_set)
    return subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kw)


def kv(setting: str) -> tuple[str, str]:
    k, _, v = setting.partition("/")
    return k, v or k


def default_model(name: str) -> Path | None:
    try:
        sys.path.insert(0, str(REPO))
        from pykvq.registry import fetch
        return fetch(name)
    except Exception as e:  # noqa: BLE001 - no venv on the GPU machine: the caller names a path
        log(f"no pykvq model registry here ({type(e).__name__}: {e}); pass --model / --bench-model")
        return None


def default_text() -> Path | None:
    try:
        sys.path.insert(0, str(REPO))
        from pykvq.data import wikitext_test
        out = REPO / "results" / "tmp" / "wikitext-2-test.txt"   # git-ignored
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(wikitext_test())
        return out
    except Exception:  # noqa: BLE001
        return None


# ---- steps ---------------------------------------------------------------------------------------

def step_build(a) -> None:
    cfg = ["cmake", "-S", REPO, "-B", a.build, "-DCMAKE_BUILD_TYPE=Release", "-DPYKVQ_CUDA=ON",
           f"-DCMAKE_CUDA_ARCHITECTURES={a.arch}", "-DPYKVQ_BACKEND_OPS=ON"]
    for cmd in (cfg, ["cmake", "--build", a.build, "-j", str(a.jobs), "--target", "pykvq", "test-backend-ops"]):
        r = run(cmd)
        if r.returncode != 0:
            sys.exit(r.stdout[-4000:] + r.stderr[-4000:])


def step_ops(a) -> dict:
    tbo = Path(a.build) / "bin" / "test-backend-ops"
    out = {}
    for op, filt in (("SET_ROWS", KVQ_RE), ("CPY", KVQ_RE), ("FLASH_ATTN_EXT", KVQ_RE), ("ROPE", None)):
        cmd = [tbo, "-b", "CUDA0", "-o", op] + (["-p", filt] if filt else [])
        r = run(cmd, timeout=1800)
        text = ANSI.sub("", r.stdout + r.stderr)   # test-backend-ops colours OK / FAIL
        (Path(a.out) / f"ops-{op}.log").write_text(text)
        ok = len(re.findall(r"\bOK\b", text))
        fail = len(re.findall(r"\bFAIL\b", text))
        unsupported = len(re.findall(r"not supported", text))
        out[op] = {"ok": ok, "fail": fail, "not_supported": unsupported, "rc": r.returncode}
        log(f"{op}: {ok} OK, {fail} FAIL, {unsupported} not supported (rc {r.returncode})")
        if fail:
            print("\n".join(line for line in text.splitlines() if "FAIL" in line)[:6000])
        if op != "ROPE" and (fail or unsupported or ok == 0 or r.returncode != 0):
            a.failures.append(f"test-backend-ops {op}: {out[op]}")
    return out


PERF_RE = re.compile(r"FLASH_ATTN_EXT\(hsk=(\d+),hsv=\d+,nh=(\d+),nr23=\[(\d+),1\],kv=(\d+),nb=1,[^)]*?"
                     r"type_K=(\w+),type_V=(\w+)[^)]*?(,prerope=[\d/]+)?\):.*?([\d.]+) us/run")
PERF_FILTER = r"hsk=(64|128),hsv=(64|128),nh=(3|2),nr23=\[(3|6),1\],kv=\d+,nb=1,"   # test-backend-ops -p: a regex
SET_ROWS_FILTER = r"ne=\[(192|256),8192,1,1\],nr23=\[1,1\],r=1,"
SET_ROWS_RE = re.compile(r"SET_ROWS\(type_src=f32,type_dst=(\w+),type_idx=i64,ne=\[(\d+),8192,1,1\],nr23=\[1,1\],r=1,"
                         r"v=0(,enc=lsq)?\):.*?([\d.]+) us/run")
PERF_SHAPES = {(64, 3, 3): "head 64, 3 KV heads x 3 (SmolLM2)", (128, 2, 6): "head 128, 2 KV heads x 6 (Qwen2.5-1.5B)"}


def perf_table(text: str) -> tuple[list[dict], str]:
    """The pykvq decode cases of a test-backend-ops perf log: rows and a markdown table (µs per call; the
    ratio is stock q4_0's time / this one's, so > 1 is faster than q4_0, and the same against f16)."""
    rows = []
    for m in PERF_RE.finditer(text):
        hs, nh, nr, kv = map(int, m.group(1, 2, 3, 4))
        if (hs, nh, nr) in PERF_SHAPES:
            rows.append({"hs": hs, "nh": nh, "nr": nr, "kv": kv, "k": m.group(5), "v": m.group(6),
                         "prerope": bool(m.group(7)), "us": float(m.group(8))})
    kvs = sorted({r["kv"] for r in rows})
    us = {(r["hs"], r["k"], r["v"], r["prerope"], r["kv"]): r["us"] for r in rows}
    lines = []
    for (hs, nh, nr), name in PERF_SHAPES.items():
        lines += [f"\n{name}: µs per FLASH_ATTN_EXT call (×q4_0, ×f16: their time / this one's)\n",
                  "| K / V | " + " | ".join(f"{kv} cells" for kv in kvs) + " |", "|---" * (1 + len(kvs)) + "|"]
        seen = []
        for r in rows:
            key = (r["k"], r["v"], r["prerope"])
            if r["hs"] != hs or key in seen:
                continue
            seen.append(key)
            cells = []
            for kv in kvs:
                t, q4, f16 = (us.get((hs, *key, kv)), us.get((hs, "q4_0", "q4_0", False, kv)),
                              us.get((hs, "f16", "f16", False, kv)))
                cells.append(f"{t:.1f} ({q4 / t:.2f}×, {f16 / t:.2f}×)" if t and q4 and f16 else "–")
            lines.append(f"| {key[0]} / {key[1]}{' pre-RoPE' if key[2] else ''} | " + " | ".join(cells) + " |")
    return rows, "\n".join(lines)


def step_perf(a) -> dict:
    tbo = Path(a.build) / "bin" / "test-backend-ops"
    r = run([tbo, "perf", "-o", "FLASH_ATTN_EXT", "-b", a.perf_backend, "-p", PERF_FILTER], timeout=1800)
    text = ANSI.sub("", r.stdout + r.stderr)
    if DRY_RUN:
        return {}
    (Path(a.out) / "perf-FLASH_ATTN_EXT.log").write_text(text)
    rows, table = perf_table(text)
    print(table)
    (Path(a.out) / "perf-fattn.md").write_text(f"test-backend-ops perf, backend {a.perf_backend}\n{table}\n")
    if not rows:
        a.failures.append(f"test-backend-ops perf: no pykvq decode case ran (rc {r.returncode})")
    # one decode step's cache write (SET_ROWS of one row into 8k cells), each type's encoder next to f16 / q4_0
    r = run([tbo, "perf", "-o", "SET_ROWS", "-b", a.perf_backend, "-p", SET_ROWS_FILTER], timeout=600)
    text = ANSI.sub("", r.stdout + r.stderr)
    (Path(a.out) / "perf-SET_ROWS.log").write_text(text)
    sr = [{"n_embd": int(m.group(2)), "type": m.group(1) + (",lsq" if m.group(3) else ""), "us": float(m.group(4))}
          for m in SET_ROWS_RE.finditer(text)]
    lines = ["| type | " + " | ".join(f"{n} values: µs per call" for n in sorted({x['n_embd'] for x in sr})) + " |",
             "|---|---|---|"]
    for t in dict.fromkeys(x["type"] for x in sr):
        lines.append(f"| {t} | " + " | ".join(f"{x['us']:.2f}" for x in sr if x["type"] == t) + " |")
    print("\n".join(lines))
    (Path(a.out) / "perf-set-rows.md").write_text("\n".join(lines) + "\n")
    return {"backend": a.perf_backend, "rows": rows, "set_rows": sr}


# one decode call per case: (name, head size, K/V, pre-RoPE); test-backend-ops -p is a regex on the case's vars()
NCU_CASES = [(f"d{hs}-{kv_.replace('/', '-')}{'-pre' if pre else ''}", hs, kv_, pre)
             for hs, kinds in ((64, (("f16", False), ("q4_0", False), ("q4_0", True), ("nuq4", False))),
                               (128, (("q4_0", False), ("nuq4", False))))
             for kv_, pre in kinds]
NCU_METRICS = {   # ncu's details page: the rows the table keeps
    "Duration": "duration", "Registers Per Thread": "regs", "Block Size": "block", "Grid Size": "grid",
    "Achieved Occupancy": "occ %", "Theoretical Occupancy": "theo occ %", "Memory Throughput": "mem %",
    "DRAM Throughput": "dram %", "Compute (SM) Throughput": "sm %", "Dynamic Shared Memory Per Block": "dyn smem",
    "Static Shared Memory Per Block": "smem", "Warp Cycles Per Issued Instruction": "cyc/issue",
}


def _ncu_filter(hs: int, kv_: str, pre: bool, cells: int = 8192) -> str:
    k, v = kv(kv_)
    nh, nr = (3, 3) if hs == 64 else (2, 6)
    return (rf"hsk={hs},hsv={hs},nh={nh},nr23=\[{nr},1\],kv={cells},nb=1,.*type_K={k},type_V={v},.*"
            + (",prerope=" if pre else r"n_kv_max=[-0-9]+$"))


def _ncu_kernels(text: str) -> list[dict]:
    """Per profiled kernel of ncu's details page: its name and the NCU_METRICS rows (value with unit)."""
    out, cur = [], None
    for line in text.splitlines():
        m = re.match(r"\s{2}(\S.*?)\s+\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
        if m:
            cur = {"kernel": m.group(1)[:90]}
            out.append(cur)
            continue
        m = re.match(r"\s+(.+?)\s{2,}(?:(\S+)\s+)?(\S+)\s*$", line)
        if cur is not None and m and m.group(1).strip() in NCU_METRICS:
            unit, val = m.group(2) or "", m.group(3)
            cur[NCU_METRICS[m.group(1).strip()]] = val if unit in ("%", "") else f"{val} {unit}"
    return out


def step_ncu(a) -> dict:
    """Nsight Compute: what one decode call of ours spends next to upstream's vector kernel (issue 57)."""
    tbo = Path(a.build) / "bin" / "test-backend-ops"
    out, lines = {}, []
    cols = list(NCU_METRICS.values())
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") +
                                                 glob.glob("/usr/local/cuda*/bin/ncu"))), None)
    if ncu is None and not DRY_RUN:
        log("ncu step skipped: no ncu on this machine")
        return {"skipped": "no ncu"}
    cases = [(name, "FLASH_ATTN_EXT", _ncu_filter(hs, kv_, pre)) for name, hs, kv_, pre in NCU_CASES]
    cases += [(f"set-rows-{t}", "SET_ROWS", rf"type_dst={t},type_idx=i64,ne=\[192,8192,1,1\],nr23=\[1,1\],r=1,v=0$")
              for t in ("f16", "q4_0", "nuq4", "bfp4_32")]
    for name, op, filt in cases:
        # skip the warm-up launches; the kernels of one call (the vector kernel, the split merge, any conversion)
        r = run([ncu or "ncu", "--clock-control", "none", "--launch-skip", "20", "--launch-count", "3",
                 "--section", "SpeedOfLight", "--section", "LaunchStats", "--section", "Occupancy",
                 "--section", "WarpStateStats", "--section", "MemoryWorkloadAnalysis", "--section", "SchedulerStats",
                 "--section", "InstructionStats", tbo, "perf", "-o", op, "-b", "CUDA0", "-p", filt], timeout=60)
        text = ANSI.sub("", r.stdout + r.stderr)
        if DRY_RUN:
            continue
        (Path(a.out) / f"ncu-{name}.txt").write_text(text)
        ks = _ncu_kernels(text)
        out[name] = {"rc": r.returncode, "kernels": ks}
        if not ks:
            log(f"ncu {name}: no kernel profiled (rc {r.returncode}): {text.strip()[-300:]!r}")
            if "LibraryNotLoaded" in text or "ERR_NVGPUCTRPERM" in text or r.returncode == 127:
                log("ncu cannot read the counters on this machine; step skipped")
                return {"skipped": text.strip()[-300:], **out}
        for k_ in ks:
            lines.append(f"| {name} | {k_['kernel']} | " + " | ".join(str(k_.get(c, "–")) for c in cols) + " |")
    table = "\n".join(["| case | kernel | " + " | ".join(cols) + " |", "|---" * (2 + len(cols)) + "|", *lines])
    print(table)
    if not DRY_RUN:
        (Path(a.out) / "ncu.md").write_text(table + "\n")
    return out


GRAPH_SETTINGS = ["f16", "q4_0", "nuq4", "bfp4_32"]
GRAPH_PRE_SETTINGS = ["q4_0", "nuq4"]   # and the pre-RoPE file's (--prerope-model), whose decode ran at half the speed


def step_graphs(a) -> dict:
    """Decode's per-token cost with and without CUDA graphs: a cache type whose decode gains nothing from them
    (or whose graph keeps resetting) is launched kernel by kernel on every token."""
    bench, comp = Path(a.build) / "bin" / "llama-bench", Path(a.build) / "bin" / "llama-completion"
    out: dict = {}
    # (name, model, cache setting, environment): the model's caches; a pre-RoPE file's, with its window and without
    cases = [(s, a.model, s, {}) for s in GRAPH_SETTINGS]
    if a.prerope_model:
        no_win = {"PYKVQ_KV_WINDOW": "0", "PYKVQ_KV_SINKS": "0"}
        cases += [(f"pre:{s}", a.prerope_model, s, {}) for s in GRAPH_PRE_SETTINGS]
        cases += [(f"pre:{s} no window", a.prerope_model, s, no_win) for s in GRAPH_PRE_SETTINGS[:1]]
        cases += [(f"post:{s}", a.prerope_model, s, DOMAIN_ENV["post"]) for s in GRAPH_PRE_SETTINGS[:1]]
    for s, model, setting, env in cases:
        k, v = kv(setting)
        row = {}
        for tag, env_set in (("graphs", env), ("no_graphs", dict(env, GGML_CUDA_DISABLE_GRAPHS="1"))):
            r = run([bench, "-m", model, "-ngl", "99", "-fa", "1", "-ctk", k, "-ctv", v, "-p", "0", "-n", "32",
                     "-r", "2", "-o", "json"], env_set=env_set or None, timeout=600)
            t = json.loads(r.stdout or "[]") if r.returncode == 0 and not DRY_RUN else []
            row[tag] = t[0]["avg_ts"] if t else None
        r = run([comp, "-m", model, "-ngl", "99", "-fa", "on", "-ctk", k, "-ctv", v, "-c", "512", "-n", "16",
                 "--temp", "0", "-no-cnv", "-v", "-p", "The capital of France is"], env_set=env or None, timeout=600)
        text = r.stdout + r.stderr
        row["log"] = {key: len(re.findall(pat, text)) for key, pat in
                      (("warmup_complete", r"CUDA graph warmup complete"), ("warmup_reset", r"CUDA graph warmup reset"),
                       ("reused", r"CUDA Graph id \d+ reused"), ("update_failed", r"CUDA graph update failed"))}
        nodes = re.findall(r"graph: nodes = (\d+), splits = (\d+)", text)   # what a decode step launches
        row["nodes_splits"] = nodes[-1] if nodes else None
        m = re.search(r"pre-RoPE key cache in (\d+) of (\d+) layers", text)
        row["prerope_layers"] = m.groups() if m else None
        out[s] = row
        g, n = row["graphs"], row["no_graphs"]
        log(f"graphs {s}: tg32 {g} t/s with graphs, {n} without" + (f" ({g / n:.2f}×)" if g and n else "") +
            f"; log {row['log']}; graph nodes, splits {row['nodes_splits']}; pre-RoPE layers {row['prerope_layers']}")
    return out


def _error(stderr: str) -> str:
    """The lines that say why a tool stopped: the abort or error message, not the backtrace."""
    keep = [line for line in stderr.splitlines() if re.search(r"error|abort|assert|failed", line, re.I)]
    return "\n".join(keep[-8:]) or stderr[-1500:]


def _splits(text: str) -> int | None:
    m = re.findall(r"graph: nodes = \d+, splits = (\d+)", text)
    return int(m[-1]) if m else None


def step_fallback(a) -> dict:
    exe = Path(a.build) / "bin" / "llama-completion"
    out = {}
    for s in a.settings:
        k, v = kv(s)
        r = run([exe, "-m", a.model, "-ngl", "99", "-fa", "on", "-ctk", k, "-ctv", v, "-c", "2048", "-n", "32",
                 "--temp", "0", "-no-cnv", "-v", "-p", "The capital of France is"], timeout=600)
        text = r.stdout + r.stderr
        out[s] = {"splits": _splits(text), "rc": r.returncode, "text": r.stdout[-300:]}
        if r.returncode != 0:
            out[s]["error"] = _error(r.stderr)
        log(f"{s}: graph splits {out[s]['splits']}, rc {r.returncode}: {r.stdout.strip()[-120:]!r}")
    base = out["f16"]["splits"]
    for s, o in out.items():
        if o["rc"] != 0 or o["splits"] is None or o["splits"] != base:
            a.failures.append(f"fallback {s}: {o['splits']} graph splits vs f16 {base} (rc {o['rc']})")
    return out


def step_pykvq(a) -> dict:
    try:
        import cffi  # noqa: F401
    except ImportError:
        log("pykvq step skipped: no cffi here (run it where `make setup` has made the venv)")
        return {"skipped": "no cffi"}
    env = dict(os.environ, PYKVQ_LIB=str(Path(a.build) / "bin"))
    out = {}
    for s in ("f16", "bfp4_32", "nuq4", "q8_0/nuq3o"):
        k, v = kv(s)
        r = run([sys.executable, "-m", "pykvq", "generate", "-m", a.model, "-ngl", "99", "-fa", "on",
                 "-ctk", k, "-ctv", v, "-n", "32", "The capital of France is"], env=env, cwd=REPO, timeout=600)
        out[s] = {"rc": r.returncode, "text": r.stdout.strip()[-300:]}
        log(f"pykvq {s}: rc {r.returncode}: {r.stdout.strip()[-120:]!r}")
        if r.returncode != 0 or not r.stdout.strip():
            a.failures.append(f"pykvq generate {s}: rc {r.returncode}: {r.stderr[-800:]}")
    return out


def _kld(text: str) -> float | None:
    m = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", text)
    return float(m.group(1)) if m else None


def _kld_compare(a, model, settings: list[str], tag: str, prerope: bool = False, domain: str | None = None,
                 base_tag: str | None = None, window_type: str | None = None) -> dict:
    """KLD against an f16-cache CPU base, each setting on CPU and on GPU; they must agree.
    prerope: a pre-RoPE file, its keys forced pre-RoPE (PYKVQ_K_DOMAIN=pre); the GPU runs once more with batches of 32
    and of 1 (wrong on the H200 of 2026-11-27, right on 2026-11-28) and the bisection's variants, and once with its
    post-RoPE cache (PYKVQ_K_DOMAIN=post), reported.
    domain: another key domain for both runs (centred); base_tag: reuse that comparison's base logits.
    window_type: the exact window's rows in that type on both (PYKVQ_KV_WINDOW_TYPE), the GPU in batches of 1 too,
    and each run's log must say the rows are held so."""
    exe = Path(a.build) / "bin" / "llama-perplexity"
    base = Path(a.out) / f"kld-base-{base_tag or tag}.bin"
    common = ["-m", model, "-f", a.text, "-c", "512", "--chunks", str(a.chunks), "-fa", "on"]
    if base_tag is None:
        r = run([exe, *common, "-ngl", "0", "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", base], timeout=1800)
        if r.returncode != 0:
            a.failures.append(f"kld {tag}: base run failed: " + r.stderr[-2000:])
            return {}
    # (name, -ngl, extra arguments, environment, settings it runs for or None: all); every GPU run but the post-RoPE
    # one must match the CPU's
    env = DOMAIN_ENV["pre"] if prerope else DOMAIN_ENV[domain] if domain else None
    if window_type:
        env = dict(env or {}, PYKVQ_KV_WINDOW_TYPE=window_type)
    runs = [("cpu", "0", [], env, None), ("gpu", "99", [], env, None)]
    if window_type:
        runs.append(("gpu_ub1", "99", ["-b", "512", "-ub", "1"], env, None))
    if prerope:
        ub32, ub1, first = ["-b", "512", "-ub", "32"], ["-b", "512", "-ub", "1"], UB1_SETTINGS[:1]
        runs += [("gpu_ub32", "99", ub32, env, None),
                 # the bisection of a wrong ub32: the CPU at the same ubatches; llama.cpp's graph reuse off
                 ("cpu_ub32", "0", ub32, env, first),
                 ("gpu_ub32_noreuse", "99", ub32, dict(env, LLAMA_GRAPH_REUSE_DISABLE="1"), first),
                 # upstream's programmatic dependent launches (Hopper) off; every launch synchronous
                 ("gpu_ub32_nopdl", "99", ub32, dict(env, GGML_CUDA_PDL="0"), first),
                 ("gpu_nopdl", "99", [], dict(env, GGML_CUDA_PDL="0"), first),
                 ("gpu_ub32_blocking", "99", ub32, dict(env, CUDA_LAUNCH_BLOCKING="1"), first),
                 # one token per ubatch (the decode kernel, ~8 s a run), with and without CUDA graphs
                 ("gpu_ub1", "99", ub1, env, UB1_SETTINGS),
                 ("gpu_ub1_nograph", "99", ub1, dict(env, GGML_CUDA_DISABLE_GRAPHS="1"), first),
                 ("gpu_post", "99", [], DOMAIN_ENV["post"], None)]
    checked = [dev for dev, *_ in runs if dev not in ("cpu", "gpu_post")]
    out = {}
    for s in settings:
        k, v = kv(s)
        row = {}
        for dev, ngl, extra, env_set, only in runs:
            if only is not None and s not in only:
                continue
            r = run([exe, *common, "-ngl", ngl, "-ctk", k, "-ctv", v, *extra, "--kl-divergence-base", base,
                     "--kl-divergence"], env_set=env_set, timeout=1800)
            row[dev] = _kld(r.stdout + r.stderr)
            m = re.search(r"up to each query kept in (\S+(?: / \S+)?) beside", r.stderr)
            if window_type and not DRY_RUN and (m is None or m.group(1) != window_type):
                a.failures.append(f"kld {tag} {s} {dev}: window rows {m.group(1) if m else None}, not {window_type}")
        out[s] = row
        log(f"{tag} {s}: KLD " + " ".join(f"{dev} {x}" for dev, x in row.items()))
        c = row["cpu"]
        for dev in checked:
            if dev not in row:
                continue
            g = row[dev]
            if c is None or g is None or abs(c - g) > max(0.05*c, 2e-3):
                a.failures.append(f"kld {tag} {s}: cpu {c} vs {dev} {g}")
    return out


def step_kld(a) -> dict:
    return _kld_compare(a, a.model, [s for s in a.settings if s != "f16"], "model")


def step_ksort(a) -> dict:
    """A K-sorted conversion of the model (per-head RoPE factors: the 2-D rope path on the GPU,
    fused norm+rope included): f16 on the GPU must match the CPU (KLD ~ 0), and so must the
    quantized caches."""
    out = Path(a.out) / "ksorted.gguf"
    r = run([sys.executable, REPO / "convert" / "to_gguf.py", a.model, "-o", out, "--ksort"], cwd=REPO, timeout=1800)
    if r.returncode != 0:
        log("ksort step skipped: the converter did not run here (needs pykvq's venv): " + r.stderr.strip()[-300:])
        return {"skipped": r.stderr.strip()[-300:]}
    return _kld_compare(a, out, ["f16", "q4_0", "nuq4", "bfp4_32"], "ksorted")


def step_bench(a) -> dict:
    exe = Path(a.build) / "bin" / "llama-bench"
    rows = []
    for s in a.settings:
        k, v = kv(s)
        r = run([exe, "-m", a.bench_model, "-ngl", "99", "-fa", "1", "-ctk", k, "-ctv", v, "-p", "512", "-n", "32",
                 "-d", a.depths, "-r", str(a.reps), "-o", "json"], timeout=3600)
        if r.returncode != 0:
            a.failures.append(f"bench {s}: rc {r.returncode}: {r.stderr[-1000:]}")
            continue
        for t in json.loads(r.stdout or "[]"):
            rows.append({"setting": s, "n_prompt": t["n_prompt"], "n_gen": t["n_gen"], "depth": t.get("n_depth", 0),
                         "tps": t["avg_ts"], "std": t["stddev_ts"]})
    # ratios to f16 in the same run
    f16 = {(r["n_prompt"], r["n_gen"], r["depth"]): r["tps"] for r in rows if r["setting"] == "f16"}
    for r in rows:
        r["ratio"] = r["tps"] / f16[(r["n_prompt"], r["n_gen"], r["depth"])] if (r["n_prompt"], r["n_gen"], r["depth"]) in f16 else None
    lines = ["| cache | " + " | ".join(f"tg32 @{d}" for d in a.depths.split(",")) + " | " +
             " | ".join(f"pp512 @{d}" for d in a.depths.split(",")) + " |",
             "|---" * (1 + 2*len(a.depths.split(","))) + "|"]
    for s in a.settings:
        cells = []
        for kind in ("tg", "pp"):
            for d in a.depths.split(","):
                m = [r for r in rows if r["setting"] == s and r["depth"] == int(d) and ((r["n_gen"] > 0) == (kind == "tg"))]
                cells.append(f"{m[0]['tps']:.1f} ({m[0]['ratio']:.2f}×)" if m and m[0]["ratio"] else "–")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    (Path(a.out) / "bench.md").write_text(table + "\n")
    # the targets, at the deepest depth
    deep = int(a.depths.split(",")[-1])
    tg = {r["setting"]: r for r in rows if r["n_gen"] > 0 and r["depth"] == deep}
    if "f16" in tg and "q4_0" in tg:
        for s in FOUR_BIT:
            if s in tg:
                log(f"target @{deep}: {s} {tg[s]['ratio']:.2f}× f16 (≥ 1.0), {tg[s]['tps']/tg['q4_0']['tps']:.2f}× q4_0 (≥ 1.0)")
        for s in THREE_BIT:
            if s in tg:
                log(f"target @{deep}: {s} {tg[s]['ratio']:.2f}× f16 (≥ 1.1)")
    return {"rows": rows}


def prerope_model(a) -> Path | None:
    if a.prerope_model:
        return Path(a.prerope_model)
    out = Path(a.out) / "prerope.gguf"
    # f16 window rows, as CUDA's kernels hold them: the CPU and GPU runs read the same window
    r = run([sys.executable, "-m", "convert.to_gguf", a.model, "-o", out, "--prerope-k", "--kv-window-type", "f16"],
            cwd=REPO, timeout=1800)
    if r.returncode != 0:
        log("prerope step skipped: the converter did not run here (needs pykvq's venv; or pass --prerope-model): "
            + r.stderr.strip()[-300:])
        return None
    return out


def step_prerope(a) -> dict:
    """Issue 20 on CUDA: the pre-RoPE key cache fully offloaded (decode kernel and prefill K conversion)."""
    model = prerope_model(a)
    if model is None:
        return {"skipped": "no pre-RoPE model"}
    out: dict = {"model": str(model), "run": {}}
    exe = Path(a.build) / "bin" / "llama-completion"
    for s in ["f16"] + PREROPE_SETTINGS:
        k, v = kv(s)
        r = run([exe, "-m", model, "-ngl", "99", "-fa", "on", "-ctk", k, "-ctv", v, "-c", "2048", "-n", "32",
                 "--temp", "0", "-no-cnv", "-v", "-p", "The capital of France is"], timeout=600)   # the default domain
        text = r.stdout + r.stderr
        m = re.search(r"pre-RoPE key cache in (\d+) of (\d+) layers", text)
        o = {"rc": r.returncode, "splits": _splits(text), "prerope_layers": m.groups() if m else None,
             "text": r.stdout[-300:]}
        if r.returncode != 0:
            o["error"] = _error(r.stderr)
        out["run"][s] = o
        log(f"prerope {s}: rc {o['rc']}, graph splits {o['splits']}, pre-RoPE layers {o['prerope_layers']}: "
            f"{r.stdout.strip()[-120:]!r}")
    if not DRY_RUN:
        base = out["run"]["f16"]["splits"]
        for s in PREROPE_SETTINGS:
            o = out["run"][s]
            if o["rc"] != 0 or o["splits"] is None or o["splits"] != base:
                a.failures.append(f"prerope {s}: {o['splits']} graph splits vs f16 {base} (rc {o['rc']})")
            if not o["prerope_layers"] or o["prerope_layers"][0] != o["prerope_layers"][1]:
                a.failures.append(f"prerope {s}: pre-RoPE layers {o['prerope_layers']} (expected all)")
    out["kld"] = _kld_compare(a, model, PREROPE_SETTINGS, "prerope", prerope=True)
    out["kld_halves"] = _kld_compare(a, model, HALVES_SETTINGS, "halves", prerope=True, base_tag="prerope")
    # the centred domain (CUDA kernels since 2026-11-28, emulated only before this): q4_0 on CPU and GPU
    out["kld_centred"] = _kld_compare(a, model, ["q4_0"], "centred", domain="centred", base_tag="prerope")
    # the window's rows in q8_0 (the file's are f16): CUDA reads them since 2026-12-01 (emulated only before this)
    out["kld_window_q8"] = _kld_compare(a, model, WINDOW_Q8_SETTINGS, "window_q8", domain="pre", base_tag="prerope",
                                        window_type="q8_0")
    out["bench"] = _prerope_bench(a, model)
    return out


def _prerope_bench(a, model: Path) -> list[dict]:
    """llama-bench on the pre-RoPE file: f16, then each setting with pre-RoPE keys (forced: CUDA-held layers stay
    post-RoPE by default) and post-RoPE."""
    exe = Path(a.build) / "bin" / "llama-bench"
    depths = a.prerope_depths.split(",")
    rows = []
    runs = [("f16", "f16")] + [(s, d) for s in PREROPE_SETTINGS for d in ("pre", "post")]
    for s, dom in runs:
        k, v = kv(s)
        r = run([exe, "-m", model, "-ngl", "99", "-fa", "1", "-ctk", k, "-ctv", v, "-p", "512", "-n", "32",
                 "-d", a.prerope_depths, "-r", str(a.reps), "-o", "json"], env_set=DOMAIN_ENV.get(dom), timeout=3600)
        if r.returncode != 0:
            a.failures.append(f"prerope bench {s} {dom}: rc {r.returncode}: {r.stderr[-1000:]}")
            continue
        for t in json.loads(r.stdout or "[]"):
            rows.append({"setting": s, "domain": dom, "kind": "tg" if t["n_gen"] > 0 else "pp",
                         "depth": t.get("n_depth", 0), "tps": t["avg_ts"], "std": t["stddev_ts"]})
    tps = {(r["setting"], r["domain"], r["kind"], r["depth"]): r["tps"] for r in rows}
    lines = ["| cache (pre-RoPE) | " + " | ".join(f"{kind}{'32' if kind == 'tg' else '512'} @{d}: t/s, ×post, ×f16"
                                                 for kind in ("tg", "pp") for d in depths) + " |",
             "|---" * (1 + 2*len(depths)) + "|"]
    for s in PREROPE_SETTINGS:
        cells = []
        for kind in ("tg", "pp"):
            for d in depths:
                pre, post, f16 = (tps.get((s, "pre", kind, int(d))), tps.get((s, "post", kind, int(d))),
                                  tps.get(("f16", "f16", kind, int(d))))
                cells.append(f"{pre:.1f}, {pre/post:.2f}×, {pre/f16:.2f}×" if pre and post and f16 else "–")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if not DRY_RUN:
        (Path(a.out) / "bench-prerope.md").write_text(table + "\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--build", default=str(REPO / "build-cuda"), help="CUDA build directory")
    ap.add_argument("--arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--model", help="GGUF for fallback and KLD (default: SmolLM2-135M from pykvq's registry)")
    ap.add_argument("--bench-model", help="GGUF for the benchmark (default: Qwen2.5-Coder-1.5B)")
    ap.add_argument("--text", help="evaluation text (default: WikiText-2 test via pykvq)")
    ap.add_argument("--chunks", type=int, default=8, help="512-token chunks for KLD")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="cache settings (K or K/V) of the fallback, kld and bench steps (default: all; f16 first)")
    ap.add_argument("--depths", default="0,8192,32768", help="llama-bench -d")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--perf-backend", default="CUDA0", help="test-backend-ops -b of the perf step (CPU: any machine)")
    ap.add_argument("--prerope-model", help="a --prerope-k conversion of --model (default: converted here into --out)")
    ap.add_argument("--prerope-depths", default="0,4096,8192", help="llama-bench -d of the prerope step")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results" / "gpu"), help="where results go")
    ap.add_argument("--list", action="store_true", help="print the steps and exit")
    ap.add_argument("--dry-run", action="store_true", help="log each step's commands without running any")
    a = ap.parse_args()
    a.failures = []
    a.settings = a.settings.split(",")
    if a.list:
        print("\n".join(line for line in __doc__.split("Steps", 1)[1].splitlines()[1:] if line.strip()))
        return
    global DRY_RUN
    DRY_RUN = a.dry_run
    Path(a.out).mkdir(parents=True, exist_ok=True)
    steps = [s for s in a.steps.split(",") if s]
    bad = set(steps) - set(STEPS)
    if bad:
        ap.error(f"unknown step(s) {sorted(bad)}; choose from {STEPS}")
    if {"fallback", "pykvq", "kld", "ksort", "prerope", "graphs"} & set(steps):
        a.model = a.model or default_model("smollm2-135m")
        if not a.model:
            ap.error("--model is needed for fallback / kld")
    if {"kld", "ksort", "prerope"} & set(steps):
        a.text = a.text or default_text()
        if not a.text:
            ap.error("--text is needed for kld")
    if "bench" in steps:
        a.bench_model = a.bench_model or default_model("qwen2.5-coder-1.5b")
        if not a.bench_model:
            ap.error("--bench-model is needed for bench")
    try:
        device = run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).stdout.strip()
    except FileNotFoundError:
        device = "no nvidia-smi: no NVIDIA GPU here"
    log(f"device: {device}" + (" (dry run: commands are logged, none run)" if DRY_RUN else ""))
    report = {"device": device}
    for s in steps:
        report[s] = globals()[f"step_{s}"](a) or {}
    if DRY_RUN:
        log(f"dry run of {','.join(steps)} done (nothing ran, no results written)")
        return
    report["failures"] = a.failures
    (Path(a.out) / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    log(f"wrote {Path(a.out) / 'gpu_check.json'}")
    if a.failures:
        print("FAILED:\n  " + "\n  ".join(a.failures))
        sys.exit(1)
    log("all GPU checks passed")


if __name__ == "__main__":
    main()
