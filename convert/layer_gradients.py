"""The loss's gradients w.r.t. every layer's pre-RoPE K and V, computed from a GGUF one layer at a time in float32
(--sensitivity gradients): the per-token diagonal Fisher that codebooks and --kv-bits budgets weigh cache errors
with, in less memory than the model itself.

    g = collect("model.gguf", text, n_seq=4, seq_len=512, window=(4, 64))
    g.k[il]   # float32 [n_seq * seq_len, n_head_kv, head_dim], the GGUF's channel order (as pykvq.calibrate's)

A forward pass keeps only each layer's input (the residual stream, n_layer x tokens x n_embd floats); the output
matrix is read a slice of the vocabulary at a time with an online softmax; then each layer, from the last, is read,
decoded to float32, its forward recomputed from its input and its gradient carried down (convert/decoder_grad.py).
So memory holds one layer's weights and activations, never the model: Qwen2.5-Coder-1.5B at 4 x 512 tokens about
1 GB, where a backward graph over the whole model (transformers', or llama.cpp's training graph) holds every
activation at once. The weights are the GGUF's, decoded exactly, and the products are float32: transformers'
backward pass on the same checkpoint dequantized, without torch or the f32 copy.

The windows and tokens are pykvq.calibrate.collect's (the model's own tokenizer, a BOS first where the model wants
one), so the gradients line up token for token with its samples; each window's last label is the text's next token.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import decoder_grad as dg
from .geometry import geometry
from .gguf_io import ConvertError, GGUFModel, read_gguf
from .weights_f32 import n_per_row, tensor_f32

ARCHS = ("llama", "qwen2")          # decoder_grad's layer: pre-norm RMS, RoPE, GQA, SwiGLU (qwen2: Q/K/V biases)
VOCAB_CHUNK = 8192                  # output rows decoded at a time (Qwen's 152k-token head: 50 MB of float32)
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
OPTIONAL_TENSORS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def unavailable(m: GGUFModel, seq_len: int = 512) -> str | None:
    """Why collect() cannot take m's gradients, or None."""
    if m.arch not in ARCHS:
        return f"the layer-by-layer gradients know the {' / '.join(ARCHS)} layer, not {m.arch}"
    scaling = str(m.arch_meta("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        return f"the layer-by-layer gradients turn RoPE without scaling or with linear scaling, not {scaling}"
    if seq_len < 2:
        return f"windows of at least 2 tokens are needed, not {seq_len}"
    missing = [f"blk.{i}.{n}.weight" for i in range(m.layer_count()) for n in LAYER_TENSORS
               if f"blk.{i}.{n}.weight" not in m.tensors]
    for n in ("token_embd.weight", "output_norm.weight"):
        if n not in m.tensors:
            missing.append(n)
    if missing:
        return f"the file lacks {missing[0]}" + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else "")
    # a tensor the layer does not compute with (an output bias, a Q / K norm, a converted file's per-head RoPE
    # frequencies) would leave its forward silently wrong
    known = {f"{n}.weight" for n in LAYER_TENSORS} | set(OPTIONAL_TENSORS)
    for name in m.tensors:
        if name.startswith("blk.") and name.split(".", 2)[2] not in known:
            return f"the layer-by-layer gradients do not compute with {name}"
    return None


def peak_bytes(m: GGUFModel, n_seq: int, seq_len: int) -> int:
    """About collect()'s peak memory beyond the interpreter: every layer's input (the residual stream), the
    gradients it returns, and one layer's float32 weights and activations (measured: Qwen2.5-Coder-1.5B at 4 x 512
    tokens 0.93 GB peak RSS in all, this gives 1.24 GB: a margin)."""
    g = geometry(m)
    T, L = n_seq * seq_len, m.layer_count()
    n_embd, n_ff = int(m.arch_meta("embedding_length")), int(m.arch_meta("feed_forward_length"))
    qkv = (g.n_head + 2 * g.n_head_kv) * g.head_dim
    layer_weights = max(sum(n_per_row(t) * t.n_rows for n, t in m.tensors.items() if n.startswith(f"blk.{i}."))
                        for i in range(L))
    floats = ((L + 1) * T * n_embd                      # the residual stream at each layer's input
              + L * T * 2 * g.n_head_kv * g.head_dim    # the gradients
              + layer_weights
              + 4 * T * qkv + 4 * T * n_embd            # Q / K / V, their turned and gradient copies
              + 2 * n_seq * g.n_head * seq_len ** 2     # attention probabilities, and one sequence's gradient
              + 8 * dg.FFN_CHUNK * n_ff                 # one chunk of the FFN's activations and gradients
              + 3 * T * VOCAB_CHUNK)                    # one slice of the logits
    return 4 * floats


def shape(m: GGUFModel) -> dg.Shape:
    g = geometry(m)
    j = np.arange(g.n_rot // 2, dtype=np.float64)
    inv_freq = g.freq_base ** (-2.0 * j / g.n_rot)
    if g.rope_freqs is not None:
        inv_freq = inv_freq / np.asarray(g.rope_freqs, np.float64)
    if str(m.arch_meta("rope.scaling.type", "none")) == "linear":
        inv_freq = inv_freq / float(m.arch_meta("rope.scaling.factor", 1.0))
    return dg.Shape(g.n_head, g.n_head_kv, g.head_dim, g.n_rot, g.layout, inv_freq,
                    float(m.arch_meta("attention.layer_norm_rms_epsilon", 1e-6)))


def layer_weights(m: GGUFModel, i: int) -> dg.LayerWeights:
    def t(name: str):
        full = f"blk.{i}.{name}"
        return tensor_f32(m, full) if full in m.tensors else None
    return dg.LayerWeights(t("attn_norm.weight"), t("attn_q.weight"), t("attn_k.weight"), t("attn_v.weight"),
                           t("attn_output.weight"), t("ffn_norm.weight"), t("ffn_gate.weight"), t("ffn_up.weight"),
                           t("ffn_down.weight"), t("attn_q.bias"), t("attn_k.bias"), t("attn_v.bias"))


def _output_rows(m: GGUFModel):
    name = "output.weight" if "output.weight" in m.tensors else "token_embd.weight"     # tied embeddings
    n = m.tensors[name].n_rows
    return name, (tensor_f32(m, name, slice(a, a + VOCAB_CHUNK)) for a in range(0, n, VOCAB_CHUNK))


def release_heap() -> None:
    """Give freed heap back to the system: glibc keeps freed blocks below its (growing) mmap threshold for reuse,
    and the pass frees hundreds of MB of them, which the rest of the conversion would otherwise carry as resident."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):      # not glibc
        pass


@dataclass
class LayerPass:
    gradients: object               # pykvq.gradients.RuntimeGradients
    stats: object                   # pykvq.calibrate.RuntimeStats of the same windows (float32 forward)


def _stats(q: np.ndarray, k: np.ndarray, v: np.ndarray, samples: bool):
    """One layer's pykvq.calibrate.LayerStats from its pre-RoPE Q / K and V [T, heads, head_dim]."""
    from pykvq.calibrate import LayerStats
    ls = LayerStats(q.shape[0], {}, {}, {}, {})
    for w, a in (("q", q), ("k", k), ("v", v)):
        ls.mean[w] = a.mean(axis=0, dtype=np.float64)
        ls.sq[w] = np.square(a, dtype=np.float64).mean(axis=0)
        ls.lo[w], ls.hi[w] = a.min(axis=0), a.max(axis=0)
        if samples:
            ls.samples[w] = np.array(a, np.float32)
    return ls


def collect(gguf_path: str | os.PathLike, text: str, *, n_seq: int = 4, seq_len: int = 512,
            window: tuple[int, int] | None = None, samples: bool = False, source: str = "",
            progress: bool | None = None) -> LayerPass:
    """The gradients, and the calibration statistics of the same forward pass (pykvq.calibrate.collect's, with
    every token's Q / K / V where samples: float32 products on the decoded weights, as transformers' pass makes
    them). window (sinks, cells): the gradients only through the reads a pre-RoPE file's runtime makes of quantized
    cells (query t reads key s exactly when s < sinks or t - s < cells)."""
    from pykvq.calibrate import CalibrationError, RuntimeStats
    from pykvq.gradients import RuntimeGradients, token_windows
    from pykvq.model import tokenize_file
    from pykvq.progress import progress_bar

    m = read_gguf(gguf_path)
    why = unavailable(m, seq_len)
    if why or n_seq < 1:
        raise ConvertError(f"{Path(gguf_path).name}: {why or 'at least one calibration window is needed'}")
    s = shape(m)
    toks, bos = tokenize_file(gguf_path, text)
    try:
        seqs = token_windows(toks, n_seq, seq_len, bos)
    except CalibrationError as e:
        raise ConvertError(str(e)) from None
    inputs = np.concatenate([np.asarray(x, np.int64) for x, _ in seqs])
    labels = np.concatenate([np.asarray(y, np.int64) for _, y in seqs])
    n_vocab = m.tensors["token_embd.weight"].n_rows
    if inputs.max() >= n_vocab or labels.max() >= n_vocab:
        raise ConvertError(f"{Path(gguf_path).name}: the tokenizer gives ids beyond the {n_vocab}-row embedding")
    cos, sin = dg.rope_tables(np.tile(np.arange(seq_len), n_seq), s)
    exact = dg.exact_reads(seq_len, window)
    n_layer = m.layer_count()
    t0 = time.time()
    bar = progress_bar(range(2 * n_layer + 1), desc="gradients", enable=progress, unit="layer")
    steps = iter(bar)

    layers = []
    xs = [tensor_f32(m, "token_embd.weight", inputs)]          # each layer's input, then the last one's output
    for i in range(n_layer):
        xs.append(dg.layer_forward(xs[-1], layer_weights(m, i), s, cos, sin, seq_len,
                                   keep=lambda q, k, v: layers.append(_stats(q, k, v, samples))))
        next(steps)
    release_heap()
    name, rows = _output_rows(m)
    dx, loss = dg.head_backward(xs.pop(), tensor_f32(m, "output_norm.weight"), s.eps, rows,
                                tensor_f32(m, name, labels), seq_len)
    next(steps)
    if not np.isfinite(loss):
        raise ConvertError(f"{Path(gguf_path).name}: the forward pass gave a loss of {loss}")
    ks: list[np.ndarray] = [None] * n_layer      # type: ignore[list-item]
    vs: list[np.ndarray] = [None] * n_layer      # type: ignore[list-item]
    for i in reversed(range(n_layer)):
        dx, ks[i], vs[i] = dg.layer_backward(xs.pop(), dx, layer_weights(m, i), s, cos, sin, seq_len, exact)
        next(steps)
    release_heap()
    if hasattr(bar, "close"):
        bar.close()
    seconds = time.time() - t0
    return LayerPass(RuntimeGradients(ks, vs, n_seq, seq_len, loss, seconds),
                     RuntimeStats(layers, n_seq, seq_len, source, seconds, s.layout, s.n_rot))


def collect_cached(gguf_path: str | os.PathLike, text: str, *, n_seq: int = 4, seq_len: int = 512,
                   window: tuple[int, int] | None = None, samples: bool = False, source: str = "",
                   progress: bool | None = None) -> LayerPass:
    """collect(), kept in $PYKVQ_CACHE/calib/grad keyed by the model file, text, windows and this code (Qwen2.5-
    Coder-1.5B, 4 x 512 tokens: 117 MB of gradients and kilobytes of moments; 0.47 GB more with the samples)."""
    from pykvq.calibrate import RuntimeStats
    from pykvq.gradients import RuntimeGradients
    from pykvq.paths import cache_dir
    p = Path(gguf_path).resolve()
    st = p.stat()
    h = hashlib.sha256()
    for part in (str(p), f"{st.st_size}/{st.st_mtime_ns}", text, f"{n_seq}/{seq_len}/{window}",
                 Path(__file__).read_text(), Path(dg.__file__).read_text()):
        h.update(part.encode("utf-8", "replace"))
    d = cache_dir() / "calib" / "grad"
    f = d / f"layers-{h.hexdigest()[:24]}.npz"
    fs = [d / f"layers-{h.hexdigest()[:24]}.{x}.npz" for x in (("samples",) if samples else ("samples", "moments"))]
    for st_f in fs:
        if f.is_file() and st_f.is_file():
            try:
                g = RuntimeGradients.load(f, n_seq, seq_len)
                stats = RuntimeStats.load(st_f)
                stats.source = source
                return LayerPass(g, stats)
            except Exception:            # a damaged entry: run again
                f.unlink(missing_ok=True)
                st_f.unlink(missing_ok=True)
    lp = collect(gguf_path, text, n_seq=n_seq, seq_len=seq_len, window=window, samples=samples, source=source,
                 progress=progress)
    d.mkdir(parents=True, exist_ok=True)
    lp.gradients.save(f)
    lp.stats.save(d / f"layers-{h.hexdigest()[:24]}.{'samples' if samples else 'moments'}.npz", samples=samples)
    return lp
