"""What an error in each layer's K and V costs, measured by the runtime (the converter's per-layer budgets).

    kld = pykvq.sensitivity.probe("model.gguf", text, {(3, "k"): sigma, (3, "v"): sigma_v})

For each cache slot (a layer's K or V) the model runs the calibration text once with Gaussian noise of the given
standard deviation per [n_head_kv, head_dim] channel added to that slot as the graph computes it
(native/llama/llama-kvq-probe.cpp), every other slot exact, and the mean KL divergence of the next-token
distributions from the noiseless run is that slot's price for that noise. To second order the KL divergence is a
quadratic form in the error, so a slot's price per unit of (suitably weighted) squared error carries over to the
errors of its candidate cache types: a per-slot factor that a forward pass alone cannot give (how much of the loss
flows through that layer's attention, what later layers make of it), at the cost of one forward pass per slot in
the memory that running the model takes. Positions are scored as llama-perplexity scores them (the second half of
each sequence); every slot sees the same tokens and noise of the same seed.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ._lib import ffi
from .errors import PykvqError
from .metrics import LogDist, kl_rows
from .progress import progress_bar

WHICH = {"k": 1, "v": 2}


class ProbeError(PykvqError):
    """The runtime could not probe this model's cache slots; the message says why."""


def _check_keys(keys) -> None:
    bad = [k for k in keys if len(k) < 2 or k[1] not in WHICH]
    if bad:
        raise ProbeError(f"probe keys are (layer, 'k' | 'v', ...); got {bad[0]!r}")


def _sequences(m, text: str, n_seq: int, seq_len: int) -> list:
    """pykvq.calibrate's n_seq x seq_len windows of text, BOS first where the model wants one."""
    from .calibrate import CalibrationError, windows
    try:
        seqs = windows(m.tokenize(text, add_special=False), n_seq, seq_len - 1 if m.add_bos else seq_len)
    except CalibrationError as e:
        raise ProbeError(str(e)) from None
    return [[m.bos] + s for s in seqs] if m.add_bos else seqs


def probe(model_path: str | Path, text: str, sigmas: dict, *, n_seq: int = 1, seq_len: int = 512,
          seed: int = 0, progress: bool | None = None, n_threads: int | None = None) -> dict:
    """{key: mean KL divergence per scored token} for keys (layer, "k" | "v", ...) -> sigma (float [n_head_kv,
    head_dim], the noise's standard deviation per channel; what follows the first two entries of a key is the
    caller's, to probe one slot twice). Also returns "seconds" and "tokens" (forward passes run, baseline
    included) under those keys."""
    from ._lib import lib
    from .model import Model
    _check_keys(sigmas)
    L = lib()
    p = L.llama_kvq_probe_init()
    m = None
    t0 = time.time()
    try:
        m = Model(model_path, n_ctx=seq_len, n_batch=seq_len, cache_type_k="f16", cache_type_v="f16",
                  n_threads=n_threads, _probe=p)
        seqs = _sequences(m, text, n_seq, seq_len)
        first = seq_len // 2

        def run() -> list:
            out = []
            for j, s in enumerate(seqs):
                L.llama_kvq_probe_next_batch(p, seed * 1000003 + j)
                m.reset()
                out.append(m._decode(s, 0, first, collect=True)[0])
            return out

        if not L.llama_kvq_probe_set(p, -1, 0, ffi.NULL, 0, seed):
            raise ProbeError(ffi.string(L.llama_kvq_probe_error(p)).decode())
        base = [LogDist.of_logits(x) for x in run()]
        probs = [b.probs() for b in base]
        out = {}
        bar = progress_bar(list(sigmas.items()), desc="pricing layers", enable=progress, unit="slot")
        for key, sigma in bar:
            il, which = key[:2]
            sig = np.ascontiguousarray(sigma, dtype=np.float32).reshape(-1)
            L.llama_kvq_probe_set(p, int(il), WHICH[which], ffi.cast("const float *", ffi.from_buffer(sig)),
                                  sig.size, seed)
            logits = run()
            err = ffi.string(L.llama_kvq_probe_error(p)).decode()
            if err:
                raise ProbeError(f"{Path(model_path).name}: {err}")
            hits = L.llama_kvq_probe_hits(p)
            if hits < len(seqs):
                raise ProbeError(f"{Path(model_path).name}: layer {il}'s {which.upper()} was not found in the graph "
                                 f"(nodes named {'Kcur' if which == 'k' else 'Vcur'}-{il}); this architecture "
                                 "names it differently")
            out[key] = float(np.mean(np.concatenate(
                [kl_rows(b, pb, LogDist.of_logits(x)) for b, pb, x in zip(base, probs, logits)])))
        out["seconds"] = time.time() - t0
        out["tokens"] = (len(sigmas) + 1) * len(seqs) * seq_len
        return out
    finally:
        if m is not None:
            m.close()
        L.llama_kvq_probe_free(p)


def probe_deltas(model_path: str | Path, text: str, deltas: dict, *, n_seq: int, seq_len: int, use: int,
                 length: int, progress: bool | None = None, n_threads: int | None = None) -> dict:
    """{key: mean KL divergence per scored token} for keys (layer, "k" | "v", ...) -> a given change of that slot:
    one float32 array [length, n_head_kv, head_dim] per sequence, added to the layer's K after RoPE or to its V
    projection (the converter's candidate types, each its own rounding error mapped there). The sequences are the
    first `length` tokens of the first `use` of pykvq.calibrate's n_seq x seq_len windows of text (BOS included),
    so the changes can be made from its samples. Also returns "seconds" and "tokens"."""
    from ._lib import lib
    from .model import Model
    _check_keys(deltas)
    L = lib()
    p = L.llama_kvq_probe_init()
    m = None
    t0 = time.time()
    try:
        m = Model(model_path, n_ctx=length, n_batch=length, cache_type_k="f16", cache_type_v="f16",
                  n_threads=n_threads, _probe=p)
        seqs = [s[:length] for s in _sequences(m, text, n_seq, seq_len)[:use]]

        def run(key=None) -> list:
            out = []
            for j, s in enumerate(seqs):
                if key is not None:
                    d = np.ascontiguousarray(deltas[key][j], dtype=np.float32)
                    L.llama_kvq_probe_set_delta(p, int(key[0]), WHICH[key[1]],
                                                ffi.cast("const float *", ffi.from_buffer(d)), d.size)
                m.reset()
                out.append(m._decode(s, 0, len(s) // 2, collect=True)[0])
            return out

        L.llama_kvq_probe_set(p, -1, 0, ffi.NULL, 0, 0)
        base = [LogDist.of_logits(x) for x in run()]
        probs = [b.probs() for b in base]
        out = {}
        for key in progress_bar(list(deltas), desc="pricing candidates", enable=progress, unit="candidate"):
            L.llama_kvq_probe_set(p, -1, 0, ffi.NULL, 0, 0)        # resets the hits
            logits = run(key)
            err = ffi.string(L.llama_kvq_probe_error(p)).decode()
            if err:
                raise ProbeError(f"{Path(model_path).name}: {err}")
            if L.llama_kvq_probe_hits(p) < len(seqs):
                raise ProbeError(f"{Path(model_path).name}: layer {key[0]}'s {key[1].upper()} was not found in the "
                                 "graph; this architecture names it differently")
            out[key] = float(np.mean(np.concatenate(
                [kl_rows(b, pb, LogDist.of_logits(x)) for b, pb, x in zip(base, probs, logits)])))
        out["seconds"] = time.time() - t0
        out["tokens"] = (len(deltas) + 1) * sum(len(s) for s in seqs)
        return out
    finally:
        if m is not None:
            m.close()
        L.llama_kvq_probe_free(p)
