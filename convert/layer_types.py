"""Per-layer cache types under a bits/value budget (KVQuant's mixed precision).

Every layer's K and V (a "slot") starts at the cheapest candidate type; the
slot whose next upgrade buys the largest drop in Fisher-weighted quantization
error per extra bit is upgraded, again and again, while the average
bits/value over all slots stays within the budget. The errors are
codebook.weighted_error: sum F (x - Q(x))^2 on calibration K/V as the cache
holds them, each nuq candidate with its own calibrated codebook.
"""
from __future__ import annotations

from pykvq import cache_types
from pykvq.errors import CacheTypeError

# the candidate types (bits/value: cache_types; q8_0 / q4_0 with a 2-byte scale per 32): K's default where keys are
# cached after RoPE, and the ladder --layer-types names for both
DEFAULT_LADDER = ("nuq2o", "nuq3", "nuq3o", "nuq4", "q8_0")
# a pre-RoPE file's keys add the types split by importance (q42_64 at 3.5 bits, q53_64 at 4.5):
# SmolLM2 / Qwen2.5-Coder-1.5B at 3.5 bits and 4096 tokens, KLD 0.0189 -> 0.0141 / 0.0118 -> 0.0093
PREROPE_K_LADDER = ("nuq2o", "nuq3", "q42_64", "nuq3o", "nuq4", "q53_64", "q8_0")
# q32_64 (3.0 bits) joins it where the cache's share of the budget is below its own bits: there the keys otherwise
# jump from nuq2o's 2.625 to 3.5. At --kv-bits 3.0 and 4096 tokens (window 64, cache 2.73 bits) it took
# Qwen2.5-Coder-1.5B from 0.0303 to 0.0263 KLD and SmolLM2 from 0.0371 to 0.0341 (window 16: 0.0238 -> 0.0203,
# 0.0316 -> 0.0313); at 3.5 bits (cache 3.23) one gained, one lost (0.00987 -> 0.00926, 0.0140 -> 0.0148)
Q32_BELOW = 3.0
# nuq2_64 (2.25 bits) joins K's ladder first where the cache's share is below nuq2o's 2.625, the cheapest key type
# otherwise (2.5-bit budgets; at 3.0 bits, a share of 2.73, SmolLM2's file lost 7% with it): --kv-bits 2.5
# --kv-bits-ctx 4096 --kv-window 16 went from 0.0910 to 0.0661 KLD on SmolLM2 and from 0.0454 to 0.0346 on
# Qwen2.5-Coder-1.5B, and the default window fits beside the cheapest pair (2.25 + 2.25)
K2_BELOW = 2.625


# the values' default candidates: nuq3_64 (3.25 bits, one scale per 64 values) beside nuq3, since after the online
# Hadamard a head's values share one spread (SmolLM2, K q8_0, every V layer one type, 4096 tokens: nuq3_64 0.00681
# KLD, nuq3 0.00665); below 3 bits nuq2_64 (2.25) joins before nuq2o, which frees bits for the keys (--kv-bits 3.0:
# SmolLM2 0.0341 -> 0.0263, Qwen2.5-Coder-1.5B 0.0207 -> 0.0153). Above it the budget underprices it: its errors cost
# more than their squares say (uniform V: 0.0250 against nuq2o's 0.0173, squared error only 1.26x), and at 3.5 bits
# SmolLM2 went 0.0140 -> 0.0176 with it.
VALUE_LADDER = ("nuq2o", "nuq3_64", "nuq3", "nuq3o", "nuq4", "q8_0")


# with --cpu-types, below 3 bits: the trellis-coded values (CPU kernels only) in place of nuq's
# (--kv-bits 3.0 at 4096 tokens: SmolLM2 0.0279 -> 0.0226, Qwen2.5-Coder-1.5B 0.0126 -> 0.0116; 2.5 bits 0.0686 ->
# 0.0618, 0.0341 -> 0.0307; docs/RESULTS-BY-DATE.md 2026-12-01)
CPU_VALUE_TYPES = {"nuq2_64": "tcq2_64", "nuq3_64": "tcq3_64"}
# (their one-byte scale codes make tcq2_64 / tcq3_64 0.125 bits/value cheaper than nuq's, and q4t2_64 / t32_64 0.125 /
# 0.25 cheaper than q42_64 / q32_64: --bits 3 --cpu-types at 4096 tokens 0.0108 -> 0.0092 KLD on Qwen2.5-Coder-1.5B,
# 0.0221 -> 0.0204 on SmolLM2; 2.5 bits 0.0250 -> 0.0214, 0.0571 -> 0.0404; docs/RESULTS-BY-DATE.md, 2026-12-07 fifth
# session)
# and the keys' split types with trellis-coded halves (q4t2_64: q42_64's 2-bit half; t32_64: both of
# q32_64's halves; fake-quant keys at 4096 tokens 0.0049 -> 0.0039 and 0.0168 -> 0.0100, docs/RESULTS-BY-DATE.md)
CPU_KEY_TYPES = {"q42_64": "q4t2_64", "q32_64": "t32_64"}
# and between tcq2_64 and tcq3_64 the trellis with 3 and 2 bits by turns (2.625 bits/value; on Gaussian blocks 0.82x
# the squared error of the two in equal parts)
CPU_VALUE_MID = "tcq25_64"
# tcq3_128 / tcq2_128 (one f16 scale per head row of 128) stay out of the ladders: since the trellis types store their
# scale as one byte, tcq*_64 costs the same bits (2.125 / 3.125) without the 128-wide scale's ~9% on real value rows


def value_ladder(cache_bits: float | None, cpu_types: bool = False) -> tuple:
    """The default V candidates for a budget whose cache (the window's rows taken out) gets cache_bits; cpu_types:
    a file for the CPU may take types without CUDA kernels (measured below 3 bits only)."""
    if cache_bits is not None and cache_bits < Q32_BELOW:
        ladder = ("nuq2_64",) + VALUE_LADDER
        if not cpu_types:
            return ladder
        cpu = tuple(CPU_VALUE_TYPES.get(t, t) for t in ladder)
        return cpu[:1] + (CPU_VALUE_MID,) + cpu[1:]
    return VALUE_LADDER


def prerope_k_ladder(cache_bits: float | None, cpu_types: bool = False) -> tuple:
    """The pre-RoPE default K candidates for a budget whose cache (the window's rows taken out) gets cache_bits;
    cpu_types: the split types with trellis-coded halves (CPU kernels only) in place of the scalar ones."""
    ladder = PREROPE_K_LADDER
    if cache_bits is not None and cache_bits < Q32_BELOW:
        ladder = PREROPE_K_LADDER[:1] + ("q32_64",) + PREROPE_K_LADDER[1:]
        ladder = ("nuq2_64",) + ladder if cache_bits < K2_BELOW else ladder
    return tuple(CPU_KEY_TYPES.get(t, t) for t in ladder) if cpu_types else ladder


def bits_per_value(type_name: str) -> float:
    try:
        return cache_types.bits_per_value(type_name)
    except CacheTypeError:
        raise ValueError(f"no bits/value known for {type_name!r}") from None


def assign(errors: dict, budget: float) -> dict:
    """errors: {slot: {type: error}} over each slot's own candidates (K and V may have different ladders);
    returns {slot: type} whose mean bits/value is <= budget (at least each slot's cheapest type)."""
    choice = {s: min(e, key=bits_per_value) for s, e in errors.items()}
    n = len(errors)
    spent = sum(bits_per_value(t) for t in choice.values())
    if spent / max(n, 1) > budget + 1e-9:
        low = ", ".join(sorted({f"{t}: {bits_per_value(t)}" for t in choice.values()}))
        raise ValueError(f"a budget of {budget} bits/value is below the cheapest types ({low})")
    while True:
        best = None
        for s, cur in choice.items():
            b0, e0 = bits_per_value(cur), errors[s][cur]
            for t, e in errors[s].items():
                db = bits_per_value(t) - b0
                if db <= 0 or (spent + db) / n > budget + 1e-9:
                    continue
                gain = (e0 - e) / db
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, s, t, db)
        if best is None:
            return choice
        _, s, t, db = best
        choice[s] = t
        spent += db


def mean_bits(choice: dict) -> float:
    return sum(bits_per_value(t) for t in choice.values()) / max(len(choice), 1)
