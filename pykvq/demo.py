"""`pykvq demo` (`make demo`): what a pykvq cache buys on the default model, measured on the spot.

It answers one question with an f16 cache and with pykvq's setting, then prints a table for
f16, stock q4_0 (llama.cpp's own type with its default online Hadamard rotation) and pykvq's
setting: KV-cache size at the demo context and the mean KL divergence of the next-token
distribution against the f16 cache on a few chunks of WikiText-2 test. Nothing is hard-coded:
every number is measured by this run.

pykvq's setting for SmolLM2-135M is `q53_64/q4_0@prerope` (the suite's notation, pykvq/suite/settings.py):
keys cached before RoPE, centred and scaled per channel, turned by the online Hadamard and stored as q53_64
(per 64 channels the 32 the loss reads most in 5 bits, the rest in 3); values in stock q4_0; every block's
scale chosen by least squares. It is the lowest KLD measured at 4.5 bits/value for this model
(docs/prerope.md, through the suite over 16 chunks: 0.0177, against 0.0223 for q4_0 keys, 0.0230 for nuq4
with Fisher codebooks and 0.0443 for stock q4_0). It needs a converted GGUF (convert/to_gguf.py
--prerope-k --cache-type-k q53_64 --cache-type-v q4_0): the first run converts once (under a minute on
2 cores: HF checkpoint, calibration text, Fisher statistics, the pair layout) into the cache the suite
uses too ($PYKVQ_CACHE/converted, pykvq.suite.converted), and later runs reuse it. q53_64 has CPU kernels
only; `q4_0@prerope` is the setting that also runs on CUDA. The best setting that needs no conversion,
plain nuq4 (0.0419 in docs/RESULTS.md), is hardly better than q4_0.

Pure parts (rows, table, the one-line explanation) are separate from the I/O (conversion,
models, printing) so they can be tested on their own.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .metrics import KLDResult
from .keys import Keys
from .model import KVCacheInfo, Model, kld_sweep
from .suite.settings import Setting, parse_setting

DEMO_MODEL = "smollm2-135m"
DEMO_PROMPT = "What is the capital of France? Answer in one sentence."
DEMO_CTX = 4096             # context the KV sizes are given for (and the answers are generated in)
EVAL_CTX = 512              # tokens per KLD chunk
EVAL_CHUNKS = 4             # chunks of WikiText-2 test for the KLD
MAX_TOKENS = 48

# (row label, suite setting): the baseline, the stock peer, pykvq's setting for the default model
PYKVQ_SETTING = "q53_64/q4_0@prerope"
ROWS = (("f16", "f16"), ("q4_0 (stock llama.cpp)", "q4_0"), (f"{PYKVQ_SETTING} (pykvq)", PYKVQ_SETTING))


@dataclass(frozen=True)
class Row:
    """One line of the table: a setting's measured cache size and quality."""
    label: str
    cache_k: str
    cache_v: str
    kv_mib: float           # K + V bytes at n_ctx tokens, MiB
    n_ctx: int
    bits_per_value: float
    ratio_vs_f16: float
    mean_kld: float
    kld_se: float           # standard error of the mean KLD over scored tokens
    same_top1: float
    n_tokens: int           # scored tokens behind the KLD


def make_row(label: str, info: KVCacheInfo, kld: KLDResult) -> Row:
    """A table row from a context's cache geometry and its KLD against the f16 cache."""
    n = len(kld.kld)
    se = float(kld.kld.std(ddof=1) / n ** 0.5) if n > 1 else 0.0
    return Row(label=label, cache_k=info.type_summary("k"), cache_v=info.type_summary("v"),
               kv_mib=info.total_bytes / 2**20, n_ctx=info.n_ctx, bits_per_value=info.bits_per_value,
               ratio_vs_f16=info.ratio_vs_f16, mean_kld=kld.mean_kld, kld_se=se,
               same_top1=kld.same_top1, n_tokens=kld.n_tokens)


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned plain-text table (pure)."""
    if not rows:
        return ""
    head = ["setting", "K / V cache", f"KV MiB @ {rows[0].n_ctx}", "bits/value", "vs f16",
            "mean KLD vs f16", "same top-1"]
    body = [[r.label, r.cache_k if r.cache_k == r.cache_v else f"{r.cache_k} / {r.cache_v}",
             f"{r.kv_mib:.2f}", f"{r.bits_per_value:.2f}", f"{r.ratio_vs_f16:.3f}x",
             f"{r.mean_kld:.4f} ± {r.kld_se:.4f}", f"{100 * r.same_top1:.1f}%"] for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    right = {2, 3, 4, 5, 6}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def table_footer(rows: list[Row], n_chunks: int, n_ctx: int, text_name: str) -> str:
    """What the columns were measured on (pure)."""
    n = rows[0].n_tokens if rows else 0
    return (f"mean KLD: next-token distribution against the f16 cache on {text_name}, {n_chunks} chunks of "
            f"{n_ctx} tokens ({n} scored, ± standard error)\n"
            f"KV MiB: K + V cache of all layers at {rows[0].n_ctx if rows else DEMO_CTX} tokens")


def explain(setting: str, types: str, k_domain: str, scale_method: str | None, rotation: dict,
            codebooks: set[str], codebook_method: str | None = None, made_by: str | None = None,
            block_scales: str | None = None) -> str:
    """One line: which setting is pykvq's and what it does (pure; the facts come from the model).
    block_scales: 'least squares' when the blocks' scales are searched (q53_64, and q4_0 / q5_0 in a
    converted file)."""
    rot = "+".join(w for w, on in sorted(rotation.items()) if on)
    parts = [f"{types} K+V"]
    if "q53_64" in types.split("/")[0]:
        parts.append("keys in q53_64 (the 32 channels of every 64 the loss reads most in 5 bits, the rest in 3)")
    if codebooks == {"file"}:
        parts.append("per-layer " + (f"{codebook_method} " if codebook_method else "") + "codebooks from the converter")
    elif codebooks:
        parts.append("codebooks: " + ", ".join(sorted(codebooks)))
    if k_domain == "pre-RoPE":
        parts.append("keys cached before RoPE, centred and scaled per channel"
                     + (f" ({scale_method})" if scale_method else ""))
    parts.append(f"online Hadamard on {rot}" if rot else "no online rotation")
    if block_scales:
        parts.append(f"block scales by {block_scales}")
    made = f" ({made_by})" if made_by else ""
    return (f"pykvq's setting: {setting} = " + ", ".join(parts) + made
            + "; the lowest KLD measured at 4.5 bits/value for SmolLM2 (docs/prerope.md)")


def explain_model(setting: str, m: Model) -> str:
    """explain() with the facts read from the model as it runs (types, key domain, codebooks, rotation)."""
    from .suite.settings import TRANSFORMS
    types = m.cache_type_k if m.cache_type_k == m.cache_type_v else f"{m.cache_type_k}/{m.cache_type_v}"
    books = {s for pair in m.codebook_sources() for s in pair if s}
    s = parse_setting(setting)
    made_by = None
    if s.variant():
        flags = " ".join(TRANSFORMS.get(s.transform) or [])
        made_by = f"convert/to_gguf.py {flags}".rstrip() + ", converted once and cached"
    searched = {"q53_64"} | ({"q4_0", "q5_0"} if m.encoder == "least-squares" else set())
    scales = "least squares" if {m.cache_type_k, m.cache_type_v} & searched else None
    return explain(setting, types, m.k_domain, m.meta(Keys.Cache.K_SCALE_METHOD), m.attn_rotation, books,
                   m.meta(Keys.Cache.CODEBOOK_METHOD), made_by, scales)


# ---- I/O -------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"[pykvq demo] {msg}", file=sys.stderr, flush=True)


def model_file(src: Path, setting: Setting) -> Path:
    """The GGUF a setting runs on: src itself, or src converted once and cached ($PYKVQ_CACHE/converted)."""
    from .paths import cache_dir
    from .suite.converted import converted
    variant = setting.variant()
    if variant is None:
        return src
    target = cache_dir() / "converted" / f"{src.stem}.{variant}.gguf"
    fresh = not (target.exists() and target.with_suffix(".json").exists())
    if fresh:
        _say(f"first run: converting {src.name} for {setting.label} once (under a minute on 2 idle cores), "
             f"cached in {target.parent}")
    t0 = time.perf_counter()
    path, _ = converted(src, variant, setting.converter_flags())
    if fresh:
        _say(f"converted in {time.perf_counter() - t0:.1f} s")
    return path


def open_models(src: Path | None = None, *, n_ctx: int = DEMO_CTX, n_threads: int | None = None) -> dict[str, Model]:
    """{row label: Model} for the demo's rows, each with flash attention and its setting's cache."""
    from .registry import fetch
    src = Path(src) if src is not None else fetch(DEMO_MODEL, progress=True)
    out: dict[str, Model] = {}
    try:
        for label, spec in ROWS:
            s = parse_setting(spec)
            out[label] = Model(model_file(src, s), n_ctx=n_ctx, flash_attn=True, n_threads=n_threads,
                               **s.model_kwargs())
    except BaseException:
        close_models(out)
        raise
    return out


def close_models(models: dict[str, Model]) -> None:
    for m in models.values():
        m.close()


def eval_tokens(m: Model, text: str, n_ctx: int, n_chunks: int) -> list[int]:
    """Tokens for n_chunks chunks: a prefix of the text, so the whole split is not tokenized."""
    need = n_ctx * n_chunks
    chars = need * 6
    while True:
        toks = m.tokenize(text[:chars], add_special=True, parse_special=False)
        if len(toks) >= need or chars >= len(text):
            return toks
        chars *= 2


def measure(models: dict[str, Model], text: str, *, n_ctx: int = EVAL_CTX, n_chunks: int = EVAL_CHUNKS,
            progress: bool | None = None) -> list[Row]:
    """Rows in ROWS order: each setting's cache size and KLD against the first (f16) model.
    The f16 row is measured too (the baseline evaluated a second time: 0 unless it is not deterministic)."""
    labels = list(models)
    base = models[labels[0]]
    toks = eval_tokens(base, text, n_ctx, n_chunks)
    res = kld_sweep(base, models, tokens=toks, n_ctx=n_ctx, n_chunks=n_chunks, progress=progress,
                    desc="KLD vs f16")
    return [make_row(label, models[label].kv_cache_info(), res[label]) for label in labels]


def demo_table(src: Path | None = None, *, n_ctx: int = DEMO_CTX, eval_ctx: int = EVAL_CTX,
               n_chunks: int = EVAL_CHUNKS, text: str | None = None, progress: bool | None = None,
               n_threads: int | None = None) -> tuple[list[Row], str]:
    """(rows, table) for f16, stock q4_0 and pykvq's setting on WikiText-2 test (or text)."""
    from .data import eval_text
    text_name = "the given text"
    if text is None:
        text, text_name = eval_text()
    models = open_models(src, n_ctx=n_ctx, n_threads=n_threads)
    try:
        rows = measure(models, text, n_ctx=eval_ctx, n_chunks=n_chunks, progress=progress)
    finally:
        close_models(models)
    return rows, format_table(rows) + "\n" + table_footer(rows, n_chunks, eval_ctx, text_name)


def run(*, n_chunks: int = EVAL_CHUNKS, eval_ctx: int = EVAL_CTX, n_threads: int | None = None,
        out=None) -> int:
    """The whole demo, printed to out (stdout)."""
    from .data import eval_text
    out = out or sys.stdout
    t0 = time.perf_counter()
    models = open_models(n_threads=n_threads)
    try:
        labels = list(models)
        f16, ours = models[labels[0]], models[labels[-1]]
        print(f"model: {f16.path.name}", file=out)
        print(f"prompt: {DEMO_PROMPT}", file=out)
        for label, m in (("f16", f16), (PYKVQ_SETTING, ours)):
            print(f"answer ({label}, K={m.cache_type_k}, V={m.cache_type_v}): ", end="", file=out, flush=True)
            for piece in m.generate(DEMO_PROMPT, max_tokens=MAX_TOKENS, stream=True):
                print(piece, end="", file=out, flush=True)
            print(file=out)
        print(file=out)
        text, text_name = eval_text()
        rows = measure(models, text, n_ctx=eval_ctx, n_chunks=n_chunks)
        print(format_table(rows), file=out)
        print(table_footer(rows, n_chunks, eval_ctx, text_name), file=out)
        print(explain_model(PYKVQ_SETTING, ours), file=out)
    finally:
        close_models(models)
    _say(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
