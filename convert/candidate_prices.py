"""Per-slot candidate costs for --kv-bits measured in the runtime: each layer's K or V rounded to each of its
candidate types, every other slot exact, and the KL divergence that causes.

--sensitivity probe prices a slot with Gaussian noise and carries that price over to the candidates' squared
errors; that misjudges errors of another shape (a block's largest value kept exactly by an outlier type, which
matters more to the softmax than its share of the squared error) and the tokens that carry them. Here the
candidate's own rounding of the calibration samples, as the converted file's cache will hold them (codebooks,
pre-RoPE centring, online Hadamard), is mapped back through every transform to the unconverted model's K (after
RoPE) and V nodes (cache_domain.key_error_to_model / value_error_to_model), and the runtime adds it there
(pykvq.sensitivity.probe_deltas). Its KL divergence less the floor (slot_prices: what any change costs a model
with quantized weights) is the candidate's cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import cache_domain

SEQS = 2            # calibration sequences the probe runs ...
LENGTH = 256        # ... the first LENGTH tokens of each, scored on their second half (as slot_prices' probe)


@dataclass
class CandidateProbe:
    rows: np.ndarray                    # calibration rows the probe runs: the first `length` of `use` windows
    use: int
    length: int
    to_file: np.ndarray                 # NORM channel c is the file's channel to_file[c]
    sinks: int                          # positions the runtime keeps exact (no change there)
    run: Callable[[dict], dict]         # {key: [per-sequence change]} -> {key: KL divergence}
    floor: np.ndarray | None = None     # per layer (slot_prices.floor_at)
    deltas: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)     # what run() says: candidates, tokens, seconds, cached

    @staticmethod
    def rows_of(pos: np.ndarray, use: int, length: int) -> np.ndarray:
        starts = np.flatnonzero(pos == 0)[:use]
        return np.concatenate([s + np.arange(length) for s in starts])

    def add(self, layer: int, which: str, type_name: str, x: np.ndarray, y: np.ndarray, pos: np.ndarray, g,
            dom) -> None:
        """Candidate type_name of slot (layer, which): x the cache-domain samples of self.rows, y their rounding."""
        e = (y - x).astype(np.float32)
        e[pos < self.sinks] = 0
        if which == "k":
            d = cache_domain.key_error_to_model(e, pos, g, dom, self.to_file)
        else:
            d = cache_domain.value_error_to_model(e, g, dom)
        self.deltas[(layer, which, type_name)] = list(d.reshape(self.use, self.length, *d.shape[1:]))

    def costs(self) -> dict:
        """{(layer, which, type): KL divergence above the floor} (a twentieth of the smallest positive one where
        the change did not rise above it)."""
        kld = self.run(self.deltas)
        raw = {k: kld[k] - (self.floor[k[0]] if self.floor is not None else 0.0) for k in self.deltas}
        pos = [v for v in raw.values() if v > 0]
        low = min(pos) / 20 if pos else 1e-9
        return {k: max(v, low) for k, v in raw.items()}
