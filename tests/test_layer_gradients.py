"""The layer-by-layer gradients (convert/layer_gradients.py, convert/decoder_grad.py, convert/weights_f32.py): the
converter's --sensitivity gradients.

References: gguf-py's numpy decoders for the weights (bit for bit); transformers' backward pass on the same weights
(the GGUF dequantized to an f32 HF checkpoint), the same token ids and labels, the mean next-token loss; finite
differences of the layer's own forward for what SmolLM2 does not exercise (qwen2's biases, the neox turn).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import quants

from convert import decoder_grad as dg
from convert import layer_gradients as lg
from convert.calib import hf_to_norm
from convert.geometry import geometry
from convert.gguf_io import ConvertError, read_gguf
from convert.weights_f32 import tensor_f32
from pykvq import gradients
from pykvq.model import Model, tokenize_file

SEQ_LEN = 256


def test_weights_decode_as_gguf_py_does(smollm2):
    """ggml's row decoders through pread, against gguf-py's numpy decoders on the mapped file: every stored type of
    the file (Q4_1, Q6_K, F32), whole tensors, a slice of rows and listed rows."""
    m = read_gguf(smollm2)
    seen = set()
    for name, t in m.tensors.items():
        if t.qtype in seen:
            continue
        seen.add(t.qtype)
        ref = quants.dequantize(np.asarray(t.data), t.qtype).astype(np.float32)
        got = tensor_f32(m, name)
        np.testing.assert_array_equal(got, ref.reshape(got.shape))
        if t.data.ndim == 2:
            np.testing.assert_array_equal(tensor_f32(m, name, slice(3, 70)), ref[3:70])
            rows = np.array([5, 0, 5, t.n_rows - 1])
            np.testing.assert_array_equal(tensor_f32(m, name, rows), ref[rows])
    assert len(seen) >= 3


def test_tokens_are_the_runtimes(smollm2, text):
    """The vocabulary alone tokenizes as the loaded model does, and says whether a window starts with BOS."""
    toks, bos = tokenize_file(smollm2, text[:5000])
    with Model(smollm2, n_ctx=512) as m:
        assert toks == m.tokenize(text[:5000], add_special=False)
        assert bos == (m.bos if m.add_bos else None)


@pytest.fixture(scope="module")
def first_window(smollm2, text):
    toks, bos = tokenize_file(smollm2, text)
    return gradients.token_windows(toks, 1, SEQ_LEN, bos)[0]


@pytest.mark.parametrize("window", [None, (4, 16)])
def test_gradients_match_transformers(smollm2, smollm2_hf, text, first_window, window):
    """Per layer, dL/dK (pre-RoPE) and dL/dV against transformers' backward pass on the same f32 weights and tokens,
    with and without the exact window (through the reads of quantized cells only). Both compute in float32 in
    other orders. Measured (256 tokens): correlation 1.000000 in every layer, norms within 1e-4, the largest
    element's difference at most 5e-4 of the layer's largest gradient."""
    from test_gradients import _transformers_gradients
    g = geometry(read_gguf(smollm2))
    mine = lg.collect(smollm2, text, n_seq=1, seq_len=SEQ_LEN, window=window, progress=False).gradients
    ids, labels = first_window
    ref = _transformers_gradients(smollm2_hf, ids, labels, g, window=window)
    idx = hf_to_norm(g) if g.layout == "neox" else np.arange(g.head_dim)
    for i in range(g.n_layer):
        for w, x in (("k", mine.k[i][..., idx]), ("v", mine.v[i])):
            r = ref[(w, i)]
            assert np.corrcoef(x.ravel(), r.ravel())[0, 1] > 0.99999, (w, i)
            assert abs(np.linalg.norm(x) / np.linalg.norm(r) - 1) < 5e-4, (w, i)
            assert np.abs(x - r).max() < 2e-3 * np.abs(r).max(), (w, i)
    assert 1.0 < mine.loss < 6.0 and mine.k[0].shape == (SEQ_LEN, g.n_head_kv, g.head_dim)


def _layer0(smollm2, first_window, layout):
    """SmolLM2's layer 0 on its first 48 tokens, turned in layout, with Q / K / V biases of the size of its
    weights' rows (qwen2's kind of layer; the biases only exercise the path, finite differences judge it)."""
    m = read_gguf(smollm2)
    s = dataclasses.replace(lg.shape(m), layout=layout)
    w = lg.layer_weights(m, 0)
    w.bq, w.bk, w.bv = (0.05 * x[:, 0] * np.sqrt(x.shape[1]) for x in (w.wq, w.wk, w.wv))
    x = tensor_f32(m, "token_embd.weight", np.asarray(first_window[0][:48]))
    return s, w, x


@pytest.mark.parametrize("layout", ["norm", "neox"])
def test_layer_backward_is_the_forwards_derivative(smollm2, first_window, layout):
    """The hand-written backward against central differences of layer_forward, in float64 sums: along a direction
    of the input (dx), and along K's and V's biases, whose derivative is the sum of dk / dv over the tokens; with
    the exact window the biases' derivative is the windowless one less the reads of exact cells, which the
    difference cannot see, so those are checked without it. Two sequences of 24 tokens."""
    s, w, x = _layer0(smollm2, first_window, layout)
    S = 24
    cos, sin = dg.rope_tables(np.tile(np.arange(S), 2), s)
    r = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)    # the output's gradient

    def loss(x_, w_=w):
        return float(np.sum(dg.layer_forward(x_, w_, s, cos, sin, S).astype(np.float64) * r))
    dx, dk, dv = dg.layer_backward(x, r, w, s, cos, sin, S, None)
    d = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32) * np.std(x)
    eps = 1e-3                   # a step of 0.1% of the input's spread: the layer is smooth on that scale
    fd = (loss(x + eps * d) - loss(x - eps * d)) / (2 * eps)
    assert abs(fd - float(np.sum(dx.astype(np.float64) * d))) < 2e-3 * abs(fd) + 1e-3
    for name, grad in (("bk", dk), ("bv", dv)):
        b = getattr(w, name)
        e = np.random.default_rng(2).standard_normal(b.shape).astype(np.float32) * np.std(b)
        fd = (loss(x, dataclasses.replace(w, **{name: b + 10 * eps * e})) -
              loss(x, dataclasses.replace(w, **{name: b - 10 * eps * e}))) / (20 * eps)
        got = float(np.sum(grad.reshape(grad.shape[0], -1).astype(np.float64).sum(axis=0) * e))
        assert abs(fd - got) < 2e-3 * abs(fd) + 1e-3, (name, fd, got)
    _, dk_w, dv_w = dg.layer_backward(x, r, w, s, cos, sin, S, dg.exact_reads(S, (2, 4)))
    assert 0.05 < np.linalg.norm(dk_w) / np.linalg.norm(dk) < 1 and 0.05 < np.linalg.norm(dv_w) / np.linalg.norm(dv) < 1


def test_the_head_is_the_mean_next_token_loss(smollm2, first_window):
    """head_backward's online softmax over slices of the vocabulary against the whole logits at once: the loss and
    its gradient, for two sequences."""
    m = read_gguf(smollm2)
    s = lg.shape(m)
    ids, labels = (np.asarray(a[:32]) for a in first_window)
    x = tensor_f32(m, "token_embd.weight", np.concatenate([ids, ids[::-1]]))
    lab = np.concatenate([labels, labels[::-1]])
    W = tensor_f32(m, "token_embd.weight")                   # SmolLM2 ties its output to the embeddings
    nw = tensor_f32(m, "output_norm.weight")
    dx, loss = dg.head_backward(x, nw, s.eps, (W[a:a + 5000] for a in range(0, len(W), 5000)), W[lab], 32)
    h, rr = dg.rms_norm(x, s.eps)
    logits = (h * nw).astype(np.float64) @ W.T.astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    assert abs(loss - float(np.mean(-np.log(p[np.arange(64), lab])))) < 1e-4
    p[np.arange(64), lab] -= 1
    ref = dg.rms_norm_back(((p @ W.astype(np.float64)) / 32 * nw).astype(np.float32), x, rr)
    np.testing.assert_allclose(dx, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_an_architecture_it_does_not_know_is_refused(text):
    """gemma3's layer (GELU, q/k norms, sliding windows) is not decoder_grad's: refused before any work, by name."""
    from pykvq.registry import fetch
    m = read_gguf(fetch("gemma3-270m"))
    assert "not gemma3" in lg.unavailable(m)
    with pytest.raises(ConvertError, match="not gemma3"):
        lg.collect(m.path, text, n_seq=1, seq_len=64)


def test_a_tensor_the_layer_does_not_use_is_refused(smollm2):
    """A layer tensor outside decoder_grad's layer (an output projection's bias here) would leave the forward silently
    wrong: refused by name, so the converter falls back to another sensitivity."""
    from convert.gguf_io import Tensor
    m = read_gguf(smollm2)
    assert lg.unavailable(m) is None
    w = m.tensors["blk.3.attn_output.weight"]
    m.tensors["blk.3.attn_output.bias"] = Tensor("blk.3.attn_output.bias", w.qtype, np.zeros(576, np.float32))
    assert "blk.3.attn_output.bias" in lg.unavailable(m)


@pytest.mark.qwen
def test_qwen_gradients_match_transformers(text):
    """qwen2: Q / K / V biases and the neox turn, against transformers on the dequantized checkpoint, 256 tokens with
    the window. Measured: correlation 1.000000, norms within 4e-5, elements within 6e-4 of the largest."""
    from convert.hf_checkpoint import hf_checkpoint
    from pykvq.registry import fetch
    from test_gradients import _transformers_gradients
    qwen = fetch("qwen2.5-coder-1.5b")
    g = geometry(read_gguf(qwen))
    mine = lg.collect(qwen, text, n_seq=1, seq_len=SEQ_LEN, window=(4, 16), progress=False).gradients
    toks, bos = tokenize_file(qwen, text)
    ids, labels = gradients.token_windows(toks, 1, SEQ_LEN, bos)[0]
    ref = _transformers_gradients(hf_checkpoint(qwen), ids, labels, g, window=(4, 16))
    idx = hf_to_norm(g)
    for i in range(g.n_layer):
        for w, x in (("k", mine.k[i][..., idx]), ("v", mine.v[i])):
            assert np.corrcoef(x.ravel(), ref[(w, i)].ravel())[0, 1] > 0.99999, (w, i)
