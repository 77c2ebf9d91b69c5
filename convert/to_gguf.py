#!/usr/bin/env python3
"""Prepare a GGUF for a smaller KV cache: pre-RoPE key statistics, cache types, codebooks, transforms.

    pykvq-convert SRC -o OUT.gguf               # the recommended 4.5-bit file (python convert/to_gguf.py ... too)
    pykvq-convert SRC -o OUT.gguf --bits 3.5    # fewer bits: 3.5-bit types and the window that fits at 4096 tokens

SRC is an HF checkpoint directory (llama / mistral / SmolLM / qwen2) or an
existing GGUF (any weight type, never modified). Attention output is unchanged
but for the cache's own error. Run the file with the llama.cpp tools or pykvq.
"""
from __future__ import annotations

import argparse
import logging
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):             # run as a script: make `convert` and `pykvq` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "convert"

from convert import calib as calib_mod                         # noqa: E402
from convert import pipeline                                   # noqa: E402
from convert.geometry import SUPPORTED_ARCHS, geometry        # noqa: E402
from convert.gguf_io import INT_TYPES, ConvertError, GGUFModel, read_gguf, write_gguf  # noqa: E402
from pykvq.keys import Tensors, suffix                          # noqa: E402

log = logging.getLogger("pykvq.convert")
ROOT = Path(__file__).resolve().parent.parent
# a wheel carries upstream's HF converter beside this package (setup.py); a checkout has it in third_party/ (make fetch)
_UPSTREAM_PATHS = (Path(__file__).resolve().parent / "llama_cpp" / "convert_hf_to_gguf.py",
                   ROOT / "third_party" / "llama.cpp" / "convert_hf_to_gguf.py")
UPSTREAM = next((p for p in _UPSTREAM_PATHS if p.is_file()), _UPSTREAM_PATHS[-1])

# the presets (--bits): the 4.5-bit file with the lowest KLD measured on both suite models (README); at 3.5 and up to
# PAIR_CTX cells of --ctx one type pair for every layer with the rest of B in the exact window (at 4096 tokens it tied
# the per-layer budget on Qwen2.5-Coder-1.5B and beat it by 20% on SmolLM2, whose budget moves by 25% with the
# calibration sample; at 8192 by 29% on SmolLM2 and 8% on Qwen; at 16384 on Qwen by 5% with q8_0 window rows, where
# with f16 rows, half the window, the budget won by 9%; RESULTS-BY-DATE 2026-11-30 / 12-01); else the per-layer budget
PRESET_45 = ("--prerope-k", "--cache-type-k", "q53_64", "--cache-type-v", "q4_0")
PRESET_35 = ("--prerope-k", "--cache-type-k", "q42_64", "--cache-type-v", "nuq3_64")
PRESET_BUDGET = ("--prerope-k", "--kv-bits")
PRESET_CTX = 4096
PAIR_CTX = {"q8_0": 16384, "f16": 8192}   # by window row type: the longest --ctx the 3.5-bit pair was measured to win at
# the flags that choose what the file prepares: with none of them the 4.5-bit preset applies
CHOOSING = ("ksort", "smooth_qk", "rotate_v", "learn_k", "prerope_k", "cache_type_k", "cache_type_v", "kv_bits",
            "layer_types", "layer_types_k", "dequantize")

EPILOG = """\
examples:
  pykvq-convert model.gguf -o model-kvq.gguf               # 4.5 bits/value: run it with -fa on (types in the file)
  pykvq-convert model.gguf -o model-3.5.gguf --bits 3.5    # 3.5 bits/value at 4096 tokens, window included
  pykvq-convert model.gguf -o model-3.0.gguf --bits 3 --kv-window auto   # and the window's length measured (slow)
  pykvq-convert ./hf-checkpoint -o model-kvq.gguf          # an HF checkpoint: upstream's converter first
  then: llama-cli -m model-kvq.gguf -fa on ...   |   pykvq generate -m model-kvq.gguf "..."   |   pykvq info -m model-kvq.gguf

what each transform needs:
  exact on any weight type (no requantization): --ksort (moves whole W_q/W_k rows),
    --smooth-qk (scales W_q/W_k rows by powers of two: f16 block scales change exactly)
  requantizes W_v and W_o: --rotate-v hadamard (stored as --outtype, default q8_0 for a GGUF input)
  needs the patched runtime: --ksort (per-head rope frequencies; stock llama.cpp refuses such a file)
  runs on stock llama.cpp too: --smooth-qk, --rotate-v
  needs calibration and the patched runtime's pre-RoPE key cache: --prerope-k (adds per-layer
    blk.N.kvq_k_mean / blk.N.kvq_k_scale; no weight changes; any architecture the runtime runs with
    standard RoPE, the others only llama / qwen2)

what each step costs (a GGUF input; --sensitivity forward, the default):
  calibration   runs the GGUF itself in pykvq's llama.cpp over --calib-seqs x --calib-len tokens (imatrix-style:
                quantized, memory-mapped weights): about one prefill of those tokens; memory about the
                model's own. Moments only, unless smoothing / learned transforms / codebooks need every token's
                Q / K / V (then + layers x tokens x (n_head + 2 n_head_kv) x head_dim x 4 bytes). Cached in
                $PYKVQ_CACHE/calib/runtime
  writing       tensor by tensor from the memory-mapped input; the disk needs about the input's size
  --sensitivity gradients  (the default for codebooks and --kv-bits) reads the GGUF a layer at a time, decodes it
                to float32 and runs the forward pass, then the backward pass from the last layer down (numpy):
                the statistics and the loss's gradients in one pass, without the runtime; memory: every
                layer's input plus one layer's float32 weights and activations (Qwen2.5-Coder-1.5B, 4 x 512
                tokens: about 1 GB beside the rest of the conversion); cached in $PYKVQ_CACHE/calib/grad
  --sensitivity backprop  instead dequantizes the GGUF to an f32 HF checkpoint (~4x the parameters in bytes, on
                disk and in memory) and runs transformers' forward and backward: ~10x the GGUF's size in RAM

study transforms:
  python convert/to_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf -o smol-kvq.gguf --ksort --smooth-qk --rotate-v hadamard
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert/to_gguf.py", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory or GGUF file (never modified)")
    p.add_argument("-o", "--outfile", required=True, help="output GGUF (written atomically; must not be SRC)")
    g = p.add_argument_group("presets (no flag below: the recommended 4.5-bit file)")
    g.add_argument("--bits", type=float, default=None, metavar="B",
                   help="the cache's bits/value: 4.5 (the default) writes the recommended 4.5-bit file ("
                        + " ".join(PRESET_45) + "); 3.5: " + " ".join(PRESET_35) + " with the exact window that fits "
                        "at --ctx cells (55 at 4096 in q8_0 rows), up to 16k cells (8k with f16 rows; beyond, the "
                        "budget); any other B: " + " ".join(PRESET_BUDGET) + " B, each layer's K and V "
                        "its own type, the file's exact window counted at --ctx cells")
    g.add_argument("--ctx", type=int, default=PRESET_CTX, metavar="N",
                   help="with --bits other than 4.5: the context the window's rows are counted at (default %(default)s; "
                        "at longer contexts the window costs less, so the file is smaller than B there)")
    g = p.add_argument_group("the cache the file prepares for (what the presets set; give these instead of a preset)")
    g.add_argument("--prerope-k", action="store_true",
                   help="pre-RoPE, centred key cache: the runtime caches c = (k - mean) / scale, where k is the "
                        "key before RoPE (attn_k output plus bias, in this file's channel layout after any study "
                        "transform below), and restores c*scale + mean and applies RoPE at each cell's position "
                        "when attention reads it; the online K Hadamard turns the centred keys (undone per K tile). The mean and scale "
                        "per layer, KV head and channel are measured on calibration text and written as "
                        "blk.N.kvq_k_mean / kvq_k_scale (and kvq_k_std) (pykvq.cache.k_domain = prerope); codebooks and "
                        "--kv-bits are fitted in this domain. Measured (KLD vs f16, q4_0 K+V): Qwen2.5-Coder-1.5B "
                        "5.6 -> 0.011, SmolLM2 0.044 -> 0.022, gemma3-270m 0.096 -> 0.017 (docs/RESULTS.md). Needs "
                        "flash attention (CPU and CUDA); any architecture the runtime "
                        "runs with standard RoPE. At run time --kv-domain post gives the same file post-RoPE keys")
    g.add_argument("--cache-type-k", default=None,
                   help="K cache type the file is prepared for; the runtime's default when the user gives none "
                        "(default: bfp4_32 with --ksort, else q4_0)")
    g.add_argument("--cache-type-v", default=None, help="V cache type the file is prepared for")
    g.add_argument("--kv-bits", type=float, default=None, metavar="B",
                   help="bits/value budget: give each layer's K and V its own type from --layer-types, ranked "
                        "by Fisher-weighted quantization error, with the average <= B")
    g.add_argument("--kv-bits-ctx", type=int, default=0, metavar="N",
                   help="with --kv-bits and a --prerope-k window: count the window's rows at N cells in the budget "
                        "(8.5 x (sinks + window + 1) / N bits/value in q8_0: 0.14 for 4 + 64 at 4096; 16 x in f16), so "
                        "that B is the whole cache's size at that context; 0 (default): B is the quantized cache's alone")
    g.add_argument("--kv-window", type=_window_arg, default=64, metavar="N|auto",
                   help="with --prerope-k: and the last N cells written per sequence (pykvq.cache.kv_window; default "
                        "%(default)s, 0: off). 4 + 64 cost 0.14 bits/value at 4096 tokens in q8_0 rows (0.27 in f16) and take 4-bit keys and values "
                        "from 6.1x to 1.7x q8_0's KLD on SmolLM2, 2.3x to 1.08x on Qwen2.5-Coder-1.5B (docs/RESULTS.md); "
                        "--kv-sinks / --kv-window at run time override it. auto (with --kv-bits and --kv-bits-ctx N): "
                        "the file is made for each length from 16 up that leaves the cache its cheapest types, each run "
                        "at N tokens on held-out calibration text, and the one closest to the f16 cache kept (a "
                        "conversion and three N-token runs per length)")
    g.add_argument("--kv-sinks", type=int, default=4, metavar="N",
                   help="with --prerope-k: the runtime keeps the first N positions of each sequence in f16 beside the "
                        "quantized cache unless told otherwise (pykvq.cache.kv_sinks; default %(default)s, 0: off)")
    g.add_argument("--kv-window-type", choices=("q8_0", "f16"), default="q8_0",
                   help="with --prerope-k: the type the window's and sinks' rows are held in (pykvq.cache.kv_window_type; "
                        "default %(default)s: half f16's bytes, the same KLD on SmolLM2 at 3 bits and 4096 tokens, "
                        "0.03010 against 0.03006; RPC workers keep f16 rows; --kv-window-type at run time "
                        "overrides it)")
    g.add_argument("--kv-heavy", type=_fraction, default=None, metavar="F|auto",
                   help="with --prerope-k and its window: the runtime also keeps this fraction of each sequence's cells "
                        "exact, the keys scoring highest against the mean query (heavy hitters; pykvq.cache.kv_heavy; "
                        "default 0: off). Inside --kv-bits it is counted like the window (F x 8.5 bits/value in q8_0 "
                        "rows) and takes bits from the types. Measured at 4096 tokens, --bits 3 with 0.01, KLD x stock "
                        "q8_0: SmolLM2 7.5x -> 6.1x, Qwen2.5-Coder-1.5B 3.0x -> 3.4x. auto (with --kv-bits and "
                        f"--kv-bits-ctx N): a file with {pipeline.HEAVY_TRIED:g} and one without are made and judged "
                        "at N tokens on held-out calibration text, as --kv-window auto does, and the better is kept "
                        "(slow). --kv-heavy at run time overrides the file's")
    g.add_argument("--layer-types", default=None, metavar="TYPES",
                   help="candidate types for --kv-bits, V's and (without --layer-types-k) K's. Default: V "
                        + ",".join(pipeline.layer_types.VALUE_LADDER) + ", with nuq2_64 (2.25 bits) first where the "
                        f"cache's share of the budget is below {pipeline.layer_types.Q32_BELOW:g} bits/value; K "
                        "the --layer-types-k default")
    g.add_argument("--layer-types-k", default=None, metavar="TYPES",
                   help="K's candidate types for --kv-bits when they differ from V's. Default: --layer-types where "
                        "given; else with --prerope-k " + ",".join(pipeline.layer_types.PREROPE_K_LADDER) + " (q42_64 "
                        f"/ q53_64: keys split by importance), with q32_64 (3.0 bits) after nuq2o where the cache's "
                        f"share of the budget is below {pipeline.layer_types.Q32_BELOW:g} bits/value and nuq2_64 "
                        f"(2.25) first below {pipeline.layer_types.K2_BELOW:g}; without it "
                        + ",".join(pipeline.layer_types.DEFAULT_LADDER))
    g.add_argument("--cpu-types", action="store_true",
                   help="for a file whose cache stays on the CPU: the default types of a budget and of the 3.5-bit "
                        "preset take trellis-coded ones (CPU kernels only) in place of the scalar ones: values "
                        + ", ".join(f"{v} for {n}" for n, v in pipeline.layer_types.CPU_VALUE_TYPES.items())
                        + f" and {pipeline.layer_types.CPU_VALUE_MID} (3 and 2 bits by turns) between them; keys "
                        + ", ".join(f"{v} for {n}" for n, v in pipeline.layer_types.CPU_KEY_TYPES.items())
                        + " (their scales one byte each, so 0.125-0.25 bits/value cheaper)"
                        + ". At 4096 tokens, KLD vs f16: --bits 3.5 0.0123 -> 0.0102 (SmolLM2), 0.0079 -> 0.0059 "
                        "(Qwen2.5-Coder-1.5B); --bits 3 0.0279 -> 0.0206, 0.0126 -> 0.0087; --bits 2.5 0.0686 -> 0.0404, "
                        "0.0341 -> 0.0214; CPU decode ~0.7x")
    g.add_argument("--kv-bits-weights", choices=("window", "uniform"), default="window",
                   help="with --kv-bits and a --prerope-k window: which errors the budget counts. window (default): "
                        "only those of reads the file's window and sinks leave quantized (the backward pass takes "
                        "gradients through those reads alone; forward sensitivities weigh each token by the "
                        "attention it gets from them), so the layers that look far back get the bits; uniform: "
                        "every token's error alike. At 3.5 bits with --kv-bits-ctx 4096: KLD vs f16 0.0153 -> "
                        "0.0118 (Qwen2.5-Coder-1.5B), 0.0226 -> 0.0189 (SmolLM2-135M)")
    g.add_argument("--codebooks", choices=("auto", "fisher", "kmeans", "uniform", "none"), default="auto",
                   help="per-layer nuq codebooks for K and V, fitted to calibration K/V as the cache holds them: "
                        "fisher = k-means weighted by the diagonal Fisher information (KVQuant), kmeans = "
                        "unweighted, uniform = evenly spaced, none = the runtime's fallback. auto: fisher when "
                        "a nuq cache type is targeted or --kv-bits is given")
    g.add_argument("--no-qnorm", action="store_true",
                   help="do not fold Q-Norm (match mean/std of dequantized values) into the codebooks")
    g.add_argument("--prerope-k-scale", choices=pipeline.prerope.SCALES, default=pipeline.prerope.DEFAULT_SCALE,
                   help="scale of --prerope-k, per channel: fisher = std^(1-2a) / F^a with F the channel's "
                        "diagonal Fisher on the calibration text (a Fisher-weighted key error behind the online "
                        "Hadamard; needs the loss's gradients), absmax = largest |k - mean|, std = standard "
                        "deviation around the mean, pow2 = std rounded to a power of two, one = 1 (mean only). "
                        "Default %(default)s: best in scripts/prerope_study.py on both models (docs/prerope-study.md)")
    g.add_argument("--prerope-k-power", type=_power, default=None, metavar="A",
                   help="the fisher scale's power a (0: the std scale, 0.5: the Fisher alone). Default: "
                        f"{pipeline.prerope.FISHER_POWER:g} when the keys' types have "
                        f"{pipeline.prerope.FISHER_POWER_BITS:g} bits/value or more (q4_0, q53_64, q42_64, nuq4, ...), "
                        f"{pipeline.prerope.FISHER_POWER_LOW:g} when any layer's keys may take fewer (nuq2o; a "
                        "--kv-bits ladder, whose layers that then take uniform blocks of that many bits get "
                        f"{pipeline.prerope.FISHER_POWER:g}): best measured with the exact window at 4096 tokens "
                        "(docs/RESULTS.md)")
    g = p.add_argument_group("calibration")
    g.add_argument("--calib", default=None, metavar="FILE|canterbury",
                   help="calibration text (default: canterbury, fetched once, when a transform needs it)")
    g.add_argument("--calib-seqs", type=int, default=4, help="calibration sequences (default 4)")
    g.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    g.add_argument("--sensitivity", choices=("forward", "probe", "measure", "gradients", "backprop"), default=None,
                   help="where calibration's channel weights come from. forward (the default for a GGUF input "
                        "without codebooks or --kv-bits): pykvq's runtime runs "
                        "the GGUF (any architecture with standard RoPE, memory about the model's); the keys' "
                        "weight is the energy of the queries that read each channel, V's the norm of its W_o "
                        "columns. backprop: the diagonal Fisher from transformers' backward pass on an f32 HF "
                        "checkpoint (llama / qwen2 only; ~10x the GGUF's size in RAM; the default for codebooks / "
                        "--kv-bits, whose budgets compare layers (forward weights cannot), with an HF input or "
                        "--hf-dir). "
                        "probe: forward weights within each layer's K and V, and --kv-bits' prices across them "
                        "measured in the runtime (noise into one slot at a time, the KL divergence it causes: "
                        "2 x layers + 5 forward passes of --probe-len tokens, in the model's own memory; "
                        "the default for --kv-bits where no backward pass can run). measure: as probe, then "
                        "every candidate type of every slot rounded as "
                        "the file's cache will round it and its KL divergence measured (layers x the two ladders' "
                        "types forward passes of 512 tokens: SmolLM2-135M 14 min on 2 cores, 0.0191 -> 0.0174 at "
                        "3.5 bits, 0.067 -> 0.050 at 3.0; slow for larger models). gradients (the default for a GGUF input with "
                        "codebooks or --kv-bits): backprop's statistics and per-token Fisher computed from the GGUF "
                        "a layer at a time in float32 (llama / qwen2, no torch; the same gradients as transformers' "
                        "to 1e-4; Qwen2.5-Coder-1.5B --bits 3.5 in 1.34 GiB peak and 174 s on 2 cores, where "
                        "transformers' pass took 13 GB). Like backprop it takes the gradients only through "
                        "the reads the window leaves quantized")
    g.add_argument("--probe-len", type=int, default=128, metavar="N",
                   help="with --sensitivity probe: tokens per probe pass (default 128; Qwen2.5-Coder-1.5B at 3.5 "
                        "bits and 4096 tokens, KLD against the backward pass: 128 +8%%, 256 +10%%, 512 +7%%, "
                        "the probe taking 54 / 104 / 288 s)")
    g.add_argument("--hf-dir", default=None,
                   help="GGUF input: HF checkpoint to calibrate with (default: one dequantized from the GGUF, "
                        "cached under $PYKVQ_CACHE/hf)")
    g = p.add_argument_group("output")
    g.add_argument("--outtype", choices=("auto", "f32", "f16", "bf16", "q8_0"), default="auto",
                   help="HF input: type of every 2-D weight (auto = f16). GGUF input: type of the tensors a "
                        "transform must requantize (auto = q8_0); the others keep their type")
    g.add_argument("--dequantize", action="store_true",
                   help="GGUF input: write every weight as f32 (about 4 bytes per parameter). A quantized model "
                        "rounds its activations to 8 bits before each matmul, which turns any last-bit change in "
                        "attention into a KLD of ~0.003 (SmolLM2 Q4_1 at 4096 tokens, about stock q8_0's whole "
                        "figure); with exact matmuls a KLD against an f16 cache measures the cache's error alone. "
                        "For measurements (pykvq eval --weights f32), not for use; with --bits B, that preset's file "
                        "in f32. Transforms then store what they requantize as f32 too, as they do for an input whose "
                        "weights are all f32")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("-v", "--verbose", action="store_true")
    g = p.add_argument_group("study transforms (measured in docs/; in no recommended setting)")
    g.add_argument("--ksort", action="store_true",
                   help="K-sort: per layer and KV head, order rotary pairs by magnitude so each cache block "
                        "holds similar pairs (each pair keeps its RoPE frequency; NEOX models are re-laid as NORM)")
    g.add_argument("--ksort-key", choices=("auto", "weight", "calib"), default="auto",
                   help="sort key: W_k pair row norm (the paper's), measured K pair RMS, or auto "
                        "(calib when calibration runs)")
    g.add_argument("--smooth-qk", action="store_true",
                   help="per-pair scales s (K/s, Q*s) that flatten K's outlier pairs; alpha chosen per layer "
                        "by fake-quantized attention-score error")
    g.add_argument("--alpha", type=float, default=None,
                   help="fixed smoothing alpha in [0, 1] instead of the per-layer search")
    g.add_argument("--rotate-v", choices=("none", "hadamard", "learned"), default="none",
                   help="hadamard: per-KV-head Hadamard baked into W_v (b_v) and W_o, spreading V outliers; "
                        "learned: a general invertible matrix per KV head (a product of rank-one updates of "
                        "the Hadamard, inverted by Sherman-Morrison), learned on calibration text for the "
                        "target V cache type by the attention output's error; a layer keeps it only if it "
                        "beats Hadamard on held-out calibration text")
    g.add_argument("--learn-k", action="store_true",
                   help="learn a per-pair complex scale of Q/K (a scale and an in-pair angle: the maps that "
                        "commute with RoPE) for the target K cache type, starting from --smooth-qk's scales "
                        "(or 1); kept per layer only if it beats that start on held-out text. Requantizes "
                        "W_q/W_k of the layers that keep it")
    g.add_argument("--learn-steps", type=int, default=100,
                   help="gradient steps per layer for --rotate-v learned / --learn-k (default 100)")
    g.add_argument("--learn-loss", choices=("output", "fisher"), default="output",
                   help="objective of --rotate-v learned: the attention output's error through W_o (output), "
                        "or the V error weighted by the LM loss's diagonal Fisher information (fisher)")
    g.add_argument("--learn-init", choices=("hadamard", "identity"), default="hadamard",
                   help="starting point of --rotate-v learned (the held-out comparison is always against Hadamard)")
    g.add_argument("--max-cond", type=float, default=100.0,
                   help="bound on the condition number of each learned V transform (default 100)")
    p.set_defaults(cpu_types_pair=False)   # set by the 3.5-bit preset when --cpu-types chose its pair
    return p


SCALE_TEXT = {"fisher": "per-channel std^{std:g} / Fisher^{power:g} (Fisher-weighted)",
              "absmax": "per-channel largest |k - mean| on the calibration text (floored at 1% of the head's median)",
              "std": "per-channel std (floored at 1% of the head's median)",
              "pow2": "per-channel std rounded to a power of two", "one": "1 (mean only)"}


def apply_preset(args, parser: argparse.ArgumentParser) -> str | None:
    """--bits, or no flag that chooses what the file prepares: set the flags of the preset on args. Returns the
    flags it set (for the log), None when the user chose them."""
    chosen = [f"--{d.replace('_', '-')}" for d in CHOOSING if getattr(args, d) != parser.get_default(d)]
    if args.bits is None and chosen:
        return None
    chosen = [c for c in chosen if c != "--dequantize"]     # composes: the preset's file with f32 weights
    if chosen:
        raise ConvertError(f"--bits sets the file's cache preparation; drop {', '.join(chosen)} or --bits")
    bits = 4.5 if args.bits is None else args.bits
    if args.ctx <= 0:
        raise ConvertError(f"--ctx must be > 0, got {args.ctx}")
    if bits == 4.5:
        flags = list(PRESET_45)
        args.prerope_k, args.cache_type_k, args.cache_type_v = True, PRESET_45[2], PRESET_45[4]
    elif bits == 3.5 and (win := _pair_window(bits, *(kv := _pair_35(args.cpu_types)), args, parser)) is not None:
        k, v = kv
        flags = [*PRESET_35[:2], k, PRESET_35[3], v, "--kv-window", str(win)]
        args.prerope_k, args.cache_type_k, args.cache_type_v, args.kv_window = True, k, v, win
        args.cpu_types_pair = args.cpu_types
    else:
        flags = [*PRESET_BUDGET, f"{bits:g}", "--kv-bits-ctx", str(args.ctx)]
        args.prerope_k, args.kv_bits, args.kv_bits_ctx = True, bits, args.ctx
    return " ".join(flags)


def _pair_35(cpu_types: bool) -> tuple[str, str]:
    """--bits 3.5's pair: PRESET_35's, or with --cpu-types its trellis-coded twins (CPU kernels only; their scale codes
    make them 0.125 bits/value cheaper, so the window gets longer)."""
    k, v = PRESET_35[2], PRESET_35[4]
    if cpu_types:
        return pipeline.layer_types.CPU_KEY_TYPES[k], pipeline.layer_types.CPU_VALUE_TYPES[v]
    return k, v


def _pair_window(bits: float, type_k: str, type_v: str, args, parser: argparse.ArgumentParser) -> int | None:
    """The exact window a one-pair preset takes at --ctx cells (the longest whose rows fit beside the pair in bits),
    or None for the budget: past PAIR_CTX cells of the window's row type (at 16384 on Qwen2.5-Coder-1.5B the pair
    won with q8_0 rows, 0.00750 against 0.00789, and lost with f16 rows, 0.00863 against 0.00782), where no window
    fits (a short --ctx), or with a --kv-window of the user's."""
    from pykvq.cache_info import longest_window
    if args.kv_window != parser.get_default("kv_window") or args.ctx > PAIR_CTX[args.kv_window_type]:
        return None
    bpv = pipeline.layer_types.bits_per_value
    pair = (bpv(type_k) + bpv(type_v)) / 2
    return longest_window(bits - pair, args.kv_sinks, args.ctx, args.kv_window_type)


def _power(arg: str) -> float:
    a = float(arg)
    if not 0.0 <= a <= 0.5:
        raise argparse.ArgumentTypeError(f"the fisher power must be within [0, 0.5], got {arg}")
    return a


def _types_list(arg: str) -> tuple:
    return tuple(t.strip() for t in arg.split(",") if t.strip())


def _key_ladder(args) -> tuple | None:
    """K's candidates: --layer-types-k, else V's where --layer-types names them (None), else the default (the
    pre-RoPE one with --prerope-k)."""
    if args.layer_types_k is not None:
        return _types_list(args.layer_types_k)
    if args.layer_types is not None:
        return None
    lt = pipeline.layer_types
    return lt.PREROPE_K_LADDER if args.prerope_k and args.kv_bits is not None else lt.DEFAULT_LADDER


def _default_ladders(opts: pipeline.Options, ladder_v_auto: bool, cache_bits: float) -> None:
    """The default K / V ladders (where the user named none) for a cache share of cache_bits bits/value."""
    if opts.ladder_k_auto:
        opts.ladder_k = pipeline.layer_types.prerope_k_ladder(cache_bits, opts.cpu_types)
    if ladder_v_auto:
        opts.ladder = pipeline.layer_types.value_ladder(cache_bits, opts.cpu_types)


def _is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def _check_safetensors(src: Path) -> None:
    """Each *.safetensors file must hold its header and every byte its header points to: a cut download is
    named here, before upstream's converter runs into it half-way through writing."""
    import json
    import struct
    for f in sorted(src.glob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                if n > size - 8:
                    raise ValueError(f"its header claims {n} bytes, the file has {size}")
                header = json.loads(fh.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
            raise ConvertError(f"{f} is not a readable safetensors file: {e}") from None
        if 8 + n + end > size:
            raise ConvertError(f"{f} is truncated: its tensors need {8 + n + end} bytes, the file has {size}")


def _hf_to_f32_gguf(src: Path, tmpdir: Path) -> Path:
    """Upstream's converter (tokenizer, metadata, tensor names) to an f32 GGUF."""
    out = tmpdir / "upstream-f32.gguf"
    if not UPSTREAM.is_file():
        raise ConvertError(f"an HF checkpoint input needs llama.cpp's converter ({UPSTREAM}), which a pykvq checkout "
                           "fetches into third_party/ (make fetch); convert a GGUF instead")
    cmd = [sys.executable, str(UPSTREAM), str(src), "--outfile", str(out), "--outtype", "f32"]
    log.info("running the pinned upstream converter: %s", " ".join(cmd[1:]))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not out.is_file():
        raise ConvertError(f"upstream convert_hf_to_gguf.py failed:\n{res.stderr.strip()[-3000:]}")
    return out


def _cast_weights(m: GGUFModel, outtype: str) -> None:
    from convert import rows
    for name, t in list(m.tensors.items()):
        if t.data.ndim == 2 and t.qtype.name == "F32" and not name.endswith(suffix(Tensors.ROPE_FREQS)):
            m.tensors[name] = rows.from_f32(name, t.data, outtype)


def _weights_all_f32(m: GGUFModel) -> bool:
    """Every matrix of the model is f32 (a dequantized file: matmuls do not round their activations)."""
    mats = [t for t in m.tensors.values() if t.data.ndim >= 2 and t.qtype not in INT_TYPES]
    return bool(mats) and all(t.qtype.name == "F32" for t in mats)


def _n_values(t) -> int:
    if not t.quantized:
        return int(t.data.size)
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[t.qtype]
    return int(t.data.size) // size * block


def _dequantize_weights(m: GGUFModel) -> int:
    """--dequantize: every floating-point or block-quantized tensor that is not f32 becomes f32 (values unchanged:
    quantized blocks decoded); integer tensors (the I8 nuq codebooks) keep their type, which the runtime reads."""
    from convert import rows
    n = 0
    for name, t in list(m.tensors.items()):
        if t.qtype.name != "F32" and t.qtype not in INT_TYPES:
            m.tensors[name] = rows.from_f32(name, rows.to_f32(t), "f32")
            n += 1
    return n


def _calibration_hf_dir(src: Path, args) -> Path:
    if args.hf_dir:
        return Path(args.hf_dir)
    from convert.hf_checkpoint import cached_dir, hf_checkpoint
    log.info("dequantizing %s to an HF checkpoint for calibration (%s, once)", src.name, cached_dir(src))
    return hf_checkpoint(src)


def _check_resources(gguf_path: Path, out: Path, runtime: bool, out_bytes: int | None = None) -> None:
    """Fail before any work when the output's disk cannot take about the input's size (out_bytes: what the
    output will take, where that differs), or (runtime calibration) memory cannot hold about the model: the
    message says how much is there and how much is needed."""
    import shutil
    need = gguf_path.stat().st_size
    where = out.parent if out.parent.exists() else Path(".")
    free = shutil.disk_usage(where).free
    out_need = need if out_bytes is None else out_bytes
    if free < out_need * 1.02 + (64 << 20):
        what = "the input's size" if out_bytes is None else "every weight in f32"
        raise ConvertError(f"not enough disk for {out.name}: {free / 2**30:.2f} GiB free in {where}, the output "
                           f"needs about {out_need / 2**30:.2f} GiB ({what})")
    if runtime:
        avail = _mem_available()
        if avail is not None and avail < need * 0.5:
            raise ConvertError(f"not enough memory to calibrate {gguf_path.name}: {avail / 2**30:.2f} GiB "
                               f"available, running the model needs about {need / 2**30:.2f} GiB")


def _default_sensitivity(m: GGUFModel, opts, hf_at_hand: bool, n_seq: int = 4, seq_len: int = 512) -> str:
    """Codebooks and --kv-bits budgets compare errors across layers and between K and V, which the forward weights
    cannot (Qwen2.5-Coder --kv-bits 3.6: KLD 0.104 forward vs 0.036 backprop), so they take the loss's gradients.
    From a GGUF: layer by layer in float32 (gradients: transformers' backward pass, one layer in memory at a time;
    the same gradients to 1e-4, Qwen2.5-Coder-1.5B --bits 3.5 in 174 s and 1.34 GiB where transformers took 513 s
    and 13 GB; that file's KLD 0.00850 against backprop's 0.00860, docs/RESULTS-BY-DATE.md 2026-11-30, late). An HF checkpoint at hand:
    transformers' backward pass, which costs no extra copy there. Where neither runs (another architecture, too
    little memory) a budget is priced by the runtime (probe) and codebooks take the forward weights."""
    if hf_at_hand:
        return "backprop"
    # --cpu-types' 3.5-bit pair has no codebooks but takes the gradients its nuq twin's codebooks take: the keys' scale
    # and importance layout from them read better (SmolLM2 q4t2_64 / tcq3_64 at 4096 tokens: 0.0101 against 0.0110)
    if not (opts.needs_fisher() or opts.cpu_types):
        return "forward"
    why_g = _gradients_unavailable(m, n_seq, seq_len)
    if why_g is None:
        return "gradients"
    why = _backprop_unavailable(m)
    if why is None:
        log.info("%s: --sensitivity backprop (transformers' backward pass)", why_g)
        return "backprop"
    choice = "probe" if opts.kv_bits is not None else "forward"
    log.info("%s; %s: --sensitivity %s (%s)", why_g, why, choice,
             "the budget priced in the runtime" if choice == "probe" else "forward channel weights")
    return choice


def _gradients_unavailable(m: GGUFModel, n_seq: int, seq_len: int) -> str | None:
    """Why convert/layer_gradients.py cannot run here, or None: its architectures, and memory for its pass
    (layer_gradients.peak_bytes) and 0.5 GiB (Qwen2.5-Coder-1.5B at 4 x 512 tokens: 0.93 GB measured, 1.7 GiB
    asked)."""
    from convert import layer_gradients
    why = layer_gradients.unavailable(m, seq_len)
    if why:
        return why
    need = layer_gradients.peak_bytes(m, n_seq, seq_len) + (1 << 29)
    avail = _mem_available()
    if avail is not None and avail < need:
        return f"the layer-by-layer gradients need about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB is available"
    return None


def _backprop_unavailable(m: GGUFModel) -> str | None:
    """Why the backward pass cannot run here, or None. Its memory (measured: Qwen2.5-Coder-1.5B 13.1 GB, SmolLM2
    4.7 GB) is taken as 2.2x the f32 weights + 4 GiB."""
    import importlib.util
    if m.arch not in SUPPORTED_ARCHS:
        return f"the backward pass runs llama / qwen2 only, not {m.arch}"
    for mod in ("torch", "transformers"):
        try:
            if importlib.util.find_spec(mod) is None:
                raise ImportError
        except (ImportError, ValueError):
            return f"{mod} is not installed (pip install 'pykvq[convert]' for the backward pass)"
    need = 2.2 * 4 * sum(_n_values(t) for t in m.tensors.values()) + (4 << 30)
    avail = _mem_available()
    if avail is not None and avail < need:
        return (f"the backward pass needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB is available")
    return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _runtime_calib(gguf_path: Path, m: GGUFModel, g, text: str, source: str, args, opts, progress,
                   unknown_arch: bool, tmp: str):
    """Calibration from the GGUF -> (Calib, the geometry with the runtime's rope layout): in pykvq's runtime
    (pykvq.calibrate), or with --sensitivity gradients in the layer-by-layer float32 pass that also takes the
    gradients (convert/layer_gradients.py)."""
    from convert import rows
    from pykvq import calibrate
    from pykvq.errors import PykvqError
    grads = st = None
    if args.sensitivity == "gradients" and opts.needs_gradients():
        # one float32 pass over the GGUF, a layer at a time, gives both the gradients and the statistics
        from convert import layer_gradients
        win = (opts.kv_sinks, opts.kv_window) if opts.window_weighted() else None
        lp = layer_gradients.collect_cached(gguf_path, text, n_seq=args.calib_seqs, seq_len=args.calib_len,
                                            window=win, samples=opts.needs_samples(), source=source,
                                            progress=progress)
        grads, st = lp.gradients, lp.stats
        log.info("gradients: %d tokens at %.1f tokens/s, layer by layer in float32 (mean loss %.3f)%s",
                 grads.n_seq * grads.seq_len, grads.tokens_per_s, grads.loss,
                 f"; only through the reads of quantized cells (sinks {opts.kv_sinks}, window {opts.kv_window})"
                 if opts.window_weighted() else "")
    try:
        # every token's Q / K / V stays in memory only (0.45 GB for a 1.5B model): the cache keeps the moments
        if st is None:
            st = calibrate.collect_cached(gguf_path, text, n_seq=args.calib_seqs, seq_len=args.calib_len,
                                          samples=opts.needs_samples(), source=source, progress=progress,
                                          cache_samples=False)
    except PykvqError as e:
        raise ConvertError(f"calibration in the runtime failed: {e}") from None
    if unknown_arch:
        g = g.with_layout(st.rope_layout)
    elif st.rope_layout != g.layout:
        raise ConvertError(f"the runtime rotates {g.arch}'s keys in the {st.rope_layout} layout, the converter "
                           f"expected {g.layout}")
    if st.n_rot != g.n_rot:
        raise ConvertError(f"the runtime's K RoPE turns {st.n_rot} of {g.head_dim} channels, the file says "
                           f"rope.dimension_count {g.n_rot}")
    v_sens = None
    if opts.needs_fisher():
        v_sens = [calib_mod.value_sensitivity(rows.to_f32(m.tensors[f"blk.{i}.attn_output.weight"]), g)
                  for i in range(g.n_layer)]
    if grads is None:
        log.info("calibration: %d tokens at %.0f tokens/s in the runtime (rope layout %s)",
                 st.n_seq * st.seq_len, st.tokens_per_s, st.rope_layout)
    price = report = None
    if args.sensitivity in ("probe", "measure") and opts.kv_bits is not None:
        from convert import slot_prices
        parked = Path(tmp) / "calibration.npz"     # the probe needs the moments only: the model runs beside less
        st.save(parked)
        for ls in st.layers:
            ls.samples = {}
        price, report = slot_prices.measure(gguf_path, text, st, g, v_sens, seq_len=args.probe_len,
                                            progress=progress)
        log.info("priced %d cache slots in the runtime: %d tokens in %.0f s", len(price), report["tokens"],
                 report["seconds"])
        st = calibrate.RuntimeStats.load(parked)
        parked.unlink()
    calib = calib_mod.from_runtime(st, g, v_sens, grads)
    calib.slot_price, calib.probe_report = price, report
    if args.sensitivity == "measure" and opts.kv_bits is not None:
        from convert import candidate_prices
        calib.candidates = candidate_prices.probe(gguf_path, text, st, g, calib.pos,
                                                  opts.kv_sinks if opts.prerope_k else 0, report, progress)
    return calib, g


def _fraction(v: str) -> float | str:
    if v == "auto":     # --kv-heavy auto
        return v
    try:
        f = float(v)
    except ValueError:
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction of the context in [0, 1] or auto, got {v}")
    return f


def _window_arg(v: str):
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of cells or auto, got {v!r}") from None


def _build(m: GGUFModel, opts, calib, g, args, hf: bool, out: Path, progress, last: bool = True):
    """Transform m (in place) for opts and write it to out; last: calib's samples may be dropped first."""
    rep = pipeline.apply(m, opts, calib, progress=progress, geometry=g)
    if calib is not None and last:  # every token's Q / K / V: not needed to write, and as large as a small model
        calib.q = calib.k = calib.v = calib.gk = calib.gv = None
    if hf:
        _cast_weights(m, "f16" if args.outtype == "auto" else args.outtype)
    if args.dequantize:
        n_deq = _dequantize_weights(m)
        log.info("dequantized %d weight tensors to f32 (--dequantize)", n_deq)
    total = sum(t.data.nbytes for t in m.tensors.values())
    from pykvq.progress import progress_bar
    bar = progress_bar(iter(()), desc=f"writing {out.name}", enable=progress, total=total, unit="B")
    write_gguf(m, out, progress=getattr(bar, "update", None))
    if hasattr(bar, "close"):
        bar.close()
    return rep


def _choose_window(wins: list, opts, calib, calibrate, g, gguf_path: Path, text: str, args, hf: bool,
                   out: Path, tmp: Path, progress, heavy: tuple = (), ladders=None):
    """--kv-window auto / --kv-heavy auto (window_choice.py): every candidate length's file made and judged at
    --kv-bits-ctx tokens on held-out calibration text, and at each length a file with each of heavy's fractions of
    heavy hitters (ladders(o): o's default ladders for its share of the budget); the best is renamed to out. wins:
    the lengths (window_choice.candidates, or the one given). Each file is built from the input read afresh (a
    fraction of a second), so no copy of its pages is held while the judge's runtime maps the same file.
    -> (the best's Report, its Options, the table)."""
    import dataclasses
    import os
    from convert import window_choice
    from convert.layer_gradients import release_heap
    from pykvq.errors import PykvqError
    tries = [dataclasses.replace(opts, kv_window=w) for w in wins]
    log.info("auto: trying %s at %d tokens", ", ".join(f"window {w}" for w in wins)
             + "".join(f", each without and with {h:g} heavy hitters" for h in heavy), opts.kv_bits_ctx)
    t0 = time.time()
    release_heap()      # what the calibration freed, before the reference model loads
    try:
        judge = window_choice.Judge(gguf_path, text, opts.kv_bits_ctx, args.calib_seqs, args.calib_len, progress)
    except PykvqError as e:
        raise ConvertError(f"--kv-window / --kv-heavy auto: the reference run failed: {e}") from None
    rows, best = [], None

    def judged(o, c, last: bool):
        nonlocal best
        name = f"window {o.kv_window}" + (f", heavy {o.kv_heavy:g}" if o.kv_heavy else "")
        path = tmp / f"window-{o.kv_window}-heavy-{o.kv_heavy:g}.gguf"
        rep = _build(read_gguf(gguf_path), o, c, g, args, hf, path, progress, last=last)
        release_heap()      # what the build freed, before the judge loads the file beside it
        try:
            kld = judge.kld(path)
        except PykvqError as e:
            raise ConvertError(f"--kv-window / --kv-heavy auto: running the {name} file failed: {e}") from None
        rows.append({"window": o.kv_window, "heavy": o.kv_heavy, "kld": kld, "bits_per_value": rep.bits_per_value})
        log.info("auto: %s: KLD %.5f on held-out calibration text", name, kld)
        if best is None or kld < best[0]:
            if best is not None:
                best[3].unlink()
            best = (kld, rep, o, path)
        else:
            path.unlink()

    for n, o in enumerate(tries):
        c = calib
        if n and calib is not None and calib.sensitivity != "forward":     # the backward pass is taken per window
            c, _ = calibrate(o)
        judged(o, c, last=n == len(tries) - 1 and not heavy)
        for i, h in enumerate(heavy):       # each length with them too: at 3 bits SmolLM2 gained at 64 and lost at 128
            oh = dataclasses.replace(o, kv_heavy=h)
            if ladders is not None:
                ladders(oh)
            if oh.cache_bits() < oh.cheapest_bits():
                log.info("auto: window %d with %g heavy hitters leaves the types %.3f bits, below the cheapest (%.3f): "
                         "not tried", o.kv_window, h, oh.cache_bits(), oh.cheapest_bits())
                continue
            judged(oh, c, last=n == len(tries) - 1 and i == len(heavy) - 1)    # the same window: the same calibration
    os.replace(best[3], out)
    return best[1], best[2], {"chosen": best[2].kv_window, "heavy": best[2].kv_heavy, "tried": rows,
                              "seconds": round(time.time() - t0, 1), "ctx": opts.kv_bits_ctx, "rows": judge.rows}


def _heavy(args, window: int) -> float:
    """The file's default heavy hitters (--kv-heavy, else none; auto: none until judged): they need the pre-RoPE
    keys' window."""
    exact = args.prerope_k and (args.kv_sinks > 0 or window > 0)
    if args.kv_heavy and not exact:
        raise ConvertError("--kv-heavy keeps heavy hitters beside the exact window: it needs --prerope-k and a window "
                           "(--kv-window or --kv-sinks > 0)")
    return 0.0 if args.kv_heavy in (None, "auto") else args.kv_heavy


def convert(args) -> dict:
    src, out = Path(args.src), Path(args.outfile)
    if not src.exists():
        raise ConvertError(f"input not found: {src}")
    if out.exists() and out.resolve() == src.resolve():
        raise ConvertError("the output would overwrite the input; choose another --outfile")
    if args.learn_steps < 0 or args.max_cond <= 1.0:
        raise ConvertError("--learn-steps must be >= 0 and --max-cond > 1")
    auto_window, auto_heavy = args.kv_window == "auto", args.kv_heavy == "auto"
    for flag, auto in (("--kv-window", auto_window), ("--kv-heavy", auto_heavy)):
        if auto and not (args.prerope_k and args.kv_bits is not None and args.kv_bits_ctx > 0):
            raise ConvertError(f"{flag} auto chooses {'the window' if flag == '--kv-window' else 'heavy hitters'} "
                               "with a budget's types for a context: it needs --prerope-k, --kv-bits B and "
                               "--kv-bits-ctx N")
    window = pipeline.Options.kv_window if auto_window else args.kv_window
    if not (0 <= args.kv_sinks < 2**31 and 0 <= window < 2**31):
        raise ConvertError(f"--kv-sinks and --kv-window must be >= 0, got {args.kv_sinks} and {args.kv_window}")
    if args.alpha is not None and not 0.0 <= args.alpha <= 1.0:
        raise ConvertError(f"--alpha must be in [0, 1], got {args.alpha}")
    opts = pipeline.Options(ksort=args.ksort, ksort_key=args.ksort_key, smooth_qk=args.smooth_qk,
                            alpha=args.alpha, rotate_v=args.rotate_v, cache_type_k=args.cache_type_k,
                            cache_type_v=args.cache_type_v, codebooks=args.codebooks, q_norm=not args.no_qnorm,
                            kv_bits=args.kv_bits, learn_k=args.learn_k, learn_steps=args.learn_steps,
                            max_cond=args.max_cond, learn_loss=args.learn_loss,
                            learn_init=args.learn_init, prerope_k=args.prerope_k,
                            prerope_scale=args.prerope_k_scale, prerope_power=args.prerope_k_power,
                            kv_sinks=args.kv_sinks, kv_window=window, kv_window_type=args.kv_window_type,
                            kv_heavy=_heavy(args, window),
                            kv_bits_ctx=args.kv_bits_ctx, budget_weights=args.kv_bits_weights,
                            ladder=(_types_list(args.layer_types) if args.layer_types is not None
                                    else pipeline.layer_types.VALUE_LADDER),
                            ladder_k=_key_ladder(args))
    # the defaults: the pre-RoPE K ladder may drop its split types, and both take their cheap steps below 3 bits
    opts.ladder_k_auto = args.layer_types_k is None and opts.ladder_k == pipeline.layer_types.PREROPE_K_LADDER
    ladder_v_auto = args.layer_types is None
    opts.cpu_types = args.cpu_types
    if opts.cpu_types and not (opts.kv_bits is not None and ladder_v_auto) and not args.cpu_types_pair:
        raise ConvertError("--cpu-types changes the default types of a budget or of the 3.5-bit preset: it needs "
                           "--kv-bits B or --bits B other than 4.5, and no --layer-types")
    if (opts.learn_k or opts.rotate_v == "learned") and args.calib_seqs < 2:
        raise ConvertError("learned transforms need at least 2 calibration sequences (one is held out): "
                           "--calib-seqs 2 or more")
    try:
        opts.resolved_types()
        opts.check_learning()
        for t in (*opts.ladder_for("k"), *opts.ladder_for("v")):
            pipeline.layer_types.bits_per_value(t)
        if args.kv_bits_ctx < 0:
            raise ValueError(f"--kv-bits-ctx must be >= 0, got {args.kv_bits_ctx}")
        if opts.kv_bits is not None:
            if auto_window:
                from convert import window_choice
                # the windows that leave the cheapest types the default ladders may take at this budget
                _default_ladders(opts, ladder_v_auto, opts.kv_bits)
                low = opts.cheapest_bits()
                wins = window_choice.candidates(opts.kv_bits, opts.kv_sinks, opts.kv_bits_ctx, low, opts.kv_window_type,
                                                opts.kv_heavy)
                if not wins:
                    raise ValueError(f"--kv-window auto: no window of {', '.join(map(str, window_choice.WINDOWS))} "
                                     f"leaves --kv-bits {opts.kv_bits} the cheapest of --layer-types ({low}) at "
                                     f"{opts.kv_bits_ctx} cells")
                opts.kv_window = wins[0]
            # the window's rows are known: q32_64 and nuq2_64 join the defaults below 3 bits, nuq2_64 K's below 2.625
            _default_ladders(opts, ladder_v_auto, opts.cache_bits())
            low = opts.cheapest_bits()
            if opts.cache_bits() < low:
                win = (f" (with the window's {opts.window_bits():.3f} bits at {opts.kv_bits_ctx} cells: "
                       f"{opts.cache_bits():.3f} for the cache)" if opts.window_bits() else "")
                raise ValueError(f"--kv-bits {opts.kv_bits}{win} is below the cheapest of --layer-types ({low})")
    except Exception as e:
        raise ConvertError(str(e)) from None
    progress = False if args.no_progress else None
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None, prefix=".pykvq-conv-") as tmp:
        hf = _is_hf_dir(src)
        if hf and args.dequantize:
            raise ConvertError("--dequantize takes a GGUF input; an HF checkpoint's weights are written as --outtype "
                               "(f32 for exact ones)")
        if hf:
            _check_safetensors(src)
            gguf_path = _hf_to_f32_gguf(src, Path(tmp))
            opts.requant_type = "f32"
        elif src.is_file():
            gguf_path = src
        else:
            raise ConvertError(f"{src} is neither a GGUF file nor an HF checkpoint directory (no config.json)")
        m = read_gguf(gguf_path)
        if not hf:
            # auto: q8_0, but an exact model stays exact (an f32 input, or one this run dequantizes)
            exact = args.dequantize or _weights_all_f32(m)
            opts.requant_type = ("f32" if exact else "q8_0") if args.outtype == "auto" else args.outtype
        if args.sensitivity is None:
            args.sensitivity = _default_sensitivity(m, opts, hf or bool(args.hf_dir), args.calib_seqs, args.calib_len)
        forward = args.sensitivity in ("forward", "probe", "measure", "gradients")     # calibrated from the GGUF
        # an architecture outside the converter's table: the pre-RoPE statistics, codebooks and a runtime-priced
        # budget (no weight transforms), with the layout the runtime's graph tells (checked against the file's rope
        # dimension count after calibration)
        runtime_only = opts.prerope_k and not (opts.ksort or opts.smooth_qk or opts.rotate_v != "none"
                                               or opts.learn_k)
        g = geometry(m, layout="norm" if forward and runtime_only else None)
        unknown_arch = g.arch not in SUPPORTED_ARCHS
        pipeline.check_file(m, opts, g)     # what the metadata rules out, before minutes of calibration
        _check_resources(gguf_path, out, forward and not hf,
                         4 * sum(_n_values(t) for t in m.tensors.values()) if args.dequantize else None)
        log.info("%s: %s, %d layers, %d q / %d kv heads, head_dim %d, n_rot %d, rope layout %s",
                 src.name, g.arch, g.n_layer, g.n_head, g.n_head_kv, g.head_dim, g.n_rot,
                 "from the runtime's graph" if unknown_arch else g.layout)
        needs_calib = (opts.smooth_qk or (opts.ksort and args.ksort_key == "calib") or args.calib is not None
                       or opts.needs_fisher() or opts.learn_k or opts.rotate_v == "learned" or opts.prerope_k)
        t1 = time.time()
        text = None
        if needs_calib:
            text, source = calib_mod.calibration_text(args.calib or "canterbury")
            log.info("calibrating on %s: %d x %d tokens (%s)", source, args.calib_seqs, args.calib_len,
                     {"gradients": "the GGUF layer by layer in float32, the loss's gradients",
                      "probe": "in pykvq's runtime, slots priced by its probe",
                      "measure": "in pykvq's runtime, candidates measured by it"}.get(
                         args.sensitivity, "in pykvq's runtime, forward sensitivities") if forward
                     else "transformers, backprop Fisher")

        def calibrate(o):
            if not needs_calib:
                return None, g
            if forward:     # m is None once --kv-window / --kv-heavy auto has let it go
                return _runtime_calib(gguf_path, m if m is not None else read_gguf(gguf_path), g, text, source, args,
                                      o, progress, unknown_arch, tmp)
            hf_dir = src if hf else _calibration_hf_dir(src, args)
            return calib_mod.collect_cached(hf_dir, text, g, n_seq=args.calib_seqs, seq_len=args.calib_len,
                                            source=source, progress=progress, fisher=o.needs_gradients(),
                                            window=(o.kv_sinks, o.kv_window) if o.window_weighted() else None), g

        calib, g = calibrate(opts)
        t_cal = time.time() - t1 if needs_calib else 0.0
        if auto_window or auto_heavy:
            m = None        # each candidate's model is read afresh: none held while the judge runs
            rep, opts, window_report = _choose_window(
                wins if auto_window else [opts.kv_window], opts, calib, calibrate, g, gguf_path, text, args,
                hf, out, Path(tmp), progress, heavy=(pipeline.HEAVY_TRIED,) if auto_heavy else (),
                ladders=lambda o: _default_ladders(o, ladder_v_auto, o.cache_bits()))
        else:
            rep, window_report = _build(m, opts, calib, g, args, hf, out, progress), None
    k, v = opts.resolved_types()
    if rep.layer_types_k:       # per-layer types: name the most common ones
        k = max(set(rep.layer_types_k), key=rep.layer_types_k.count)
        v = max(set(rep.layer_types_v), key=rep.layer_types_v.count)
    summary = {
        "output": str(out), "seconds": round(time.time() - t0, 1), "calibration_seconds": round(t_cal, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "transforms": {"ksort": opts.ksort, "smooth_qk": opts.smooth_qk, "rotate_v": opts.rotate_v,
                       "learn_k": opts.learn_k, "prerope_k": opts.prerope_k,
                       "relayout_neox_to_norm": opts.ksort and g.layout == "neox"},
        "cache_type_k": k, "cache_type_v": v, "alphas": rep.alphas, "requantized": rep.requantized,
        "codebooks": opts.codebook_method(), "q_norm": opts.q_norm, "kv_bits": opts.kv_bits,
        "layer_types_k": rep.layer_types_k, "layer_types_v": rep.layer_types_v, "cpu_types": opts.cpu_types,
        "bits_per_value": rep.bits_per_value,
        "window_bits": round(opts.window_bits(), 4) if opts.kv_bits is not None else None,
        "kv_bits_ctx": opts.kv_bits_ctx or None,
        "budget_weights": ("window" if opts.window_weighted() else "uniform") if opts.kv_bits is not None else None,
        "window_share": rep.window_share,
        "v_learned": [{"choice": r.choice, "cond": round(r.cond, 2), "heldout": r.heldout, "reason": r.reason,
                       "seconds": round(r.seconds, 2)} for r in rep.v_learned],
        "k_learned": [{"choice": r.choice, "heldout": r.heldout, "seconds": round(r.seconds, 2)}
                      for r in rep.k_learned],
        "inexact_block_scales": rep.scale_stats.get("inexact", 0), "block_scales": rep.scale_stats.get("fields", 0),
        "prerope_k": dict(rep.prerope) if opts.prerope_k else None,
        "sensitivity": args.sensitivity if calib is not None else None,
        "slot_prices": ({f"{i}{w}": round(v, 4) for (i, w), v in calib.slot_price.items()}
                        if calib is not None and calib.slot_price else None),
        "probe": calib.probe_report if calib is not None and calib.slot_price else None,
        "candidate_prices": calib.candidates.report if calib is not None and calib.candidates is not None else None,
        "calibration_tokens_per_s": round(calib.tokens_per_s, 1) if calib is not None and calib.tokens_per_s else None,
        "codebook_errors": rep.cb_errors,
        "window_choice": window_report,
    }
    return summary


def main(argv=None) -> int:
    """The command line (python convert/to_gguf.py, python -m convert.to_gguf, pykvq-convert)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        preset = apply_preset(args, parser)
        if preset:
            log.info("preset %s bits/value: %s", "4.5" if args.bits is None else f"{args.bits:g}", preset)
        s = convert(args)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    alphas = s["alphas"]
    a_txt = ""
    if alphas:
        a_txt = " alpha per layer: " + " ".join("-" if a is None else f"{a:.1f}" for a in alphas)
    print(f"wrote {s['output']} in {s['seconds']} s (calibration {s['calibration_seconds']} s, "
          f"peak RSS {s['peak_rss_mib']} MiB)")
    print(f"transforms: {', '.join(k for k, v in s['transforms'].items() if v and v != 'none') or 'none'}"
          f"{' (V: ' + s['transforms']['rotate_v'] + ')' if s['transforms']['rotate_v'] != 'none' else ''}; "
          + ("per-layer cache types (mostly " if s["layer_types_k"] else "prepared for ")
          + f"-ctk {s['cache_type_k']} -ctv {s['cache_type_v']}" + (")" if s["layer_types_k"] else ""))
    if s["layer_types_k"]:
        from collections import Counter
        for w in ("k", "v"):
            c = Counter(s[f"layer_types_{w}"])
            print(f"{w.upper()} cache per layer: " + ", ".join(f"{t} x{n}" for t, n in c.most_common()))
    from pykvq.cache_types import KVQ_TYPES
    types_k = s["layer_types_k"] or [s["cache_type_k"]]
    types_v = s["layer_types_v"] or [s["cache_type_v"]]
    cpu_only = sorted({t for t in types_k + types_v if t in KVQ_TYPES and not KVQ_TYPES[t].cuda})
    if cpu_only:
        lt = pipeline.layer_types
        if s["cpu_types"]:
            fix = "without --cpu-types"
        else:
            k_ladder = lt.PREROPE_K_LADDER if set(types_k) & set(pipeline.q53.HALVES_TYPES) else lt.DEFAULT_LADDER
            fix = f"with --layer-types-k {','.join(k_ladder)}"   # --layer-types alone would set K's ladder too
            if set(cpu_only) & set(types_v):
                fix += f" --layer-types {','.join(lt.VALUE_LADDER)}"
        print(f"{' / '.join(cpu_only)} have CPU kernels only: on a GPU keep this cache on the CPU (-nkvo), or "
              f"convert {fix}")
    if s["codebooks"] != "none":
        print(f"codebooks: {s['codebooks']}{' + Q-Norm' if s['q_norm'] else ''}"
              + (f"; {s['bits_per_value']:.3f} bits/value" if s["bits_per_value"] else "")
              + (f" + the window's {s['window_bits']:.3f} at {s['kv_bits_ctx']} cells" if s.get("window_bits") else ""))
    if s.get("probe"):
        r, pr = s["probe"], s["slot_prices"]
        top = sorted(pr, key=pr.get, reverse=True)[:4]
        when = "(cached)" if r.get("cached") else f"({r['tokens']} tokens, {r['seconds']:.0f} s)"
        print(f"budget prices measured in the runtime {when}: dearest "
              + ", ".join(f"{x[:-1]} {x[-1].upper()} {pr[x]:.2f}" for x in top) + " (mean 1)")
    if s.get("candidate_prices"):
        r = s["candidate_prices"]
        when = "cached" if r.get("cached") else f"{r['tokens']} tokens, {r['seconds']:.0f} s"
        print(f"budget: each slot's {r['candidates']} candidate types rounded and measured in the runtime ({when})")
    if s.get("window_choice"):
        r = s["window_choice"]
        heavy = f" and {r['heavy']:g} heavy hitters" if r.get("heavy") else ""
        print(f"window chosen: {r['chosen']} cells{heavy}, the lowest KLD at {r['ctx']} tokens on held-out calibration "
              f"text ({r['rows']} positions, {r['seconds']:.0f} s): "
              + ", ".join(f"{t['window']}{' + heavy %g' % t['heavy'] if t.get('heavy') else ''} {t['kld']:.4f}"
                          for t in r["tried"]))
    if s.get("budget_weights") == "window" and s["layer_types_k"] and not s.get("candidate_prices"):
        print("budget: counts the errors of reads the window leaves quantized (--kv-bits-weights window)")
    if s.get("window_share") and not s.get("candidate_prices"):
        print("budget weighs each token by the reads the window leaves quantized: share per layer, K "
              + " ".join(f"{w['k']:.2f}" for w in s["window_share"]) + "; V "
              + " ".join(f"{w['v']:.2f}" for w in s["window_share"]))
    if s["codebook_errors"] and not s["layer_types_k"]:
        tot = {}
        for per_layer in s["codebook_errors"]:
            for slot, e in per_layer.items():
                tot[slot] = tot.get(slot, 0.0) + e
        if tot:
            print("Fisher-weighted cache error (sum F (x - Q(x))^2 over layers, the loss-increase estimate): "
                  + ", ".join(f"{slot.split(':')[0].upper()} {slot.split(':')[1]} {e:.4g}" for slot, e in tot.items()))
    if s["prerope_k"]:
        p = s["prerope_k"]
        print(f"pre-RoPE key domain: on (the cache holds (k - mean) / scale before RoPE, turned by the online Hadamard "
              f"when K is quantized); "
              f"scale = {SCALE_TEXT[p['scale']].format(std=1 - 2 * p['power'], power=p['power'])}"
              + (f" (Fisher^{pipeline.prerope.FISHER_POWER:g} in the {p['power_layers']} layers whose keys take uniform "
                 f"blocks of {pipeline.prerope.FISHER_POWER_BITS:g} bits or more)" if p.get("power_layers") else "")
              + f"; {p['layers']} layers, largest |mean|/std "
              f"{p['max_mean_over_std']:.1f}, largest/median std in a head {p['max_std_spread']:.1f}")
        print(f"exact window by default: the first {p['kv_sinks']} positions and the last {p['kv_window']} cells of each "
              f"sequence in {p.get('kv_window_type', 'f16')} rows (pykvq.cache.kv_sinks / kv_window / kv_window_type; "
              "--kv-sinks / --kv-window / --kv-window-type at run time override it)"
              + (f", and {p['kv_heavy']:g} of each sequence's cells as heavy hitters (pykvq.cache.kv_heavy; --kv-heavy)"
                 if p.get("kv_heavy") else ""))
        from pykvq.cache_types import bits_per_value
        from pykvq.diagnose import outlook
        types = (s["layer_types_k"] + s["layer_types_v"] if s["layer_types_k"]
                 else [s["cache_type_k"], s["cache_type_v"]])
        print(outlook(float(np.mean([bits_per_value(t) for t in types])), p["kv_sinks"], p["kv_window"],
                      p.get("kv_window_type", "f16"), p.get("kv_heavy", 0.0)))
    if s["inexact_block_scales"]:
        print(f"smoothing rounded {s['inexact_block_scales']} of {s['block_scales']} f16 block scales "
              "(subnormal ones; each change < 6e-8)")
    for what, rows_, ref, fb in (("V transform", s["v_learned"], "hadamard", "Hadamard"),
                                 ("K pair transform", s["k_learned"], "initial", "its start")):
        if rows_:
            kept = sum(r["choice"] == "learned" for r in rows_)
            ratio = np.exp(np.mean([np.log(min(r["heldout"]["learned"], r["heldout"][ref]) / r["heldout"][ref])
                                    for r in rows_]))
            extra = f", largest cond(A) {max(r['cond'] for r in rows_):.1f}" if "cond" in rows_[0] else ""
            print(f"learned {what}: kept in {kept}/{len(rows_)} layers (held-out error vs {fb}: "
                  f"{ratio:.3f}x, geometric mean over layers){extra}, {sum(r['seconds'] for r in rows_):.0f} s")
    if s["requantized"]:
        print("requantized: " + "; ".join(s["requantized"]))
    if a_txt:
        print(a_txt.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
