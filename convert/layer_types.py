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

# the candidate types (bits/value: cache_types; q8_0 / q4_0 with a 2-byte scale per 32)
DEFAULT_LADDER = ("nuq2o", "nuq3", "nuq3o", "nuq4", "q8_0")
# a pre-RoPE file's keys add the types split by importance (q42_64 at 3.5 bits, q53_64 at 4.5):
# SmolLM2 / Qwen2.5-Coder-1.5B at 3.5 bits and 4096 tokens, KLD 0.0189 -> 0.0141 / 0.0118 -> 0.0093
PREROPE_K_LADDER = ("nuq2o", "nuq3", "q42_64", "nuq3o", "nuq4", "q53_64", "q8_0")
# q32_64 (3.0 bits) is not in it: --layer-types-k can add it. At 3.0 bits and 4096 tokens it takes
# Qwen2.5-Coder-1.5B from 0.0238 to 0.0203 (3.5 bits: 0.00987 -> 0.00926) and leaves SmolLM2 where it was (0.0316 /
# 0.0313; 3.5 bits 0.0140 -> 0.0148)


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
