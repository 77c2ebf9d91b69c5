"""KVCacheInfo: the exact geometry and size of a context's KV cache (what Model.kv_cache_info returns)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cache_types import bits_per_value


def window_bits(sinks: int, window: int, n_ctx: int, row_type: str = "f16", heavy: float = 0.0) -> float:
    """Bits per value the exact window adds at n_ctx cells: its rows (the sinks, the window and the row being
    written, and ceil(heavy * n_ctx) heavy hitters, in row_type: pykvq.cache.kv_window_type, f16 or q8_0) beside the
    quantized cache; 0 without a window (the runtime's own count)."""
    if not (sinks or window) or n_ctx <= 0:
        return 0.0
    n_heavy = min(math.ceil(heavy * n_ctx), n_ctx) if heavy > 0 else 0
    return bits_per_value(row_type) * (sinks + window + 1 + n_heavy) / n_ctx


def longest_window(bits: float, sinks: int, n_ctx: int, row_type: str = "f16") -> int | None:
    """The longest window whose rows (window_bits) cost at most bits per value at n_ctx cells, or None where not
    even the sinks and the row being written fit."""
    w = int(bits * n_ctx / bits_per_value(row_type) + 1e-9) - sinks - 1
    return w if w >= 0 else None


@dataclass(frozen=True)
class KVCacheInfo:
    """Exact KV-cache geometry and size of a context.

    The cache types can differ between layers (a GGUF's pykvq.cache.layer_types_k/v):
    type_k / type_v are then "mixed", layer_types holds each layer's (K, V) type and
    layer_bytes each layer's (K, V) bytes per token; the per-token-per-layer sizes are
    means over the layers, and total_bytes / bits_per_value are exact sums.
    """
    type_k: str
    type_v: str
    n_ctx: int
    n_layer: int            # layers with a KV cache
    n_embd_k_gqa: int       # K values per token per layer (n_head_kv * head_dim_k)
    n_embd_v_gqa: int
    bytes_k_per_token_layer: float
    bytes_v_per_token_layer: float
    bytes_f16_per_token_layer: int
    layer_types: tuple = ()     # ((type_k, type_v), ...) per layer with a KV cache
    layer_bytes: tuple = ()     # ((bytes K, bytes V) per token, ...) per layer with a KV cache

    @property
    def mixed(self) -> bool:
        return len(set(self.layer_types)) > 1

    @property
    def bytes_per_token_layer(self) -> float:
        return self.bytes_k_per_token_layer + self.bytes_v_per_token_layer

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token takes in all layers."""
        if self.layer_bytes:
            return sum(k + v for k, v in self.layer_bytes)
        return round(self.bytes_per_token_layer * self.n_layer)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.n_ctx

    @property
    def ratio_vs_f16(self) -> float:
        return self.bytes_per_token_layer / self.bytes_f16_per_token_layer

    @property
    def bits_per_value(self) -> float:
        """True average over all cached values (K and V, every layer)."""
        return 8 * self.bytes_per_token / (self.n_layer * (self.n_embd_k_gqa + self.n_embd_v_gqa))

    def type_summary(self, which: str = "k") -> str:
        """e.g. "nuq3 x28, q8_0 x2 (layers 0,27)"; just the type when all layers agree."""
        i = 0 if which.lower() == "k" else 1
        names = [t[i] for t in self.layer_types]
        if not names:
            return self.type_k if i == 0 else self.type_v
        counts = {}
        for il, n in enumerate(names):
            counts.setdefault(n, []).append(il)
        if len(counts) == 1:
            return names[0]
        order = sorted(counts.items(), key=lambda kv: -len(kv[1]))
        parts = [f"{order[0][0]} x{len(order[0][1])}"]
        parts += [f"{n} x{len(ls)} (layer{'s' if len(ls) > 1 else ''} {','.join(map(str, ls))})" for n, ls in order[1:]]
        return ", ".join(parts)

    def __str__(self) -> str:
        types = (f"K={self.type_summary('k')} V={self.type_summary('v')}" if self.mixed
                 else f"K={self.type_k} V={self.type_v}")
        return (f"KV cache {types}: {self.total_bytes / 2**20:.2f} MiB "
                f"for {self.n_ctx} tokens x {self.n_layer} layers "
                f"({self.bytes_per_token_layer:g} B/token/layer, {self.bits_per_value:.3f} bits/value, "
                f"{self.ratio_vs_f16:.3f}x f16 = {1 / self.ratio_vs_f16:.2f}x smaller)")
