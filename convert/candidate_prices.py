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
from pathlib import Path
from typing import Callable

import numpy as np

from . import cache_domain, slot_prices
from .calib import hf_to_norm
from .gguf_io import ConvertError

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


def probe(gguf_path, text: str, st, g, pos: np.ndarray, sinks: int, probe_report: dict, progress) -> CandidateProbe:
    """The CandidateProbe of a conversion: st its calibration (pykvq.calibrate.RuntimeStats, whose windows the probe
    runs), pos the Calib's positions, sinks the file's exact sinks, probe_report slot_prices.measure's (its floor).
    Its KL divergences are kept in $PYKVQ_CACHE/calib/candidates, keyed by the changes themselves."""
    import hashlib

    from pykvq import calibrate, sensitivity
    from pykvq.errors import PykvqError
    if st.n_seq < SEQS or st.seq_len < LENGTH:
        raise ConvertError(f"--sensitivity measure runs the first {LENGTH} tokens of {SEQS} calibration sequences: "
                           f"calibrate with --calib-seqs {SEQS} --calib-len {LENGTH} or more")

    def run(deltas: dict) -> dict:
        h = hashlib.sha256(calibrate.cache_key(gguf_path, text, st.n_seq, st.seq_len, False).encode())
        for part in (Path(__file__).read_text(), Path(sensitivity.__file__).read_text()):
            h.update(part.encode())
        for k in sorted(deltas, key=str):
            h.update(str(k).encode())
            for a in deltas[k]:
                h.update(np.ascontiguousarray(a, np.float32).tobytes())

        def measure():
            try:
                return sensitivity.probe_deltas(gguf_path, text, deltas, n_seq=st.n_seq, seq_len=st.seq_len,
                                                use=SEQS, length=LENGTH, progress=progress)
            except PykvqError as e:
                raise ConvertError(f"pricing the candidate types in the runtime failed: {e}") from None
        got = slot_prices.cached_klds("candidates", h, deltas, measure)
        cp.report.update(candidates=len(deltas), tokens=got["tokens"], seconds=round(got["seconds"], 1),
                         cached=bool(got.get("cached")))
        return got

    floor = slot_prices.floor_at({int(i): v for i, v in probe_report["floor"].items()}, g.n_layer)
    to_file = hf_to_norm(g) if g.layout == "neox" else np.arange(g.head_dim)
    cp = CandidateProbe(CandidateProbe.rows_of(pos, SEQS, LENGTH), SEQS, LENGTH, to_file, sinks, run, floor)
    return cp
