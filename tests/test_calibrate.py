"""Calibration inside the runtime (pykvq/calibrate.py, native/llama/llama-kvq-calib.cpp) and the converter's default
forward-sensitivity path (convert/calib.from_runtime, cache_domain.prerope_key_moments).

References: transformers running the same weights (dequantized from the GGUF) on the same token ids for the
pre-RoPE keys and values; numpy over the kept samples for the native moments; the numpy definition of the
scale for the converted file's tensors.
"""
from __future__ import annotations

import numpy as np
import pytest

from convert import cache_domain, prerope
from convert.calib import calibration_text, from_runtime, key_sensitivity, value_sensitivity
from convert.geometry import geometry, pair_channels
from convert.gguf_io import read_gguf
from pykvq import calibrate
from pykvq.keys import Tensors

N_SEQ, SEQ_LEN = 2, 128


@pytest.fixture(scope="module")
def stats(smollm2, text):
    return calibrate.collect(smollm2, text, n_seq=N_SEQ, seq_len=SEQ_LEN, samples=True, n_threads=2)


def test_shapes_and_layout(stats, smollm2):
    g = geometry(read_gguf(smollm2))
    assert len(stats.layers) == g.n_layer == 30
    assert stats.rope_layout == "norm" and stats.n_rot == g.n_rot == 64       # llama: NORM pairs, full rotary
    for ls in stats.layers:
        assert ls.n == N_SEQ * SEQ_LEN
        assert ls.mean["q"].shape == (9, 64) and ls.mean["k"].shape == (3, 64) and ls.mean["v"].shape == (3, 64)
        assert ls.samples["k"].shape == (N_SEQ * SEQ_LEN, 3, 64)


def test_native_moments_match_numpy_over_the_samples(stats):
    """The C accumulation (double sums, float extremes) against numpy over the very samples it kept."""
    for ls in stats.layers[::7]:
        for w in ("q", "k", "v"):
            x = ls.samples[w].astype(np.float64)
            np.testing.assert_allclose(ls.mean[w], x.mean(axis=0), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(ls.sq[w], (x ** 2).mean(axis=0), rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(ls.lo[w], ls.samples[w].min(axis=0))
            np.testing.assert_array_equal(ls.hi[w], ls.samples[w].max(axis=0))


def test_keys_and_values_match_transformers(stats, smollm2, smollm2_hf, text):
    """Runtime pre-RoPE K and V against transformers' k_proj / v_proj outputs on the same token ids (HF's K
    channels interleaved into the GGUF's NORM order). The runtime multiplies with 8-bit activations against the
    4-bit weights, so values agree to a few percent of the layer's spread, not bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from convert.calib import hf_to_norm
    from pykvq.model import Model
    g = geometry(read_gguf(smollm2))
    with Model(smollm2, n_ctx=256) as m:
        ids = calibrate.windows(m.tokenize(text, add_special=False), N_SEQ, SEQ_LEN)[0]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf, torch_dtype=torch.float32).eval()
    got = {}
    layers = (0, 11, 29)
    hooks = [getattr(hf.model.layers[i].self_attn, f"{w}_proj").register_forward_hook(
             lambda _m, _i, out, key=(w, i): got.__setitem__(key, out[0].detach().numpy())) for i in layers for w in "kv"]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    idx = hf_to_norm(g)
    for i in layers:
        rk = stats.layers[i].samples["k"][:SEQ_LEN]
        rv = stats.layers[i].samples["v"][:SEQ_LEN]
        hk = got[("k", i)].reshape(SEQ_LEN, 3, 64)[..., idx]
        hv = got[("v", i)].reshape(SEQ_LEN, 3, 64)
        for r, h in ((rk, hk), (rv, hv)):
            err = np.abs(r - h).mean() / np.abs(h).mean()
            assert err < 0.05, (i, err)
            assert np.corrcoef(r.ravel(), h.ravel())[0, 1] > 0.995


def test_key_sensitivity_by_hand():
    """Query energy of the group per pre-RoPE key channel, and W_o column energy per value channel
    (2 query heads, 1 KV head, 4 channels)."""
    from convert.geometry import Geometry
    g = Geometry("llama", 1, 2, 1, 4, 4, 10000.0, "norm", None)
    q_sq = np.array([[1.0, 3.0, 0.0, 2.0], [5.0, 1.0, 4.0, 4.0]])
    np.testing.assert_allclose(key_sensitivity(q_sq, g), [[6 / 4, 4 / 4, 4 / 4, 6 / 4]])
    wo = np.arange(16, dtype=np.float64).reshape(2, 8)            # [n_embd 2, n_head 2 x head_dim 4]
    np.testing.assert_allclose(value_sensitivity(wo, g),
                               [[0 + 64 + 16 + 144, 1 + 81 + 25 + 169, 4 + 100 + 36 + 196, 9 + 121 + 49 + 225]])


def test_moments_path_equals_samples_path(stats, smollm2):
    """The pre-RoPE statistics from the runtime's moments alone equal those computed from its samples, through a
    smoothing scale and a K-sort permutation (the per-channel maps they go through)."""
    g = geometry(read_gguf(smollm2))
    with_samples = from_runtime(stats, g)
    moments_only = from_runtime(stats, g)
    moments_only.q = moments_only.k = moments_only.v = None
    rng = np.random.default_rng(0)
    s = np.exp2(rng.integers(-2, 3, size=(g.n_head_kv, g.n_pairs))).astype(np.float32)
    perm = np.stack([rng.permutation(g.head_dim // 2) for _ in range(g.n_head_kv)])
    from convert.geometry import pair_perms_to_channels
    for dom in (cache_domain.Domain(), cache_domain.Domain(k_scale=s, k_perm=pair_perms_to_channels(perm, g))):
        for i in (0, 17):
            a = cache_domain.prerope_key_moments(with_samples, i, g, dom)
            b = cache_domain.prerope_key_moments(moments_only, i, g, dom)
            for x, y in zip(a, b):
                np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6 * float(np.abs(x).max()))
    assert pair_channels(g).shape == (32, 2)


def test_default_conversion_calibrates_in_the_runtime(smollm2, tmp_path, monkeypatch):
    """A GGUF input with --prerope-k and no --hf-dir: no HF checkpoint and no transformers pass (both made to
    fail here); the file's mean and scale are the runtime's statistics through prerope.stats_from_moments with
    the forward key sensitivity."""
    from convert import calib as calib_mod
    from convert import hf_checkpoint, to_gguf

    def refuse(*a, **k):
        raise AssertionError("the default conversion must not build an HF checkpoint or run transformers")
    monkeypatch.setattr(hf_checkpoint, "hf_checkpoint", refuse)
    monkeypatch.setattr(calib_mod, "collect", refuse)
    out = tmp_path / "smol-pre.gguf"
    s = to_gguf.convert(to_gguf.build_parser().parse_args(
        [str(smollm2), "-o", str(out), "--prerope-k", "--calib-seqs", str(N_SEQ), "--calib-len", str(SEQ_LEN),
         "--no-progress"]))
    assert s["sensitivity"] == "forward" and s["calibration_tokens_per_s"] > 0
    text = calibration_text("canterbury")[0]
    st = calibrate.collect_cached(smollm2, text, n_seq=N_SEQ, seq_len=SEQ_LEN)     # the converter's cache entry
    m = read_gguf(out)
    g = geometry(read_gguf(smollm2))
    for i in (0, 29):
        ls = st.layers[i]
        std = np.sqrt(np.maximum(ls.sq["k"] - ls.mean["k"] ** 2, 0))
        mean, scale = prerope.stats_from_moments(ls.mean["k"], std, None, "fisher",
                                                 fisher=key_sensitivity(ls.sq["q"], g))
        np.testing.assert_array_equal(np.asarray(m.tensors[Tensors.K_MEAN.format(bid=i)].data), mean)
        np.testing.assert_allclose(np.asarray(m.tensors[Tensors.K_SCALE.format(bid=i)].data), scale, rtol=1e-6)


def test_too_short_text_is_a_clear_error(smollm2):
    with pytest.raises(calibrate.CalibrationError, match="too short"):
        calibrate.collect(smollm2, "a few words", n_seq=2, seq_len=64)


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3 270M (gemma3: sliding-window layers, q/k norms before RoPE, head 256, one KV head)."""
    from pykvq.registry import fetch
    return fetch("gemma3-270m")


def test_gemma3_converts_in_the_runtime_and_its_prerope_cache_beats_stock(gemma3, tmp_path, wikitext):
    """An architecture outside the converter's table: --prerope-k alone, calibrated in the runtime (the rope layout
    from its ROPE nodes), run with the pre-RoPE cache in both its sliding-window and global layers. Reference: the
    same model's stock q4_0 cache in the same run (measured, 2 chunks: 0.094 vs 0.018)."""
    from pykvq import Model
    from test_convert import run_convert
    out = tmp_path / "gemma-pre.gguf"
    res = run_convert(gemma3, "-o", out, "--prerope-k", "--calib-seqs", "2", "--calib-len", "256")
    assert "pre-RoPE key domain: on" in res.stdout
    m = read_gguf(out)
    assert m.arch == "gemma3"
    assert all(np.asarray(m.tensors[Tensors.K_MEAN.format(bid=i)].data).shape == (1, 256) for i in range(18))
    kld = {}
    with Model(gemma3, n_ctx=512) as base:
        for name, path in (("stock", gemma3), ("prerope", out)):
            with Model(path, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True) as q:
                kld[name] = q.kl_divergence(wikitext, baseline=base, n_chunks=1, progress=False).mean_kld
    assert kld["prerope"] < 0.4 * kld["stock"], kld


def test_gemma3_budget_is_priced_in_the_runtime(gemma3, tmp_path, wikitext):
    """An architecture the backward pass does not run: --kv-bits takes --sensitivity probe by itself (per-layer types
    and codebooks for a 3.5-bit budget, the window counted at 4096 cells). Reference: the same budget priced by the
    forward weights alone, in the same run, each file's cache alone (3.23 bits: the window off, which at 512 tokens
    would hold 13% of the cells exact). Measured (1 / 4 chunks): forward 0.165 / 0.162, probe 0.103 / 0.096 (stock
    q4_0 at 4.5 bits 0.087 / 0.099); at 4096 tokens with the window the probe's file 0.079, stock q4_0 0.087."""
    from pykvq import Model
    from test_convert import run_convert
    args = ["--prerope-k", "--kv-bits", "3.5", "--kv-bits-ctx", "4096", "--calib-seqs", "2", "--calib-len", "256",
            "--probe-len", "128"]
    res = run_convert(gemma3, "-o", tmp_path / "probe.gguf", *args)
    assert "--sensitivity probe" in res.stdout + res.stderr and "budget prices measured in the runtime" in res.stdout
    run_convert(gemma3, "-o", tmp_path / "forward.gguf", *args, "--sensitivity", "forward")
    kld = {}
    with Model(gemma3, n_ctx=512) as base:
        for name in ("probe", "forward"):
            with Model(tmp_path / f"{name}.gguf", n_ctx=512, flash_attn=True, kv_window=0, kv_sinks=0) as q:
                kld[name] = q.kl_divergence(wikitext, baseline=base, n_chunks=1, progress=False).mean_kld
    assert kld["probe"] < 0.8 * kld["forward"], kld


def test_gemma3_weight_transforms_are_refused_by_name(gemma3, tmp_path):
    from test_convert import run_convert
    out = tmp_path / "x.gguf"
    res = run_convert(gemma3, "-o", out, "--ksort", "--prerope-k", check=False)
    assert res.returncode == 2 and "'gemma3' is not supported" in res.stderr and "--prerope-k without weight transforms" in res.stderr
    assert not out.exists()


def test_cli_writes_statistics_the_api_reads(smollm2, tmp_path, text):
    import subprocess
    import sys
    f = tmp_path / "calib.txt"
    f.write_text(text[:20000])
    out = tmp_path / "stats.npz"
    res = subprocess.run([sys.executable, "-m", "pykvq", "calibrate", "-m", str(smollm2), "-o", str(out), "--text",
                          str(f), "--seqs", "1", "--len", "64", "-t", "2"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "30 layers" in res.stdout and "rope layout norm" in res.stdout
    st = calibrate.RuntimeStats.load(out)
    assert len(st.layers) == 30 and st.n_seq == 1 and st.seq_len == 64 and st.rope_layout == "norm"
    assert st.layers[3].mean["k"].shape == (3, 64) and np.isfinite(st.layers[3].sq["q"]).all()


def test_calibration_corpus_is_checked_against_its_checksums(tmp_path):
    """The Canterbury texts are used only when each matches its sha256: a damaged cached copy is fetched again
    (and a download that does not match is refused, naming the file)."""
    import shutil
    from convert import calib
    calib.canterbury_text()                                   # fetched (or cached) and verified
    src = calib.cache_dir() / "calib" / "canterbury"
    d = tmp_path / "canterbury"
    shutil.copytree(src, d)
    assert calib._canterbury_ok(d)
    (d / "lcet10.txt").write_bytes((d / "lcet10.txt").read_bytes()[:-1] + b"!")
    assert not calib._canterbury_ok(d)
    (d / "lcet10.txt").unlink()
    assert not calib._canterbury_ok(d)
