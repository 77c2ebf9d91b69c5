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
from pykvq.ref import nuq

# bits/value of the candidate types (ggml blocks: 2-byte scale per 32 for q8_0 / q4_0)
DEFAULT_LADDER = ("nuq2o", "nuq3", "nuq3o", "nuq4", "q8_0")


def bits_per_value(type_name: str) -> float:
    try:
        return cache_types.bits_per_value(type_name)
    except CacheTypeError:
        raise ValueError(f"no bits/value known for {type_name!r}") from None


def assign(errors: dict, budget: float, ladder=DEFAULT_LADDER) -> dict:
    """errors: {slot: {type: error}} for every type of the ladder; returns {slot: type} whose
    mean bits/value is <= budget (at least the cheapest type everywhere)."""
    types = sorted(ladder, key=bits_per_value)
    cheapest = types[0]
    if budget < bits_per_value(cheapest):
        raise ValueError(f"a budget of {budget} bits/value is below the cheapest type "
                         f"({cheapest}: {bits_per_value(cheapest)})")
    choice = {s: cheapest for s in errors}
    n = len(errors)
    spent = bits_per_value(cheapest) * n
    while True:
        best = None
        for s, cur in choice.items():
            b0, e0 = bits_per_value(cur), errors[s][cur]
            for t in types:
                db = bits_per_value(t) - b0
                if db <= 0 or (spent + db) / n > budget + 1e-9:
                    continue
                gain = (e0 - errors[s][t]) / db
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, s, t, db)
        if best is None:
            return choice
        _, s, t, db = best
        choice[s] = t
        spent += db


def mean_bits(choice: dict) -> float:
    return sum(bits_per_value(t) for t in choice.values()) / max(len(choice), 1)
