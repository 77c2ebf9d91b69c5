"""The gradients' windows and result type (pykvq/gradients.py) and how the converter takes them
(convert/calib.from_runtime); transformers' backward pass, the reference tests/test_layer_gradients.py checks the
layer-by-layer gradients against (the same token ids and labels, the mean next-token loss; gradients w.r.t. k_proj /
v_proj outputs, HF's K channels interleaved into the GGUF's NORM order).
"""
from __future__ import annotations

import numpy as np

from convert import layer_gradients
from convert.calib import from_runtime, hf_to_norm
from convert.geometry import geometry
from convert.gguf_io import read_gguf
from pykvq import calibrate, gradients

N_SEQ, SEQ_LEN = 2, 256


def test_windows_are_calibrations_with_next_token_labels(smollm2, text):
    from pykvq.model import Model
    with Model(smollm2, n_ctx=512) as m:
        toks = m.tokenize(text, add_special=False)
    w = gradients.token_windows(toks, N_SEQ, SEQ_LEN, None)
    assert [x for x, _ in w] == [list(s) for s in calibrate.windows(toks, N_SEQ, SEQ_LEN)]
    for (x, y), start in zip(w, range(0, len(toks), len(toks) // N_SEQ)):
        assert y == toks[start + 1: start + SEQ_LEN + 1]
    wb = gradients.token_windows(toks, 1, 8, 1)                # a BOS first, as calibrate.collect does
    assert wb == [([1] + toks[:7], toks[:8])]


def _transformers_gradients(hf_dir, ids, labels, g, window=None):
    """dL/dK (k_proj outputs, NORM order) and dL/dV per layer from transformers on f32 weights; window (sinks,
    cells): through the reads of quantized cells only (convert/calib.py's attention for a window-weighted budget)."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    from convert.calib import _window_attention
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    if window is not None:
        AttentionInterface.register("pykvq_test_window", _window_attention(*window))
        hf.config._attn_implementation = "pykvq_test_window"
    for p in hf.parameters():
        p.requires_grad_(False)
    outs = {}

    def hook(out, key):
        out.retain_grad()
        outs[key] = out
    hooks = [getattr(hf.model.layers[i].self_attn, f"{w}_proj").register_forward_hook(
             lambda _m, _i, out, key=(w, i): hook(out, key)) for i in range(g.n_layer) for w in "kv"]
    try:
        emb = hf.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
        logits = hf(inputs_embeds=emb, use_cache=False).logits[0]
        torch.nn.functional.cross_entropy(logits, torch.tensor(labels)).backward()
    finally:
        for h in hooks:
            h.remove()
    idx = hf_to_norm(g)
    n = len(ids)
    return {(w, i): (lambda r: r[..., idx] if w == "k" else r)(
            outs[(w, i)].grad[0].numpy().reshape(n, g.n_head_kv, g.head_dim)) for (w, i) in outs}


def test_converter_takes_them_per_token(smollm2, text, tmp_path):
    """from_runtime with the layer pass's gradients and samples: per-token gk (NORM order) / gv and the keys'
    Fisher moments from them, as the transformers pass gives them; the gradients saved and loaded unchanged."""
    lp = layer_gradients.collect(smollm2, text, n_seq=N_SEQ, seq_len=SEQ_LEN, samples=True)
    lp.gradients.save(tmp_path / "g.npz")
    grads = gradients.RuntimeGradients.load(tmp_path / "g.npz", N_SEQ, SEQ_LEN)
    for a, b in zip(grads.k + grads.v, lp.gradients.k + lp.gradients.v):
        np.testing.assert_array_equal(a, b)
    g = geometry(read_gguf(smollm2))
    c = from_runtime(lp.stats, g, None, grads)
    assert c.sensitivity == "backprop"
    idx = hf_to_norm(g) if g.layout == "neox" else np.arange(g.head_dim)   # a llama GGUF's keys are NORM already
    for i in (0, 29):
        np.testing.assert_array_equal(c.gk[i], grads.k[i][..., idx])
        np.testing.assert_array_equal(c.gv[i], grads.v[i])
        np.testing.assert_allclose(c.km[i].fisher, (c.gk[i].astype(np.float64) ** 2).mean(axis=0))
    assert np.isfinite(grads.loss) and 1.0 < grads.loss < 6.0          # SmolLM2 on English prose
