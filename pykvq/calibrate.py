"""Calibration inside the runtime: per layer, the statistics of pre-RoPE Q and K and of V on calibration text.

    stats = pykvq.calibrate.collect("model.gguf", text, n_seq=4, seq_len=512)
    pykvq calibrate model.gguf -o stats.npz                  # the same from the command line

The GGUF runs in the patched llama.cpp with its own quantized, memory-mapped weights; the graph's eval
callback (native/llama/llama-kvq-calib.cpp) hands over each layer's ROPE inputs and V, as llama-imatrix gathers
its statistics. Memory is what running the model takes, speed is prefill speed, and every architecture the
runtime runs with a ROPE op is covered. The converter calibrates this way by default (convert/calib.py).

Channels are in the GGUF's own order (for a NEOX model HF's order; for llama's GGUFs the interleaved pairs).
With samples=True every token's Q / K / V is kept as well (what smoothing, learned transforms and codebooks fit on).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._lib import ffi
from .errors import PykvqError
from .progress import progress_bar

WHICH = ("q", "k", "v")
ROPE_LAYOUTS = {0: "norm", 2: "neox"}                      # GGML_ROPE_TYPE_NORMAL / _NEOX
ROPE_MODE_NAMES = {8: "multimodal M-RoPE", 24: "vision", 40: "interleaved M-RoPE"}


class CalibrationError(PykvqError):
    """The runtime could not gather calibration statistics from this model; the message says why."""


@dataclass
class LayerStats:
    """One layer's channels ([n_head, head_dim] each): means of x and x^2, and the extremes, over n tokens."""
    n: int
    mean: dict                      # "q" / "k" / "v" -> float64 [n_head, head_dim]
    sq: dict                        # mean of squares, same shapes
    lo: dict                        # smallest value, float32
    hi: dict                        # largest value
    samples: dict = field(default_factory=dict)   # with samples=True: float32 [T, n_head, head_dim]


@dataclass
class RuntimeStats:
    layers: list[LayerStats]
    n_seq: int
    seq_len: int
    source: str = ""
    seconds: float = 0.0
    rope_layout: str = ""           # "norm" / "neox": how the model's K ROPE pairs channels (from the graph)
    n_rot: int = 0                  # channels it rotates

    @property
    def tokens_per_s(self) -> float:
        return self.n_seq * self.seq_len / self.seconds if self.seconds > 0 else 0.0

    def save(self, path: str | os.PathLike, samples: bool = True) -> None:
        """samples=False: the moments only."""
        arrays = {"meta": np.array([self.n_seq, self.seq_len, self.seconds, self.n_rot], np.float64),
                  "source": np.array(self.source), "rope_layout": np.array(self.rope_layout)}
        for i, ls in enumerate(self.layers):
            arrays[f"n{i}"] = np.array(ls.n)
            for w in ls.mean:
                for what in ("mean", "sq", "lo", "hi", "samples")[:5 if samples else 4]:
                    d = getattr(ls, what)
                    if w in d:
                        arrays[f"{what}.{w}{i}"] = d[w]
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RuntimeStats":
        z = np.load(path)
        layers, i = [], 0
        while f"n{i}" in z:
            ls = LayerStats(int(z[f"n{i}"]), {}, {}, {}, {})
            for what in ("mean", "sq", "lo", "hi", "samples"):
                for w in WHICH:
                    if f"{what}.{w}{i}" in z:
                        getattr(ls, what)[w] = z[f"{what}.{w}{i}"]
            layers.append(ls)
            i += 1
        n_seq, seq_len, seconds, n_rot = z["meta"]
        return cls(layers, int(n_seq), int(seq_len), str(z["source"]), float(seconds), str(z["rope_layout"]),
                   int(n_rot))


def windows(tokens, n_seq: int, seq_len: int) -> list:
    """n_seq windows of seq_len tokens spread evenly over the tokens (a list or an array; the same rule for both
    calibrations, pykvq's runtime and convert/calib.py's transformers pass)."""
    if len(tokens) < n_seq * seq_len:
        raise CalibrationError(f"calibration text too short: {len(tokens)} tokens, need {n_seq * seq_len} "
                               f"({n_seq} x {seq_len})")
    stride = len(tokens) // n_seq
    return [tokens[i * stride: i * stride + seq_len] for i in range(n_seq)]


def collect(model_path: str | os.PathLike, text: str, *, n_seq: int = 4, seq_len: int = 512,
            samples: bool = False, source: str = "", progress: bool | None = None,
            n_threads: int | None = None) -> RuntimeStats:
    """Statistics of every layer's pre-RoPE Q / K and V over n_seq windows of text (each its own sequence,
    positions from 0). The text is tokenized by the model's own tokenizer; a model that adds BOS gets one first in
    each window, as it runs in use."""
    from ._lib import lib
    from .model import Model
    if n_seq < 1 or seq_len < 2:
        raise CalibrationError(f"need at least one sequence of 2 tokens, got {n_seq} x {seq_len}")
    L = lib()
    calib = L.llama_kvq_calib_init(bool(samples))
    m = None
    try:
        m = Model(model_path, n_ctx=seq_len, n_batch=seq_len, cache_type_k="f16", cache_type_v="f16",
                  n_threads=n_threads, _calibration=calib)
        seqs = windows(m.tokenize(text, add_special=False), n_seq, seq_len - 1 if m.add_bos else seq_len)
        if m.add_bos:               # as the model runs in use: a BOS first (its attention sink) where it wants one
            seqs = [[m.bos] + s for s in seqs]
        t0 = time.time()
        bar = progress_bar(seqs, desc="calibrating", enable=progress, unit="seq")
        for i, s in enumerate(bar):
            m.reset()
            m._decode(s, 0)
            if not L.llama_kvq_calib_end_batch(calib):
                raise CalibrationError(f"{Path(model_path).name}: {ffi.string(L.llama_kvq_calib_error(calib)).decode()}")
            if hasattr(bar, "set_postfix_str"):
                rate = (i + 1) * seq_len / max(time.time() - t0, 1e-9)
                bar.set_postfix_str(f"{rate:.0f} tok/s")
        seconds = time.time() - t0
        n_layer = m.n_layer
        m.close()                   # the model's memory goes before the samples are copied out of the collector
        m = None
        layers = _read(L, calib, n_layer, Path(model_path).name)
        mode, n_dims = ffi.new("int32_t *"), ffi.new("int32_t *")
        L.llama_kvq_calib_rope(calib, mode, n_dims)
        if mode[0] not in ROPE_LAYOUTS:
            raise CalibrationError(f"{Path(model_path).name}: its keys rotate with RoPE mode {mode[0]} "
                                   f"({ROPE_MODE_NAMES.get(mode[0], 'unknown')}); pykvq's pre-RoPE cache handles "
                                   "standard RoPE only (normal or neox)")
        return RuntimeStats(layers, n_seq, seq_len, source, seconds, ROPE_LAYOUTS[mode[0]], int(n_dims[0]))
    finally:
        if m is not None:
            m.close()
        L.llama_kvq_calib_free(calib)


def _read(L, calib, n_layer: int, name: str) -> list[LayerStats]:
    seen = L.llama_kvq_calib_n_layer(calib)
    if seen == 0:
        raise CalibrationError(f"{name}: no layer's Q / K reached a ROPE node named Qcur-N / Kcur-N; this "
                               "architecture has no standard RoPE attention the calibration can read")
    out = []
    hd, nh, nt = ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int64_t *")
    for il in range(n_layer):
        got = {}
        for wi, w in enumerate(WHICH):
            if il < seen and L.llama_kvq_calib_shape(calib, il, wi, hd, nh, nt):
                got[w] = (int(hd[0]), int(nh[0]), int(nt[0]))
        missing = [w.upper() for w in WHICH if w not in got]
        if missing:
            raise CalibrationError(f"{name}: layer {il} gave no pre-RoPE {'/'.join(missing)} (only layers with "
                                   "standard RoPE attention, Q/K named Qcur-N / Kcur-N, are supported)")
        n = got["k"][2]
        ls = LayerStats(n, {}, {}, {}, {})
        for wi, w in enumerate(WHICH):
            h, heads, t = got[w]
            shape = (heads, h)
            for what, dt, dst in (("sum", np.float64, ls.mean), ("sq", np.float64, ls.sq),
                                  ("min", np.float32, ls.lo), ("max", np.float32, ls.hi)):
                a = np.empty(heads * h, dt)
                L.llama_kvq_calib_get(calib, il, wi, what.encode(), ffi.from_buffer(a), a.size)
                a = a.reshape(shape)
                dst[w] = a / t if what in ("sum", "sq") else a
            k = L.llama_kvq_calib_get(calib, il, wi, b"samples", ffi.NULL, 0)
            if k > 0:
                a = np.empty(k, np.float32)
                L.llama_kvq_calib_get(calib, il, wi, b"samples", ffi.from_buffer(a), k)
                ls.samples[w] = a.reshape(t, heads, h)
        out.append(ls)
    return out


def cache_key(model_path: str | os.PathLike, text: str, n_seq: int, seq_len: int, samples: bool) -> str:
    """What a cached result depends on: the model file, the text, the windows, and the code that gathers them
    (this module and the library it runs), so a changed collector never hides behind a warm cache."""
    import hashlib
    from ._lib import lib_path
    p = Path(model_path).resolve()
    st, ls = p.stat(), lib_path().stat()
    h = hashlib.sha256()
    for part in (str(p), f"{st.st_size}/{st.st_mtime_ns}", text, f"{n_seq}/{seq_len}/{int(samples)}",
                 Path(__file__).read_text(), f"{ls.st_size}/{ls.st_mtime_ns}"):
        h.update(part.encode("utf-8", "replace"))
    return h.hexdigest()[:24]


def collect_cached(model_path: str | os.PathLike, text: str, *, n_seq: int = 4, seq_len: int = 512,
                   samples: bool = False, source: str = "", progress: bool | None = None,
                   cache_samples: bool = True) -> RuntimeStats:
    """collect(), kept in $PYKVQ_CACHE/calib/runtime: several conversions of one model calibrate once.
    cache_samples=False keeps the moments only (kilobytes; every token's Q / K / V is ~0.45 GB for a 1.5B model)."""
    from .paths import cache_dir
    d = cache_dir() / "calib" / "runtime"
    keys = [cache_key(model_path, text, n_seq, seq_len, s) for s in ((True, False) if not samples else (True,))]
    for k in keys:
        f = d / f"{k}.npz"
        if f.is_file():
            try:
                return RuntimeStats.load(f)
            except Exception:            # a damaged entry: calibrate again
                f.unlink(missing_ok=True)
    st = collect(model_path, text, n_seq=n_seq, seq_len=seq_len, samples=samples, source=source, progress=progress)
    d.mkdir(parents=True, exist_ok=True)
    keep = samples and cache_samples
    st.save(d / f"{cache_key(model_path, text, n_seq, seq_len, keep)}.npz", samples=keep)
    return st
