"""Per-slot prices for --kv-bits from the runtime (--sensitivity probe): how much the loss moves per unit of
forward-weighted squared error in each layer's K and V.

The forward weights (calib.key_sensitivity / value_sensitivity) rank channels within a slot well but cannot
compare slots: they leave out how much of the loss flows through a layer's attention and what later layers make
of an error there (Qwen2.5-Coder --kv-bits 3.6: KLD 0.104 with them alone, 0.036 with the backward pass). So each
slot is measured once in the runtime (pykvq.sensitivity.probe): Gaussian noise of standard deviation alpha x the
channels' RMS spread per KV head, the KL divergence it causes, less the floor, divided by the noise's
forward-weighted power sum F sigma^2. The budget's errors of that slot are multiplied by it.

The floor: on a model with quantized weights any change of the cache, however small, moves the rounding of the
activations that later matmuls quantize (q8_1 / q8_K), which costs a KL divergence of its own (SmolLM2 Q4_1:
0.0036 from noise at layer 0, 0.0007 at layer 29, the same for K and V, whatever the noise's size). It is the
same for every cache type, so it is measured with tiny noise at a few layers, interpolated, and subtracted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .calib import key_sensitivity
from .geometry import Geometry
from .gguf_io import ConvertError

ALPHA = 0.3              # noise / spread: well above the floor, still quadratic (SmolLM2: 0.1 -> 0.3 gives 8-9x)
FLOOR_ALPHA = 0.003      # noise for the floor: its own effect ~1e-5 of the slots'
FLOOR_LAYERS = 4         # layers the floor is measured at (evenly spaced, both ends)


def spread(mean: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """[n_kv, 1] RMS over a head's channels of each channel's standard deviation (what a centred cache spans)."""
    return np.sqrt(np.maximum(sq - mean ** 2, 0).mean(axis=1, keepdims=True))


def sigmas(st, alpha: float, layers=None, whiches=("k", "v")) -> dict:
    """{(layer, which): sigma [n_kv, head_dim]} from pykvq.calibrate's RuntimeStats."""
    out = {}
    for i in (range(len(st.layers)) if layers is None else layers):
        ls = st.layers[i]
        for w in whiches:
            out[(i, w)] = np.broadcast_to(alpha * spread(ls.mean[w], ls.sq[w]), ls.sq[w].shape).astype(np.float32)
    return out


def noise_power(sigma: np.ndarray, fisher: np.ndarray) -> float:
    """sum F sigma^2 per token: the forward-weighted error the noise adds (as codebook.weighted_error counts it)."""
    return float((np.asarray(fisher, np.float64) * np.asarray(sigma, np.float64) ** 2).sum())


def floor_at(measured: dict, n_layer: int) -> np.ndarray:
    """The floor per layer, linear between the layers it was measured at ({layer: KLD})."""
    xs = sorted(measured)
    return np.interp(np.arange(n_layer), xs, [measured[x] for x in xs])


def prices(kld: dict, floor: np.ndarray, power: dict) -> dict:
    """{slot: KLD above the floor per unit of forward-weighted error}, normalized to a mean of 1. A slot whose noise
    did not rise above the floor gets a twentieth of the smallest measured price (cheap, not free)."""
    raw = {s: (kld[s] - floor[s[0]]) / max(power[s], 1e-30) for s in power}
    pos = [v for v in raw.values() if v > 0]
    if not pos:
        raise ConvertError("the runtime's probe saw no slot rise above the floor; use --sensitivity backprop")
    low = min(pos) / 20
    out = {s: max(v, low) for s, v in raw.items()}
    mean = float(np.mean(list(out.values())))
    return {s: v / mean for s, v in out.items()}


def measure(gguf_path, text: str, st, g: Geometry, v_sens: list, *, n_seq: int = 1, seq_len: int = 512,
            progress=None) -> tuple[dict, dict]:
    """(prices {(layer, "k" | "v"): float}, a report) for every slot of the model, measured in the runtime.
    v_sens: per layer value_sensitivity [n_kv, head_dim] (channel order does not matter: sigma is per head)."""
    n = len(st.layers)
    sig = sigmas(st, ALPHA)
    floor_layers = sorted({round(x) for x in np.linspace(0, n - 1, min(FLOOR_LAYERS, n))})
    probes = dict(sig)
    tiny = sigmas(st, FLOOR_ALPHA, floor_layers, ("k",))
    probes.update({(i, "k", "floor"): s for (i, _), s in tiny.items()})
    got = _probe_cached(gguf_path, text, probes, n_seq, seq_len, progress)
    floor = floor_at({i: got[(i, "k", "floor")] for i in floor_layers}, n)
    power = {}
    for (i, w), s in sig.items():
        f = key_sensitivity(st.layers[i].sq["q"], g) if w == "k" else v_sens[i]
        power[(i, w)] = noise_power(s, f)
    kld = {s: got[s] for s in sig}
    p = prices(kld, floor, power)
    report = {"seconds": round(got["seconds"], 1), "tokens": got["tokens"], "alpha": ALPHA,
              "cached": bool(got.get("cached")),
              "floor": {int(i): round(float(floor[i]), 6) for i in floor_layers},
              "kld": {f"{i}{w}": round(v, 6) for (i, w), v in kld.items()}}
    return p, report


def cached_klds(folder: str, h, keys, measure) -> dict:
    """measure() ({key: KLD, "seconds": s, "tokens": n}), kept in $PYKVQ_CACHE/calib/<folder>/ under the hash h
    (hashlib) of what decides it: conversions of one model at several budgets measure once. A damaged entry, or one
    for other keys, is measured again; the entry is written atomically."""
    import json

    from pykvq.paths import cache_dir
    f = cache_dir() / "calib" / folder / f"{h.hexdigest()[:24]}.json"
    if f.is_file():
        try:
            rows = json.loads(f.read_text())
            got = {tuple(r["key"]): r["kld"] for r in rows["slots"]}
            if set(got) == set(keys):
                return {**got, "seconds": rows["seconds"], "tokens": rows["tokens"], "cached": True}
        except (ValueError, KeyError, TypeError):
            pass                                     # a damaged entry: measure again
    got = measure()
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f.name + ".tmp")
    tmp.write_text(json.dumps({"seconds": got["seconds"], "tokens": got["tokens"],
                               "slots": [{"key": list(k), "kld": v} for k, v in got.items() if isinstance(k, tuple)]}))
    tmp.replace(f)
    return got


def _probe_cached(gguf_path, text: str, probes: dict, n_seq: int, seq_len: int, progress) -> dict:
    """pykvq.sensitivity.probe, kept in $PYKVQ_CACHE/calib/prices. Keyed by the model, text and windows
    (pykvq.calibrate.cache_key), the noise, and this code."""
    import hashlib

    from pykvq import calibrate, sensitivity
    from pykvq.errors import PykvqError
    h = hashlib.sha256(calibrate.cache_key(gguf_path, text, n_seq, seq_len, False).encode())
    for part in (Path(__file__).read_text(), Path(sensitivity.__file__).read_text()):
        h.update(part.encode())
    for k in sorted(probes, key=str):
        h.update(f"{k}".encode() + np.ascontiguousarray(probes[k], np.float32).tobytes())

    def measure():
        try:
            return sensitivity.probe(gguf_path, text, probes, n_seq=n_seq, seq_len=seq_len, progress=progress)
        except PykvqError as e:
            raise ConvertError(f"pricing the layers in the runtime failed: {e}") from None
    return cached_klds("prices", h, probes, measure)
