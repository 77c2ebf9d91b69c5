"""pykvq command line: generate, perplexity, kld, info, fetch, demo, serve, tool, and the suite
(eval, bench, passkey, report, results).

    pykvq generate "What is the capital of France?" -ctk q8_0 -ctv q4_0
    pykvq perplexity -ctk q4_0 -ctv q4_0 --chunks 20
    pykvq kld -ctk q4_0 -ctv q4_0 --chunks 20          # against an f16 cache
    pykvq info
    pykvq results [--quick]                             # eval + bench + passkey + long + docs/RESULTS.md
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import __version__
from .cache_types import CACHE_TYPES
from .errors import PykvqError


def _model_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model", default=None,
                    help="GGUF path, or a known model name (smollm2-135m, qwen2.5-coder-1.5b); "
                         "default: smollm2-135m, fetched on first use")


def _cache_args(ap: argparse.ArgumentParser, default: str | None = None) -> None:
    types = ", ".join(CACHE_TYPES)
    dflt = default or "the type a pykvq-converted GGUF was prepared for, else f16"
    ap.add_argument("-ctk", "--cache-type-k", default=default, metavar="TYPE",
                    help=f"K cache type ({types}); default: {dflt}")
    ap.add_argument("-ctv", "--cache-type-v", default=default, metavar="TYPE",
                    help=f"V cache type ({types}); default: {dflt}")
    ap.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto",
                    help="flash attention (a quantized V cache needs it); default auto")
    ap.add_argument("-rotk", "--attn-rot-k", choices=["auto", "on", "off"], default="auto",
                    help="online Hadamard rotation of the K cache (auto: on for quantized K, head size %% 64 == 0)")
    ap.add_argument("-rotv", "--attn-rot-v", choices=["auto", "on", "off"], default="auto",
                    help="online Hadamard rotation of the V cache (auto: as for K)")
    ap.add_argument("--kv-sinks", type=int, default=None, metavar="N",
                    help="a pre-RoPE file: keep the first N positions in f16 beside the quantized cache (default: the "
                         "file's pykvq.cache.kv_sinks, 4 for a --prerope-k file; 0 turns it off)")
    ap.add_argument("--kv-window", type=int, default=None, metavar="N",
                    help="a pre-RoPE file: each query reads the last N positions up to it in f16 (default: the file's "
                         "pykvq.cache.kv_window, 64 for a --prerope-k file; 0 turns it off), in decode and prefill alike")
    ap.add_argument("--kv-heavy", type=float, default=None, metavar="F",
                    help="a pre-RoPE file with the window: also keep this fraction of the context exact, the keys "
                         "scoring highest against the file's mean query (heavy hitters, e.g. 0.01; default: the file's "
                         "pykvq.cache.kv_heavy, else 0)")
    ap.add_argument("-ub", "--ubatch-size", type=int, default=None, help="tokens per graph (default 512)")
    ap.add_argument("-c", "--ctx-size", type=int, default=None, help="context size of the model (tokens)")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to a GPU")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")


def _text_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-f", "--file", default=None,
                    help="text file to evaluate (default: the WikiText-2 test split shipped with pykvq)")
    ap.add_argument("--n-ctx", type=int, default=512, help="tokens per evaluation chunk (default 512)")
    ap.add_argument("--chunks", type=int, default=None, help="evaluate only the first N chunks")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")


def _resolve_model(name):
    from .registry import MODELS, fetch
    if name is None or name in MODELS:
        return fetch(name or "smollm2-135m")
    return name


def _open(args, n_ctx_default: int = 4096, cache_k=None, cache_v=None, rotation: bool = True):
    """Model from the CLI's cache arguments; rotation=False leaves the rotation
    at auto (used for the baseline of a comparison)."""
    from .model import Model
    flash = {"on": True, "off": False, "auto": None}[args.flash_attn]
    return Model(_resolve_model(args.model), n_ctx=args.ctx_size or n_ctx_default,
                 cache_type_k=cache_k or args.cache_type_k, cache_type_v=cache_v or args.cache_type_v,
                 flash_attn=flash, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
                 verbose=args.verbose or None,
                 attn_rot_k=args.attn_rot_k if rotation else "auto",
                 attn_rot_v=args.attn_rot_v if rotation else "auto",
                 kv_sinks=args.kv_sinks if rotation else 0, kv_window=args.kv_window if rotation else 0,
                 kv_heavy=args.kv_heavy if rotation else 0, n_ubatch=args.ubatch_size)


def _read_text(path):
    from .data import wikitext_test
    if path is None:
        return wikitext_test()
    with open(path, encoding="utf-8") as f:
        return f.read()


def _banner(m, extra: str = "") -> None:
    """What is running: model, cache types and size, active transforms (stderr)."""
    print(f"[pykvq] {m.path.name} | {m.kv_cache_info()} | {m.transforms()}{extra}", file=sys.stderr)


def cmd_generate(args) -> int:
    m = _open(args)
    _banner(m)
    t0 = time.perf_counter()
    n = 0
    for piece in m.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, stream=True, raw=args.raw):
        sys.stdout.write(piece)
        sys.stdout.flush()
        n += 1
    print()
    print(f"[pykvq] {n} pieces in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    m = _open(args, n_ctx_default=max(args.n_ctx, 512))
    _banner(m)
    r = m.perplexity(_read_text(args.file), n_ctx=args.n_ctx, n_chunks=args.chunks, progress=True)
    if args.json:
        print(json.dumps({"ppl": r.ppl, "n_tokens": r.n_tokens, "n_chunks": r.n_chunks, "n_ctx": r.n_ctx,
                          "cache_type_k": m.cache_type_k, "cache_type_v": m.cache_type_v}))
    else:
        print(r)
    return 0


def cmd_kld(args) -> int:
    import os
    text = None
    if args.baseline in CACHE_TYPES:
        base = _open(args, n_ctx_default=max(args.n_ctx, 512), cache_k=args.baseline, cache_v=args.baseline,
                     rotation=False)
        text = _read_text(args.file)
    elif os.path.isfile(args.baseline):
        base = args.baseline
    else:
        raise PykvqError(f"--baseline must be a cache type ({', '.join(CACHE_TYPES)}) or a base-logits file, "
                         f"got {args.baseline!r}")
    m = _open(args, n_ctx_default=max(args.n_ctx, 512))
    _banner(m, f" | baseline: {args.baseline}")
    r = m.kl_divergence(text, baseline=base, n_ctx=args.n_ctx, n_chunks=args.chunks, progress=True)
    from .diagnose import Run, advice
    from .keys import Keys, Values
    prepared = m.meta(Keys.Cache.K_DOMAIN) == Values.K_DOMAIN_PREROPE
    file_types = None                       # a run of the file's own types (per layer, where it has them): none
    if "caller" in m.cache_type_source.values():
        made_for = (m.meta(Keys.Cache.TYPE_K), m.meta(Keys.Cache.TYPE_V))
        file_types = made_for if None not in made_for else None
    fallback = sum(src == "fallback" for layer in m.codebook_sources() for src in layer)
    tip = advice(Run(str(m.path), m.cache_type_k, m.cache_type_v, m.k_domain, prepared, r.mean_kld,
                     file_types=file_types, fallback_codebooks=fallback))
    if args.json:
        print(json.dumps(dict(r.as_dict(), cache_type_k=m.cache_type_k, cache_type_v=m.cache_type_v, advice=tip)))
    else:
        print(r)
        if tip and (args.baseline in ("f16", "f32", "bf16") or os.path.isfile(args.baseline)):   # against f16
            print(tip)
    return 0


def cmd_info(args) -> int:
    from . import native_version, system_info
    from ._lib import lib
    print(f"pykvq {__version__}; native KVQ {native_version()}; library {lib().path}")
    print(f"system: {system_info()}")
    if args.no_model:
        return 0
    if args.file:
        if args.model and args.model != args.file:
            raise PykvqError(f"two models given: -m {args.model} and {args.file}")
        args.model = args.file
    m = _open(args)
    print(f"model: {m.path} ({m.description}, arch {m.arch}, {m.n_layer} layers, "
          f"{m.n_head}/{m.n_head_kv} heads, head dim {m.head_dim_k})")
    print(f"chat template: {'yes' if m.chat_template else 'no'}")
    print(m.kv_cache_info())
    print(m.transforms())
    from .diagnose import file_advice, key_outliers
    from .keys import Keys, Values
    prepared = m.meta(Keys.Cache.K_DOMAIN) == Values.K_DOMAIN_PREROPE
    outlier = None
    if args.check_keys and not prepared:
        from . import calibrate
        from .data import wikitext_test
        path = str(m.path)
        m.close()   # the check runs the model once more on 256 tokens of WikiText-2
        outlier = key_outliers(calibrate.collect(path, wikitext_test()[:20000], n_seq=1, seq_len=256, source="wikitext"))
    print(file_advice(str(m.path), prepared, outlier))
    if prepared:
        from .diagnose import outlook
        info = m.kv_cache_info()
        heavy = float(m.meta(Keys.Cache.KV_HEAVY) or 0.0) if int(m.setting("kv_heavy") or 0) > 0 else 0.0
        print(outlook(info.bits_per_value, int(m.setting("kv_sinks") or 0), int(m.setting("kv_window") or 0),
                      m.setting("kv_window_type") or "f16", heavy))
    return 0


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from . import calibrate
    if args.text is None:
        from .calib_text import canterbury_text     # the converter's corpus, fetched once
        text, source = canterbury_text(), "canterbury"
    else:
        text, source = Path(args.text).read_text(encoding="utf-8", errors="replace"), Path(args.text).name
    st = calibrate.collect(_resolve_model(args.model), text, n_seq=args.seqs, seq_len=args.len,
                           samples=args.samples, source=source, progress=True, n_threads=args.threads)
    st.save(args.output)
    k = st.layers[0]
    print(f"wrote {args.output}: {len(st.layers)} layers, {st.n_seq} x {st.seq_len} tokens of {source} in "
          f"{st.seconds:.1f} s ({st.tokens_per_s:.0f} tokens/s); rope layout {st.rope_layout}, {st.n_rot} rotated "
          f"channels; layer 0 K [{k.mean['k'].shape[0]} heads x {k.mean['k'].shape[1]}], largest |mean| "
          f"{abs(k.mean['k']).max():.3g}")
    return 0


def cmd_serve(args) -> int:
    from .serve import serve
    extra = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    return serve(_resolve_model(args.model), cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                 host=args.host, port=args.port, n_parallel=args.parallel, n_ctx=args.ctx_size,
                 threads=args.threads, k_domain=args.kv_domain, encoder=args.kv_encoder, extra=extra)


def cmd_tool(args) -> int:
    from .tools import TOOLS, exec_tool, tool_path
    if args.name is None:
        for name in TOOLS:
            print(tool_path(name))
        return 0
    exec_tool(args.name, args.tool_args)
    return 0                                # not reached: the tool replaced this process


def cmd_fetch(args) -> int:
    from .registry import fetch
    print(fetch(args.name, progress=True))
    return 0


def cmd_demo(args) -> int:
    from .demo import run
    return run(n_chunks=args.chunks, n_threads=args.threads)


def _suite_dirs(args):
    from pathlib import Path
    out = Path(args.out or ("results/quick" if getattr(args, "quick", False) else "results"))
    docs = Path(args.docs or (out / "docs" if getattr(args, "quick", False) else "docs"))
    return out, docs


def _suite_model(args):
    from .registry import MODELS, fetch
    name = args.model or "smollm2-135m"
    if name in MODELS:
        return name, fetch(name, progress=True)
    from pathlib import Path
    p = Path(name)
    if not p.is_file():
        raise PykvqError(f"model {name!r}: not a file and not a known model ({', '.join(MODELS)})")
    return p.stem, p


def cmd_eval(args) -> int:
    from .data import eval_text
    from .suite import quality, report
    from .suite.settings import matrix
    name, src = _suite_model(args)
    if args.weights == "f32":
        from .suite.converted import converted
        src, _ = converted(src, "f32w", ["--dequantize"])
        name += "-f32w"
    settings = matrix(args.settings)
    text, text_name = eval_text(args.file)
    out, _ = _suite_dirs(args)
    store = quality.run(src, settings, out / f"eval_{name}.json", text=text, text_name=text_name,
                        n_ctx=args.n_ctx, chunks=args.chunks, progress=True)
    print("\n".join(report.quality_md({"meta": store.meta, "rows": store.rows}, name, None)))
    return 0


def cmd_bench(args) -> int:
    from .suite import report, speed
    from .suite.settings import parse_settings
    name, src = _suite_model(args)
    out, _ = _suite_dirs(args)
    store = speed.run(src, parse_settings(args.types), out / f"bench_{name}.json",
                      depths=[int(d) for d in args.depths.split(",")], pp=args.pp, tg=args.tg,
                      threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    print("\n".join(report.speed_md({"meta": store.meta, "rows": store.rows}, name, None)))
    return 0


def cmd_passkey(args) -> int:
    from .suite import passkey, report
    from .suite.run import default_lengths
    from .suite.settings import parse_settings
    name, src = _suite_model(args)
    out, _ = _suite_dirs(args)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else default_lengths(src)
    store = passkey.run(src, parse_settings(args.types), out / f"passkey_{name}.json", lengths=lengths,
                        trials=args.trials)
    print("\n".join(report.passkey_md({"meta": store.meta, "rows": store.rows})))
    return 0


def _readme(args):
    """README.md in the working directory, updated only for the default docs directory."""
    from pathlib import Path
    return Path("README.md") if args.docs is None and not getattr(args, "quick", False) else None


def cmd_report(args) -> int:
    from .suite import report
    out, docs = _suite_dirs(args)
    print(report.write(out, docs, readme=_readme(args)))
    return 0


def cmd_results(args) -> int:
    from .suite.run import run_all
    out, docs = _suite_dirs(args)
    parts = tuple(p for p in ("eval", "bench", "passkey", "long") if p not in (args.skip or "").split(","))
    path = run_all(args.models.split(","), out, docs, quick=args.quick, text_file=args.file, parts=parts,
                   threads=args.threads, n_gpu_layers=args.n_gpu_layers, progress=True, readme=_readme(args))
    print(path)
    return 0


def _suite_out_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="directory of the JSON result files (default: results; "
                   "results/quick with --quick). Runs resume from what is there")
    p.add_argument("--docs", default=None, help="where RESULTS.md and the plots go (default: docs; "
                   "<out>/docs with --quick)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pykvq", description="KV-cache quantization for llama.cpp: "
                                 "generate, measure quality and cache size.")
    ap.add_argument("--version", action="version", version=f"pykvq {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="generate a reply to a prompt")
    p.add_argument("prompt")
    _model_arg(p)
    _cache_args(p)
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("perplexity", help="perplexity on a text (llama-perplexity's chunking)")
    _model_arg(p)
    _cache_args(p)
    _text_args(p)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("kld", help="KL divergence of the next-token distribution against a baseline")
    _model_arg(p)
    _cache_args(p)
    _text_args(p)
    p.add_argument("--baseline", default="f16",
                   help="baseline cache type (same model, default f16) or a base-logits file "
                        "(llama-perplexity --kl-divergence-base format)")
    p.set_defaults(func=cmd_kld)

    p = sub.add_parser("info", help="library, system and model info with the KV-cache size; for a converted file "
                       "what it will do (types, window, bits at 4k / 32k, the KLD to expect)")
    _model_arg(p)
    p.add_argument("file", nargs="?", default=None, help="the GGUF (the same as -m)")
    _cache_args(p)
    p.add_argument("--no-model", action="store_true", help="only library and system info")
    p.add_argument("--check-keys", action="store_true",
                   help="run the model on 256 tokens and say whether its keys' channel means would break quantized "
                        "post-RoPE keys (and the command that prepares the file)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("calibrate", help="per-layer statistics of pre-RoPE Q / K and V, gathered in the runtime "
                                         "(what convert/to_gguf.py --prerope-k uses)")
    _model_arg(p)
    p.add_argument("-o", "--output", required=True, help="where to write the statistics (.npz)")
    p.add_argument("--text", default=None, help="calibration text file (default: the Canterbury corpus)")
    p.add_argument("--seqs", type=int, default=4, help="sequences (default 4)")
    p.add_argument("--len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--samples", action="store_true", help="keep every token's Q / K / V too")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("tool", help="run one of the patched llama.cpp tools (llama-cli, llama-server, ...)",
                       description="Run a patched llama.cpp tool with its own arguments, e.g. 'pykvq tool llama-cli "
                       "-m OUT.gguf -fa on' (a converted file brings its cache types). Without a name: where each "
                       "tool is (put that directory on PATH to call them directly).")
    p.add_argument("name", nargs="?", default=None, help="llama-cli, llama-completion, llama-perplexity, llama-bench, "
                   "llama-server or ggml-rpc-server")
    p.add_argument("tool_args", nargs=argparse.REMAINDER, help="the tool's arguments, unchanged")
    p.set_defaults(func=cmd_tool)

    p = sub.add_parser("fetch", help="download a known model into the cache")
    p.add_argument("name", nargs="?", default="smollm2-135m")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("serve", help="llama-server (OpenAI-compatible HTTP) with pykvq's cache types",
                       description="Start build/bin/llama-server on a GGUF with flash attention on. Cache types "
                       "left open come from a pykvq-converted file (per-layer types, codebooks), else f16. "
                       "Arguments after -- go to llama-server unchanged (e.g. -- --slot-save-path DIR "
                       "--context-shift --rpc HOST:PORT -ngl 99).")
    _model_arg(p)
    p.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE", help="K cache type (default: the file's, else f16)")
    p.add_argument("-ctv", "--cache-type-v", default=None, metavar="TYPE", help="V cache type (default: the file's, else f16)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size shared by all slots (default: the model's)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="parallel slots (default 4)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: llama-server's)")
    p.add_argument("--kv-domain", default=None, choices=["auto", "post", "pre", "centred"],
                   help="where a --prerope-k file's quantized keys are cached (default auto: pre-RoPE where the file asks)")
    p.add_argument("--kv-encoder", default=None, choices=["auto", "stock", "lsq"],
                   help="q4_0 / q5_0 cache writes (default auto: least-squares scales for a converted file)")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="-- then more llama-server arguments")
    p.set_defaults(func=cmd_serve)

    from .suite.settings import TRANSFORMS
    p = sub.add_parser("eval", help="quality matrix: KLD / p99 / same top-1 / PPL vs an f16 cache, "
                       "per setting (cache types, converter transforms, rotation)",
                       description="Evaluate settings K[/V][@TRANSFORM][:rot-on|:rot-off][:centred][:stock-scales|:lsq-scales] against the "
                       f"same model with an f16 cache. Transforms: {', '.join(TRANSFORMS)}, kvbits-B (per-layer "
                       "types; K/V 'auto'); what each bakes in: pykvq/suite/settings.py. ':centred' caches a "
                       "@prerope file's keys after RoPE minus the rotated mean (k_domain centred). "
                       "':stock-scales' writes a converted file's q4_0 / q5_0 rows with ggml's encoder instead of "
                       "least-squares block scales, ':lsq-scales' a stock file's with them (encoder lsq). "
                       "Converted files are cached.")
    _model_arg(p)
    p.add_argument("-s", "--settings", default="full",
                   help="comma-separated settings, or a matrix name: full, core, quick (default full)")
    p.add_argument("-f", "--file", default=None,
                   help="text to evaluate (default: WikiText-2 test, else the KJV Bible fetched from Debian)")
    p.add_argument("--n-ctx", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=16, help="chunks to evaluate (default 16)")
    p.add_argument("--weights", choices=("file", "f32"), default="file",
                   help="f32: evaluate the model with every weight dequantized to f32 (made once with the "
                        "converter's --dequantize and cached; ~4 bytes per parameter). A quantized model rounds "
                        "its activations before each matmul, so any change to attention costs it a KLD of ~0.003 "
                        "(SmolLM2 Q4_1, 4096 tokens), most of stock q8_0's figure; exact weights show the "
                        "cache's own error. Results go to eval_<model>-f32w.json (default: file, the model as is)")
    _suite_out_args(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="prefill/decode tokens/s at depth, KV bytes/token, peak RSS per type",
                       description="One process per cache type; ratios to f16 and stock q4_0 of the same run.")
    _model_arg(p)
    p.add_argument("--types", default="f16,q8_0,q4_0,bfp4_32,nuq4,nuq3o,nuq2o",
                   help="comma-separated cache types, K/V for different ones, or suite settings such as "
                        "q4_0@prerope (a converted file, made once and cached) (default: f16 and stock/new 4-2 bit)")
    p.add_argument("--depths", default="0,4096,8192", help="KV depths in tokens (default 0,4096,8192)")
    p.add_argument("--pp", type=int, default=512, help="prefill batch in tokens (default 512)")
    p.add_argument("--tg", type=int, default=32, help="decoded tokens per depth (default 32)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to a GPU")
    _suite_out_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("passkey", help="passkey retrieval at increasing distance, success rate per type")
    _model_arg(p)
    p.add_argument("--types", default="f16,q8_0,q4_0,nuq4,nuq2o",
                   help="comma-separated cache types (K/V allowed) or suite settings such as q4_0@prerope")
    p.add_argument("--lengths", default=None,
                   help="prompt lengths in tokens (default: 1024, 2048, ... up to the model's context)")
    p.add_argument("--trials", type=int, default=3, help="keys per type (default 3)")
    _suite_out_args(p)
    p.set_defaults(func=cmd_passkey)

    p = sub.add_parser("report", help="write RESULTS.md and the plots from the JSON results")
    _suite_out_args(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("results", help="eval + bench + passkey + long context + report in one command (resumable)")
    p.add_argument("--models", default="smollm2-135m",
                   help="comma-separated known models (default smollm2-135m; add qwen2.5-coder-1.5b)")
    p.add_argument("--quick", action="store_true", help="CI-sized run into results/quick")
    p.add_argument("--skip", default=None, help="parts to skip: eval, bench, passkey, long (the README's settings at "
                   "4k-16k tokens) (comma-separated)")
    p.add_argument("-f", "--file", default=None, help="text to evaluate (default: WikiText-2 test)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for bench (default: all)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="bench with layers offloaded to a GPU")
    _suite_out_args(p)
    p.set_defaults(func=cmd_results)

    p = sub.add_parser("demo", help="answer a question with an f16 cache and pykvq's setting; size and KLD "
                       "of f16, stock q4_0 and pykvq's setting, measured on the spot")
    p.add_argument("--chunks", type=int, default=4, help="WikiText-2 chunks of 512 tokens for the KLD (default 4)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PykvqError as e:
        print(f"pykvq: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
