"""Diagnose, then prescribe: what a KL divergence against an f16 cache says about a setting, and the command that
fixes a broken one. Pure functions of what a run measured and what the file holds (pykvq kld prints them)."""
from __future__ import annotations

from dataclasses import dataclass

# Mean KLD against f16 (WikiText-2, CPU): stock q8_0 caches give 0.004-0.005 on the suite's models at 512 tokens;
# stock q4_0 0.044 on SmolLM2, while on Qwen2.5 post-RoPE 4-bit keys give 5.6 (README). Above BROKEN the
# next-token distribution is lost; above FAR a setting is an order of magnitude behind q8_0.
Q8_0_KLD = 0.005
# largest |mean| / std of a pre-RoPE key channel on 256 tokens of WikiText-2: Qwen2.5-Coder-1.5B 359 (stock q4_0
# KLD 5.7: broken), SmolLM2 16.9 (0.044), gemma3-270m 9.3 (0.096); in the hundreds post-RoPE 4-bit keys break the
# model, since RoPE spins the mean into every block
KEY_OUTLIER = 100.0
FAR = 10 * Q8_0_KLD
BROKEN = 0.5
UNQUANTIZED = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Run:
    model: str                 # the GGUF the run read
    cache_type_k: str
    cache_type_v: str
    k_domain: str              # Model.k_domain: 'pre-RoPE', 'centred post-RoPE' or 'post-RoPE'
    prepared: bool             # the file holds a pre-RoPE key cache's statistics (pykvq.cache.k_domain = prerope)
    mean_kld: float
    file_types: tuple[str, str] | None = None   # the types a converted file was prepared for (pykvq.cache.type_k/v)
    fallback_codebooks: int = 0                 # nuq layers of the run on the built-in codebook, not the file's


def advice(r: Run) -> str | None:
    """A few lines for a run whose KLD says the setting is broken or far behind q8_0; None when it is fine."""
    if r.mean_kld < FAR:
        return None
    level = ("breaks the model: the next-token distribution is lost" if r.mean_kld >= BROKEN
             else f"is {r.mean_kld / Q8_0_KLD:.0f}x a stock q8_0 cache's typical error (~{Q8_0_KLD})")
    lines = [f"diagnosis: KLD {r.mean_kld:.4g} {level}."]
    quant_k = r.cache_type_k not in UNQUANTIZED
    if quant_k and r.k_domain == "post-RoPE" and not r.prepared:
        lines += ["likely cause: quantized keys after RoPE. Keys with a few channels of large mean (Qwen2.5's key "
                  "biases) lose them, since RoPE spins those means into every block; or the type is too narrow.",
                  f"fix: pykvq-convert {r.model} -o {_stem(r.model)}-kvq.gguf    # pre-RoPE keys, the 4.5-bit preset",
                  f"     pykvq kld -m {_stem(r.model)}-kvq.gguf                  # then measure it (types from the file)"]
    elif quant_k and r.prepared and r.k_domain != "pre-RoPE":
        lines += [f"cause: this file was prepared for pre-RoPE keys, but the run cached them {r.k_domain} "
                  "(--kv-domain, or a backend that cannot run them; the log says which).",
                  "fix: run it with --kv-domain pre (the default), and -nkvo where a GPU layer falls back to post-RoPE."]
    elif r.file_types and r.file_types != (r.cache_type_k, r.cache_type_v):
        fk, fv = r.file_types
        lines += [f"cause: this file was converted for -ctk {fk} -ctv {fv} (its codebooks and key scales fit those "
                  f"types); this run used -ctk {r.cache_type_k} -ctv {r.cache_type_v}"
                  + (f", and {r.fallback_codebooks} nuq caches fell back to the built-in codebook" if r.fallback_codebooks
                     else "") + ".",
                  f"fix: pykvq kld -m {r.model}    # the file's own types (no -ctk / -ctv)",
                  f"     or convert the original model for these types: pykvq-convert MODEL.gguf -o OUT.gguf "
                  f"--prerope-k --cache-type-k {r.cache_type_k} --cache-type-v {r.cache_type_v}"]
    elif r.cache_type_v not in UNQUANTIZED and r.cache_type_k in UNQUANTIZED:
        lines += ["cause: the values; try a wider V type (q8_0, nuq4) or pykvq-convert's --bits budget."]
    else:
        lines += ["fix: fewer layers at the narrowest types: pykvq-convert "
                  f"{r.model} -o {_stem(r.model)}-kvq.gguf --bits B with a larger B, or the 4.5-bit preset (no --bits)."]
    return "\n".join(lines)


def _stem(path: str) -> str:
    """The output's name for a fix: the input's file name, in the current directory (not beside a cached model)."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return name[:-5] if name.endswith(".gguf") else name


def key_outliers(stats) -> float:
    """Largest |mean| / std over every layer's pre-RoPE key channels (pykvq.calibrate.RuntimeStats)."""
    import numpy as np
    worst = 0.0
    for layer in stats.layers:
        mean, sq = np.asarray(layer.mean["k"]), np.asarray(layer.sq["k"])
        std = np.sqrt(np.maximum(sq - mean**2, 0.0))
        std = np.maximum(std, 1e-3*max(float(np.median(std)), 1e-12))   # a constant channel is not an outlier of scale
        worst = max(worst, float(np.abs(mean / std).max()))
    return worst


# What a pykvq-converted (pre-RoPE) file gives: mean KLD against f16 at 4096 tokens as a multiple of stock q8_0's, on
# SmolLM2-135M and Qwen2.5-Coder-1.5B (README's table), by the bits/value the file spends there, its window counted
EXPECTED_KLD = ((4.4, "about stock q8_0's (0.9-1.4x q8_0 on the suite's models)"),
                (3.45, "2-4x stock q8_0's"),
                (2.95, "3-8x stock q8_0's"),
                (2.45, "8-19x stock q8_0's"),
                (0.0, "more than 19x stock q8_0's (not measured below 2.5 bits)"))


def outlook(bits: float, sinks: int, window: int, row_type: str = "f16", heavy: float = 0.0) -> str:
    """What a converted file will do: its bits/value at 4k and 32k cells, exact window and heavy hitters counted (rows
    of row_type), and the mean KLD class those bits gave on the suite's models. bits: the quantized cache's own mean
    over K and V."""
    from .cache_info import window_bits
    at = {n: bits + window_bits(sinks, window, n, row_type, heavy) for n in (4096, 32768)}
    win = f"exact window: first {sinks} + last {window} cells ({row_type})" if sinks or window else "no exact window"
    win += f" + {heavy:g} of the cells as heavy hitters" if heavy and (sinks or window) else ""
    quality = ("none from the cache (not quantized)" if bits >= 16 else
               next(text for floor, text in EXPECTED_KLD if at[4096] >= floor))
    return (f"outlook: {bits:.2f} bits/value in the cache, {win}: {at[4096]:.2f} bits/value at 4k tokens, "
            f"{at[32768]:.2f} at 32k; expected mean KLD against f16 at 4k: {quality}")


def file_advice(model: str, prepared: bool, outlier: float | None) -> str:
    """What pykvq info says of a file: prepared for a pre-RoPE key cache, or not, and whether its keys need it."""
    if prepared:
        return "keys: the file holds a pre-RoPE key cache's statistics (run it with -fa on; its cache types are in the file)"
    if outlier is None:
        return ("keys: not prepared by pykvq-convert (--check-keys measures whether 4-bit keys would break it; "
                f"pykvq-convert {model} -o {_stem(model)}-kvq.gguf prepares it)")
    if outlier >= KEY_OUTLIER:
        return (f"keys: channels with |mean|/std up to {outlier:.0f}: quantized post-RoPE keys (stock q4_0 too) will "
                f"likely break this model.\nfix: pykvq-convert {model} -o {_stem(model)}-kvq.gguf    # pre-RoPE keys")
    return (f"keys: largest channel |mean|/std {outlier:.1f}: 4-bit keys work post-RoPE; pykvq-convert {model} -o "
            f"{_stem(model)}-kvq.gguf still halves their error")
