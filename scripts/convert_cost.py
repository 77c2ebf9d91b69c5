#!/usr/bin/env python3
"""What a conversion costs: wall time, peak RSS and disk, cold (an empty calibration cache), per model.

    python scripts/convert_cost.py smollm2-135m gemma3-270m qwen2.5-coder-1.5b [-- --prerope-k ...]

Each conversion runs `python -m convert.to_gguf MODEL -o OUT --prerope-k` (or the flags after --) in a child
process with $PYKVQ_CACHE pointing at a fresh directory (the calibration corpus copied in, so nothing is
fetched), and is set beside one llama-perplexity pass over the same number of calibration tokens (4 x 512).
Prints a markdown table (docs/RESULTS.md, "Converter cost").
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _run(cmd: list[str], env: dict) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of cmd in a fresh child (a wrapper process, so the peak is its own)."""
    wrapper = [sys.executable, "-c", "import resource,subprocess,sys;r=subprocess.run(sys.argv[1:]);"
               "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr);"
               "sys.exit(r.returncode)", *cmd]
    t0 = time.time()
    res = subprocess.run(wrapper, env=env, capture_output=True, text=True)
    dt = time.time() - t0
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    peak = [int(line.split()[1]) for line in res.stderr.splitlines() if line.startswith("PEAK ")][-1]
    return dt, peak / 1024


def main() -> int:
    argv = sys.argv[1:]
    flags = ["--prerope-k"]
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    from convert.calib import canterbury_text
    from pykvq.paths import cache_dir
    from pykvq.registry import fetch
    canterbury_text()                                  # fetched once into the user's cache
    corpus = cache_dir() / "calib" / "canterbury"
    rows = []
    for name in argv or ["smollm2-135m"]:
        src = fetch(name)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            shutil.copytree(corpus, tmp / "cache" / "calib" / "canterbury")
            env = {**os.environ, "PYKVQ_CACHE": str(tmp / "cache")}
            out = tmp / "out.gguf"
            secs, peak = _run([sys.executable, "-m", "convert.to_gguf", str(src), "-o", str(out), "--no-progress",
                               *flags], env)
            left = sum(f.stat().st_size for f in (tmp / "cache").rglob("*") if f.is_file()) - \
                sum(f.stat().st_size for f in corpus.rglob("*") if f.is_file())
            text = tmp / "calib.txt"
            text.write_text("\n\n".join(p.read_text(encoding="latin-1") for p in sorted(corpus.iterdir())))
            ppl_s, ppl_peak = _run([str(ROOT / "build" / "bin" / "llama-perplexity"), "-m", str(src), "-f", str(text),
                                    "-c", "512", "--chunks", "4", "-t", str(os.cpu_count())], env)
            rows.append((name, src.stat().st_size, secs, peak, out.stat().st_size, left, ppl_s, ppl_peak))
    print(f"converter flags: {' '.join(flags)}; {os.cpu_count()} cores; cold calibration cache\n")
    print("| model | GGUF | convert wall | peak RSS | RSS − GGUF | output | left in cache | llama-perplexity 4×512 | "
          "wall / perplexity |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, size, secs, peak, outsz, left, ppl_s, ppl_peak in rows:
        print(f"| {name} | {size / 2**20:.0f} MiB | {secs:.0f} s | {peak:.0f} MiB | {peak - size / 2**20:+.0f} MiB | "
              f"{outsz / 2**20:.0f} MiB | {left / 2**20:.1f} MiB | {ppl_s:.0f} s ({ppl_peak:.0f} MiB) | "
              f"{secs / ppl_s:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
