"""`pykvq results`: quality matrix, speed, passkey, long context and the report, in one command.

Presets size the run: "full" is the documented run (SmolLM2 on 2 CPU cores in
about half an hour, plus ~40 minutes for the long-context part: `--skip long`),
per-model overrides keep bigger models affordable, and "quick" is CI-sized (a
minute or two). Every part resumes from its JSON file.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..data import eval_text
from ..errors import PykvqError
from . import passkey, quality, report, speed
from .settings import matrix, parse_settings

# the README's settings at the context lengths caches are compressed for: (n_ctx, chunks); SmolLM2 was trained
# to 8192 tokens, Qwen2.5-Coder-1.5B to 32768
LONG_SETTINGS = ("q8_0,q8_0/q4_0,q4_0,nuq4,q4_0@prerope,q53_64/q4_0@prerope,nuq4@prerope,auto@prerope+kvbits-3.6,"
                 "q4_0@prerope:sinks-4,q4_0@prerope:sinks-4:win-64,auto@prerope+kvbits-3.6:sinks-4:win-64")
PRESETS = {
    "full": dict(settings="full", n_ctx=512, chunks=16,
                 bench_types="f16,q8_0,q4_0,bfp4_32,nuq4,nuq3o,nuq2o,q4_0@prerope,q4_0@prerope:centred,nuq4@prerope,"
                             "q53_64/q4_0@prerope",
                 depths=[0, 4096, 8192], pp=512, tg=32,
                 passkey_types="f16,q4_0,nuq4,nuq2o,q4_0@prerope,q53_64/q4_0@prerope", lengths=None, trials=2,
                 long_settings=LONG_SETTINGS, long_ctx=[(4096, 3), (8192, 1)]),
    "quick": dict(settings="quick", n_ctx=256, chunks=2, bench_types="f16,q4_0,nuq4,q4_0@prerope", depths=[0, 256], pp=64,
                  tg=8, passkey_types="f16,nuq4", lengths=[256, 512], trials=1, long_settings="q8_0,nuq4",
                  long_ctx=[(1024, 1)]),
}
# per model, on top of "full": a 1.5B model on 2 cores gets the core matrix and shorter runs
MODEL_OVERRIDES = {
    "qwen2.5-coder-1.5b": dict(settings="q8_0,q4_0,q8_0/q4_0,bfp4_32,nuq4,nuq4@fisher,nuq3o@fisher,"
                                        "nuq2o@fisher,q8_0/nuq3o,q4_0@prerope,q4_0@prerope:centred,q4_0@prerope-mean,q4_0@prerope-std,"
                                        "q4_0@prerope:rot-off,q4_0@prerope:stock-scales,q4_0/f16@prerope,nuq4@prerope,"
                                        "q53_64/q4_0@prerope,q8_0/q4_0@prerope,"
                                        "auto@prerope+kvbits-4.5,auto@prerope+kvbits-3.6,auto@prerope+kvbits-2.75",
                               chunks=4, bench_types="f16,q8_0,q4_0,nuq4,nuq3o,q4_0@prerope,q4_0@prerope:centred,q53_64/q4_0@prerope",
                               depths=[0, 4096],
                               passkey_types="f16,q4_0,nuq4,q8_0/q4_0,q8_0/nuq3o,q4_0@prerope,q53_64/q4_0@prerope",
                               lengths=[1024, 2048],
                               trials=2, long_ctx=[(4096, 1), (16384, 1)]),
}


def default_lengths(src: Path) -> list[int]:
    """1024, 2048, ... up to the model's training context."""
    from ..model import Model
    with Model(src, n_ctx=256) as m:
        n = int(m.meta(f"{m.arch}.context_length") or 4096)
    out, L = [], 1024
    while L <= n:
        out.append(L)
        L *= 2
    return out or [n]


def params(model: str, quick: bool) -> dict:
    p = dict(PRESETS["quick" if quick else "full"])
    if not quick:
        p.update(MODEL_OVERRIDES.get(model, {}))
    return p


def run_all(models: list[str], out: Path, docs: Path, *, quick: bool = False, text_file: str | None = None,
            parts: tuple[str, ...] = ("eval", "bench", "passkey", "long"), threads: int | None = None,
            n_gpu_layers: int = 0, progress: bool | None = None, readme: Path | None = None) -> Path:
    from ..registry import MODELS, fetch
    text, text_name = eval_text(text_file)
    for name in models:
        if name not in MODELS:
            raise PykvqError(f"unknown model {name!r} (one of {', '.join(MODELS)})")
        p = params(name, quick)
        src = fetch(name, progress=progress)
        print(f"[pykvq results] {name}: {', '.join(parts)} ({'quick' if quick else 'full'})", file=sys.stderr)
        if "eval" in parts:
            quality.run(src, matrix(p["settings"]), out / f"eval_{name}.json", text=text, text_name=text_name,
                        n_ctx=p["n_ctx"], chunks=p["chunks"], progress=progress)
        if "bench" in parts:
            speed.run(src, parse_settings(p["bench_types"]), out / f"bench_{name}.json", depths=p["depths"],
                      pp=p["pp"], tg=p["tg"], threads=threads, n_gpu_layers=n_gpu_layers)
        if "passkey" in parts:
            passkey.run(src, parse_settings(p["passkey_types"]), out / f"passkey_{name}.json",
                        lengths=p["lengths"] or default_lengths(src), trials=p["trials"])
        if "long" in parts:
            for n_ctx, chunks in p["long_ctx"]:
                quality.run(src, matrix(p["long_settings"]), out / "long" / f"eval_{name}_ctx{n_ctx}_c{chunks}.json",
                            text=text, text_name=text_name, n_ctx=n_ctx, chunks=chunks, progress=progress)
    return report.write(out, docs, readme=readme)
