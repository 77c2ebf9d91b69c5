"""Cache slots priced by the runtime (pykvq/sensitivity.py, native/llama/llama-kvq-probe.cpp, convert/slot_prices.py):
--sensitivity probe, per-layer budgets without a backward pass.

References: second-order theory (the KL divergence of a small perturbation is quadratic in it: twice the noise,
four times the divergence, checked on exact f32 weights), hand-computed prices, and transformers' backward pass
(the diagonal Fisher of the same slots, which the probe's prices must rank alike).
"""
from __future__ import annotations

import numpy as np
import pytest

from convert import slot_prices
from pykvq import calibrate, sensitivity

from test_convert import run_convert

SEQ = 192


def _sigmas(st, alpha, slots):
    s = slot_prices.sigmas(st, alpha)
    return {k: s[k[:2]] for k in slots}


def test_prices_by_hand():
    """(KLD - floor) / power, a slot at or below the floor priced at a twentieth of the cheapest measured one,
    normalized to a mean of 1; the floor linear between the layers it was measured at."""
    floor = slot_prices.floor_at({0: 0.004, 2: 0.002}, 3)
    np.testing.assert_allclose(floor, [0.004, 0.003, 0.002])
    p = slot_prices.prices({(0, "k"): 0.014, (1, "v"): 0.003, (2, "k"): 0.012}, floor,
                           {(0, "k"): 1.0, (1, "v"): 2.0, (2, "k"): 2.5})
    # (1, v) is at its floor: a twentieth of the cheapest measured price, min(0.010 / 1, 0.010 / 2.5) / 20
    raw = {(0, "k"): 0.010, (1, "v"): 0.004 / 20, (2, "k"): 0.004}
    mean = sum(raw.values()) / 3
    for k, v in raw.items():
        assert p[k] == pytest.approx(v / mean)
    assert slot_prices.noise_power(np.full((2, 3), 0.5), np.arange(6.0).reshape(2, 3)) == pytest.approx(15 * 0.25)


def test_probe_is_exact_without_noise_and_quadratic_with_it(smollm2_f32, text):
    """On exact (f32) weights: zero noise changes nothing (KLD exactly 0: the callback's stops leave the numbers
    alone); the same seed gives the same KLD; doubling the noise multiplies the KLD by 4 within 10% for K (through
    the softmax) and V (linear in the output): the second-order regime the prices assume."""
    st = calibrate.collect(smollm2_f32, text, n_seq=1, seq_len=SEQ, n_threads=2)
    zero = {(i, w, "zero"): np.zeros((3, 64), np.float32) for i in (3,) for w in "kv"}
    slots = [(10, "k"), (18, "v")]
    lo = {(*s, "lo"): v for s, v in _sigmas(st, 0.05, slots).items()}
    hi = {(*s, "hi"): v for s, v in _sigmas(st, 0.10, slots).items()}
    again = {(*s, "again"): v for s, v in _sigmas(st, 0.05, slots).items()}
    got = sensitivity.probe(smollm2_f32, text, {**zero, **lo, **hi, **again}, seq_len=SEQ, n_threads=2)
    assert all(got[k] == 0.0 for k in zero)
    for s in slots:
        assert got[(*s, "again")] == got[(*s, "lo")]
        assert got[(*s, "lo")] > 1e-5
        assert got[(*s, "hi")] / got[(*s, "lo")] == pytest.approx(4.0, rel=0.10), s


def test_quantized_weights_have_a_floor(smollm2, smollm2_f32, text):
    """Why slot_prices subtracts a floor: with 4-bit weights, noise 100x below the prices' (alpha 0.003) still costs
    a KLD of ~1e-3 (the activations' 8-bit rounding in every later matmul moves), over 100x what it costs on exact
    weights, and smaller at the last layer (fewer matmuls after it)."""
    slots = [(0, "k"), (29, "k")]
    kld = {}
    for name, path in (("q4", smollm2), ("f32", smollm2_f32)):
        st = calibrate.collect(path, text, n_seq=1, seq_len=SEQ, n_threads=2)
        got = sensitivity.probe(path, text, _sigmas(st, slot_prices.FLOOR_ALPHA, slots), seq_len=SEQ, n_threads=2)
        kld[name] = [got[s] for s in slots]
    assert kld["q4"][0] > 5e-4 and kld["q4"][0] > 100 * kld["f32"][0]
    assert kld["q4"][1] < kld["q4"][0]


def test_probe_prices_rank_slots_as_the_backward_pass(smollm2, smollm2_hf, text):
    """The probe's prices against transformers' diagonal Fisher of the same slots (the backward pass --kv-bits used
    to need), each as a price per unit of the forward weights' error for the same noise: log-correlation over the
    60 slots >= 0.85 (measured 0.98 at 512 tokens, 0.9x at 192), where the forward weights alone (a price of 1
    everywhere) say nothing across slots."""
    from convert import calib as cm
    from convert import rows
    from convert.gguf_io import read_gguf
    from convert.to_gguf import geometry
    m = read_gguf(smollm2)
    g = geometry(m)
    st = calibrate.collect_cached(smollm2, text, n_seq=1, seq_len=SEQ)
    v_sens = [cm.value_sensitivity(rows.to_f32(m.tensors[f"blk.{i}.attn_output.weight"]), g) for i in range(g.n_layer)]
    probe, report = slot_prices.measure(smollm2, text, st, g, v_sens, seq_len=SEQ)
    assert len(probe) == 2 * g.n_layer and report["tokens"] == (2 * g.n_layer + 4 + 1) * SEQ
    bp = cm.collect_cached(smollm2_hf, text, g, n_seq=1, seq_len=SEQ, fisher=True)
    sig = slot_prices.sigmas(st, 1.0)
    ref = {}
    for (i, w), s in sig.items():
        fw = cm.key_sensitivity(st.layers[i].sq["q"], g) if w == "k" else v_sens[i]
        grad = (bp.gk if w == "k" else bp.gv)[i].astype(np.float64)
        ref[(i, w)] = slot_prices.noise_power(s, (grad ** 2).mean(axis=0)) / slot_prices.noise_power(s, fw)
    keys = sorted(ref)
    r = np.corrcoef(np.log([ref[k] for k in keys]), np.log([probe[k] for k in keys]))[0, 1]
    assert r >= 0.85, r


def test_convert_with_probe_prices(smollm2, tmp_path):
    """--sensitivity probe with --kv-bits: every slot priced in the runtime (printed), per-layer types written, and
    a second conversion at another budget reuses the prices ($PYKVQ_CACHE/calib/prices)."""
    from pykvq import Model
    args = ["--prerope-k", "--sensitivity", "probe", "--probe-len", "128", "--calib-seqs", "1", "--calib-len", "192"]
    res = run_convert(smollm2, "-o", tmp_path / "a.gguf", "--kv-bits", "3.5", *args)
    assert "budget prices measured in the runtime" in res.stdout
    res2 = run_convert(smollm2, "-o", tmp_path / "b.gguf", "--kv-bits", "4.0", *args)
    assert "(cached)" in res2.stdout
    with Model(tmp_path / "a.gguf", n_ctx=256) as m:
        assert m.cache_type_k == "mixed" or m.cache_type_k
        assert len(m.layer_cache_types()) == 30


def test_unknown_layer_is_a_clear_error(smollm2, text):
    with pytest.raises(sensitivity.ProbeError, match="not found in the graph"):
        sensitivity.probe(smollm2, text, {(99, "k"): np.ones((3, 64), np.float32)}, seq_len=64, n_threads=2)
    with pytest.raises(sensitivity.ProbeError, match="'k' \\| 'v'"):
        sensitivity.probe(smollm2, text, {(3, "q"): np.ones((3, 64), np.float32)}, seq_len=64, n_threads=2)
    with pytest.raises(sensitivity.ProbeError, match="values per token"):     # sigma of the wrong shape
        sensitivity.probe(smollm2, text, {(3, "v"): np.ones((2, 64), np.float32)}, seq_len=64, n_threads=2)


def test_budget_without_torch_takes_the_layer_gradients(smollm2, tmp_path, monkeypatch):
    """A plain `pip install pykvq` has no torch: --kv-bits on a GGUF takes the loss's gradients computed layer by
    layer from the file (--sensitivity gradients, the default for a GGUF with or without torch), for windows of any
    length (192 tokens here), with the statistics of the same pass."""
    import sys

    from convert import to_gguf
    from convert.gguf_io import read_gguf
    from pykvq import Model
    monkeypatch.setitem(sys.modules, "torch", None)          # import torch now fails, as without the extra
    assert "torch is not installed" in to_gguf._backprop_unavailable(read_gguf(smollm2))
    s = to_gguf.convert(to_gguf.build_parser().parse_args(
        [str(smollm2), "-o", str(tmp_path / "g.gguf"), "--prerope-k", "--kv-bits", "3.5", "--calib-len", "192",
         "--calib-seqs", "1", "--no-progress"]))
    assert s["sensitivity"] == "gradients" and not s["slot_prices"]
    with Model(tmp_path / "g.gguf", n_ctx=256) as m:
        assert len(m.layer_cache_types()) == 30


def test_gradients_fall_back_without_the_memory(smollm2, monkeypatch):
    """Too little memory for the layer-by-layer pass (convert/layer_gradients.peak_bytes, plus 0.5 GiB): transformers'
    backward pass where it can run (it needs more, so only where the estimate alone is short), else the probe for a
    budget and the forward weights for codebooks; the log says why."""
    from convert import layer_gradients, pipeline, to_gguf
    from convert.gguf_io import read_gguf
    m = read_gguf(smollm2)
    need = layer_gradients.peak_bytes(m, 4, 512) + (1 << 29)
    # SmolLM2 at 4 x 512 tokens: 31 residual streams of 2048 x 576 floats, its gradients, one layer and its work
    assert 0.3e9 < need - (1 << 29) < 1.0e9
    opts = pipeline.Options(prerope_k=True, kv_bits=3.5)
    monkeypatch.setattr(to_gguf, "_mem_available", lambda: need + 1)
    assert to_gguf._default_sensitivity(m, opts, False, 4, 512) == "gradients"
    monkeypatch.setattr(to_gguf, "_mem_available", lambda: need - 1)
    assert "layer-by-layer gradients need about" in to_gguf._gradients_unavailable(m, 4, 512)
    monkeypatch.setattr(to_gguf, "_backprop_unavailable", lambda m: None)
    assert to_gguf._default_sensitivity(m, opts, False, 4, 512) == "backprop"
    monkeypatch.setattr(to_gguf, "_backprop_unavailable", lambda m: "torch is not installed")
    assert to_gguf._default_sensitivity(m, opts, False, 4, 512) == "probe"
    codebooks = pipeline.Options(prerope_k=True, cache_type_k="nuq3", cache_type_v="nuq3")
    assert to_gguf._default_sensitivity(m, codebooks, False, 4, 512) == "forward"
