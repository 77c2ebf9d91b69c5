"""Converter -> runtime for the NUQ types: Fisher codebooks and per-layer types on the real model."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from convert.gguf_io import read_gguf
from convert.layer_types import DEFAULT_LADDER, PREROPE_K_LADDER, VALUE_LADDER
from pykvq import Model, cache_types
from pykvq.keys import Keys, Tensors, suffix
from pykvq.ref import nuq

from test_convert import run_convert
from test_convert_prerope import convert_in_process

CALIB = ["--calib-seqs", "1", "--calib-len", "192"]


@pytest.fixture(scope="module")
def mixed_file(smollm2, module_tmp):
    out = module_tmp("nuq") / "smol-mixed.gguf"
    res = run_convert(smollm2, "-o", out, "--kv-bits", "3.6", *CALIB)
    return out, res.stdout


def _layer_types(m, which):
    return [str(t) for t in m.meta(Keys.Cache.LAYER_TYPES[which])]


def test_budget_file_records_types_and_valid_codebooks(mixed_file):
    path, stdout = mixed_file
    m = read_gguf(path)
    n = m.layer_count()
    bits = []
    for which in ("k", "v"):
        types = _layer_types(m, which)
        assert len(types) == n and set(types) <= set(DEFAULT_LADDER if which == "k" else VALUE_LADDER)
        for i, t in enumerate(types):
            bits.append(8.5 if t == "q8_0" else nuq.FORMATS[t].bits_per_value)
            cb = m.tensors.get(Tensors.CODEBOOK[which].format(bid=i))
            if t in nuq.FORMATS:
                f = nuq.FORMATS[t]
                raw = np.asarray(cb.data).reshape(-1)
                assert raw.shape == (16,) and not raw[f.n_codes:].any()
                nuq.check_codebook(raw[:f.n_codes], t)         # int8, strictly ascending
            else:
                assert cb is None
    assert np.mean(bits) <= 3.6 + 1e-9
    assert m.meta(Keys.Cache.CODEBOOK_METHOD) == "fisher"
    assert bool(m.meta(Keys.Cache.CODEBOOK_ROT_K)) and bool(m.meta(Keys.Cache.CODEBOOK_ROT_V))
    assert "bits/value" in stdout and "per layer" in stdout


def test_runtime_takes_the_files_types_and_codebooks(mixed_file, smollm2, passage):
    path, _ = mixed_file
    m = read_gguf(path)
    with Model(path, n_ctx=512) as rt:
        got = rt.layer_cache_types()
        assert [k for k, _ in got] == _layer_types(m, "k")
        assert [v for _, v in got] == _layer_types(m, "v")
        src = rt.codebook_sources()
        for (tk, tv), (sk, sv) in zip(got, src):
            assert sk == ("file" if tk in nuq.FORMATS else "")
            assert sv == ("file" if tv in nuq.FORMATS else "")
        bits = [8.5 if t == "q8_0" else nuq.FORMATS[t].bits_per_value for kv in got for t in kv]
        assert rt.kv_cache_info().bits_per_value == pytest.approx(np.mean(bits), rel=1e-6)
        assert rt.attn_rotation == {"K": True, "V": True}
        ppl = rt.perplexity(passage, n_ctx=256)
    assert math.isfinite(ppl.ppl) and ppl.ppl < 100
    # forcing one type for every layer overrides the file (its codebooks no longer apply to nuq2)
    with Model(path, n_ctx=512, cache_type_k="nuq2", cache_type_v="nuq2") as forced:
        assert set(forced.layer_cache_types()) == {("nuq2", "nuq2")}
        assert all(s == ("fallback", "fallback") for s in forced.codebook_sources())


def test_uniform_type_file_has_one_codebook_per_layer(smollm2, tmp_path):
    out = tmp_path / "smol-nuq3o.gguf"
    run_convert(smollm2, "-o", out, "--cache-type-k", "nuq3o", "--cache-type-v", "nuq3o", "--codebooks", "kmeans",
                *CALIB)
    m = read_gguf(out)
    assert m.meta(Keys.Cache.LAYER_TYPES_K) is None
    assert m.meta(Keys.Cache.TYPE_K) == "nuq3o" and m.meta(Keys.Cache.CODEBOOK_METHOD) == "kmeans"
    assert sum(n.endswith(suffix(Tensors.CODEBOOK_K)) for n in m.tensors) == m.layer_count()
    with Model(out, n_ctx=256) as rt:
        assert rt.cache_type_k == "nuq3o" and all(s == ("file", "file") for s in rt.codebook_sources())


def test_bad_budget_and_types_are_refused(smollm2, tmp_path):
    out = tmp_path / "x.gguf"
    res = run_convert(smollm2, "-o", out, "--kv-bits", "2.0", *CALIB, check=False)
    assert res.returncode == 2 and "below the cheapest" in res.stderr
    res = run_convert(smollm2, "-o", out, "--kv-bits", "4", "--layer-types", "nuq3,bogus", check=False)
    assert res.returncode == 2 and "bogus" in res.stderr
    res = run_convert(smollm2, "-o", out, "--prerope-k", "--kv-bits", "4", "--layer-types-k", "q42_64,bogus", *CALIB,
                      check=False)
    assert res.returncode == 2 and "bogus" in res.stderr
    assert not out.exists()


def test_budget_counts_the_window_at_a_context(smollm2, tmp_path):
    """--kv-bits-ctx N: the budget is the whole cache's at N cells, the window's q8_0 rows included (8.5 x (4 + 64 + 1)
    / 4096 = 0.1432 bits/value for a --prerope-k file's default sinks, window and row type), so the per-layer types
    share what is left; a budget the window alone would eat is refused before calibration, and nothing is written."""
    out = tmp_path / "smol-3.6-at-4096.gguf"
    res = run_convert(smollm2, "-o", out, "--prerope-k", "--kv-bits", "3.6", "--kv-bits-ctx", "4096", *CALIB)
    m = read_gguf(out)
    bits = [cache_types.bits_per_value(t) for which in ("k", "v") for t in _layer_types(m, which)]
    window = 8.5 * (4 + 64 + 1) / 4096
    assert np.mean(bits) <= 3.6 - window + 1e-9
    assert np.mean(bits) > 3.6 - window - 0.5          # the budget is spent, not left idle
    assert "the window's 0.143 at 4096 cells" in res.stdout
    assert "counts the errors of reads the window leaves quantized" in res.stdout     # the default budget
    # a pre-RoPE file's keys may be split by importance by default (CUDA kernels too: no warning); V's own ladder
    # (nuq3_64 in it; the cache's 3.46 bits keep nuq2_64 out)
    assert set(_layer_types(m, "k")) <= set(PREROPE_K_LADDER) and set(_layer_types(m, "v")) <= set(VALUE_LADDER)
    assert str(m.meta(Keys.Baked.KSORT_KEY)) == "importance"
    assert "have CPU kernels only" not in res.stdout
    # the key scale's Fisher power: the ladder's nuq2o makes the file's 0.15, and the layers whose keys take uniform
    # blocks of 3.5 bits or more are scaled at 1/4 (prerope.fisher_power; the same layer as --prerope-k-power gives it)
    tk = _layer_types(m, "k")
    def takes_quarter(t):
        return t not in nuq.FORMATS and cache_types.bits_per_value(t) >= 3.5
    plain = [i for i, t in enumerate(tk) if takes_quarter(t)]
    assert plain and len(plain) < len(tk), tk
    assert "std^0.7 / Fisher^0.15" in res.stdout
    assert f"(Fisher^0.25 in the {len(plain)} layers whose keys take uniform blocks of 3.5 bits or more)" in res.stdout
    # the budget weighed each K candidate in the scale it gets if chosen: a uniform >= 3.5-bit type's error is the
    # one of a file converted at 1/4 throughout, a codebook's or a 2-bit type's the one at 0.15
    errors = convert_in_process(smollm2, "-o", tmp_path / "again.gguf", "--prerope-k", "--kv-bits", "3.6",
                                "--kv-bits-ctx", "4096", *CALIB)["codebook_errors"]
    for a in ("0.15", "0.25"):
        fixed = tmp_path / f"smol-power-{a}.gguf"
        at_a = convert_in_process(smollm2, "-o", fixed, "--prerope-k", "--kv-bits", "3.6", "--kv-bits-ctx", "4096",
                                  "--prerope-k-power", a, *CALIB)["codebook_errors"]
        f = read_gguf(fixed)
        for i in range(len(tk)):
            got, want = (np.asarray(x.tensors[Tensors.K_SCALE.format(bid=i)].data) for x in (m, f))
            assert np.array_equal(got, want) == ((i in plain) == (a == "0.25")), (a, i, tk[i])
            for key, e in errors[i].items():
                if key.startswith("k:"):
                    assert (e == at_a[i][key]) == (takes_quarter(key.removeprefix("k:")) == (a == "0.25")), (a, i, key)
    bad = tmp_path / "x.gguf"
    res = run_convert(smollm2, "-o", bad, "--prerope-k", "--kv-bits", "3.0", "--kv-bits-ctx", "512", *CALIB, check=False)
    assert res.returncode == 2 and "below the cheapest" in res.stderr and "for the cache" in res.stderr
    assert not bad.exists()


def test_budget_with_a_key_ladder_of_its_own_takes_the_halves_types(smollm2, wiki_file, tmp_path):
    """--layer-types-k: K's candidates apart from V's, here with q42_64 / q53_64 (the key types split by importance).
    The file lays every head's pairs out by importance, K's per-layer types come from K's ladder and V's from V's,
    and the runtime turns every layer's keys within each half (the domain the K codebooks were fitted in).
    Measured (4 x 512 calibration, 2 x 4096 WikiText-2, KLD vs f16): 0.0189 -> see docs/RESULTS.md."""
    from conftest import run_tool
    out = tmp_path / "smol-hk.gguf"
    k_ladder = ("nuq2o", "q42_64", "q53_64", "q8_0")
    run_convert(smollm2, "-o", out, "--prerope-k", "--kv-bits", "3.5", "--kv-bits-ctx", "4096",
                "--layer-types-k", ",".join(k_ladder), *CALIB)
    m = read_gguf(out)
    tk, tv = _layer_types(m, "k"), _layer_types(m, "v")
    assert set(tk) <= set(k_ladder) and {"q42_64", "q53_64"} & set(tk), tk
    assert set(tv) <= set(VALUE_LADDER), tv
    assert str(m.meta(Keys.Baked.KSORT_KEY)) == "importance"
    for i, t in enumerate(tk):          # a K codebook for the nuq layers alone
        assert (Tensors.CODEBOOK_K.format(bid=i) in m.tensors) == (t in nuq.FORMATS)
    r = run_tool("llama-perplexity", "-m", out, "-fa", "on", "-c", "128", "--chunks", "1", "-f", wiki_file, "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "online Hadamard of the centred K on, within each half of the blocks" in r.stderr, r.stderr[-3000:]
    res = run_convert(smollm2, "-o", tmp_path / "x.gguf", "--kv-bits", "3.5", "--layer-types-k", ",".join(k_ladder),
                      *CALIB, check=False)
    assert res.returncode == 2 and "q42_64 in --layer-types-k needs --prerope-k" in res.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_budget_that_picks_no_halves_type_leaves_the_rotation_head_wide(smollm2, wiki_file, tmp_path):
    """A pre-RoPE budget at its cheapest (K and V nuq2_64 everywhere) takes no q42_64 / q53_64 key: the runtime
    turns the keys head-wide, and the file's K codebooks were fitted again for that rotation (the halves rotation they
    were first fitted in is not what the cache holds; SmolLM2 at 4096 tokens, see docs/RESULTS.md)."""
    from conftest import run_tool
    out = tmp_path / "smol-2.25.gguf"
    run_convert(smollm2, "-o", out, "--prerope-k", "--kv-bits", "2.25", *CALIB)
    m = read_gguf(out)
    assert set(_layer_types(m, "v")) == {"nuq2_64"}
    assert set(_layer_types(m, "k")) == {"nuq2_64"} and str(m.meta(Keys.Baked.KSORT_KEY)) == "importance"
    r = run_tool("llama-perplexity", "-m", out, "-fa", "on", "-c", "128", "--chunks", "1", "-f", wiki_file, "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "online Hadamard of the centred K on" in r.stderr and "within each half" not in r.stderr


def test_key_codebooks_leave_out_the_positions_the_runtime_keeps_exact(smollm2, tmp_path):
    """The sinks a --prerope-k file keeps in f16 by default are left out of its K codebooks' fit: the same conversion
    with --kv-sinks 0 fits the same V codebooks and other K codebooks."""
    cbs = {}
    for sinks in ("4", "0"):
        out = tmp_path / f"smol-nuq3-sinks{sinks}.gguf"
        run_convert(smollm2, "-o", out, "--prerope-k", "--cache-type-k", "nuq3", "--cache-type-v", "nuq3",
                    "--kv-sinks", sinks, *CALIB)
        m = read_gguf(out)
        cbs[sinks] = {w: [np.asarray(m.tensors[Tensors.CODEBOOK[w].format(bid=i)].data).reshape(-1)
                          for i in range(m.layer_count())] for w in ("k", "v")}
    assert all((a == b).all() for a, b in zip(cbs["4"]["v"], cbs["0"]["v"]))
    assert sum((a != b).any() for a, b in zip(cbs["4"]["k"], cbs["0"]["k"])) >= len(cbs["4"]["k"]) // 2
    from convert.pipeline import Options
    assert Options(prerope_k=True).exact_positions() == 4
    assert Options(prerope_k=True, kv_sinks=0).exact_positions() == 0
    assert Options().exact_positions() == 0             # a post-RoPE file keeps no window
    assert Options(prerope_k=True, kv_bits=3.6, kv_bits_ctx=4096).cache_bits() == pytest.approx(3.6 - 8.5 * 69 / 4096)
    assert Options(prerope_k=True, kv_bits=3.6, kv_bits_ctx=4096,
                   kv_window_type="f16").cache_bits() == pytest.approx(3.6 - 16 * 69 / 4096)
    assert Options(prerope_k=True, kv_bits=3.6).cache_bits() == 3.6


def test_window_weights_are_the_attention_the_quantized_reads_get():
    """convert/window_weights.py by hand: with q = 0 every query t spreads its attention evenly, p_ts = 1 / (t + 1)
    for s <= t, so key s gets sum over the queries that read it quantized (t - s >= W, s >= S) of 1 / (t + 1), over
    its mean without a window (1: T queries' mass over T keys), and its value sum 1 / (t + 1)^2 over T / H_T (the
    mean of the squared mass, H_T the harmonic number). No window, no sinks: every weight's mean is 1."""
    from convert.geometry import Geometry
    from convert.window_weights import read_weights
    g = Geometry("llama", 1, 4, 2, 8, 8, 10000.0, "norm", None)
    T, S, W = 40, 3, 5
    pos = np.concatenate([np.arange(T)] * 2)                     # two calibration sequences
    rng = np.random.default_rng(1)
    q = np.zeros((2 * T, 4, 8), np.float32)
    k = rng.normal(size=(2 * T, 2, 8)).astype(np.float32)
    wk, wv = read_weights(q, k, pos, g, S, W)
    inv = 1.0 / np.arange(1, T + 1)
    want_k = np.array([inv[s + W:].sum() if s >= S else 0.0 for s in range(T)])
    want_v = np.array([(inv[s + W:] ** 2).sum() if s >= S else 0.0 for s in range(T)]) * T / inv.sum()
    for half in (slice(0, T), slice(T, 2 * T)):
        np.testing.assert_allclose(wk[half], np.repeat(want_k[:, None], 2, axis=1), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(wv[half], np.repeat(want_v[:, None], 2, axis=1), rtol=1e-5, atol=1e-7)
    q = rng.normal(size=(2 * T, 4, 8)).astype(np.float32)
    wk, wv = read_weights(q, k, pos, g, 0, 0)
    assert wk.mean() == pytest.approx(1.0, rel=1e-5) and wv.mean() == pytest.approx(1.0, rel=1e-5)
    wk, wv = read_weights(q, k, pos, g, 0, T)                     # a window as long as the text: nothing quantized
    assert not wk.any() and not wv.any()


def test_window_attention_keeps_the_forward_pass_and_drops_the_exact_reads_gradients():
    """convert/calib.py's attention for --kv-bits-weights window: the same output as plain causal attention, and
    gradients w.r.t. K and V that come only through reads of quantized cells. With sinks 0 and window 0 (every read
    quantized) they are plain attention's; with a window as long as the sequence, or sinks covering it, none."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from convert.calib import _window_attention
    rng = np.random.default_rng(2)
    B, H, Hkv, T, D = 1, 4, 2, 24, 8
    q, k, v = (torch.from_numpy(rng.normal(size=(B, h, T, D)).astype(np.float32)) for h in (H, Hkv, Hkv))
    mod = SimpleNamespace(num_key_value_groups=H // Hkv)

    def plain(q, k, v):
        k2, v2 = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        s = (q @ k2.transpose(2, 3)) / np.sqrt(D)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(s, dim=-1) @ v2).transpose(1, 2)

    def grads(fn):
        kk, vv = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
        out = fn(q, kk, vv)
        (out * torch.from_numpy(rng.normal(size=out.shape).astype(np.float32))).sum().backward()
        return out.detach(), kk.grad, vv.grad

    rng_state = rng.bit_generator.state
    o_ref, gk_ref, gv_ref = grads(plain)
    for (sinks, window), same in (((0, 0), True), ((0, T), False), ((T, 0), False), ((3, 5), None)):
        rng.bit_generator.state = rng_state                   # the same upstream gradient for every case
        att = _window_attention(sinks, window)
        o, gk, gv = grads(lambda q, k, v: att(mod, q, k, v, None, scaling=1 / np.sqrt(D))[0])
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
        if same is True:
            torch.testing.assert_close(gk, gk_ref, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(gv, gv_ref, rtol=1e-4, atol=1e-6)
        elif same is False:
            assert not gk.any() and not gv.any()
        else:                        # the sinks and the last `window` keys are read only exactly: no gradient
            assert not gk[:, :, :sinks].any() and not gv[:, :, :sinks].any()
            assert not gk[:, :, T - window:].any() and not gv[:, :, T - window:].any()
            assert gk[:, :, sinks:T - window].abs().sum(dim=-1).gt(0).all()


def test_forward_budget_weighs_tokens_by_the_window(smollm2, tmp_path):
    """--sensitivity forward (runtime calibration, no backward pass) with --kv-bits and the file's window: each layer's
    errors are weighed by window_weights.read_weights, whose per-layer mean shares the converter prints (each in
    [0, 1]: the window only removes reads); --kv-bits-weights uniform prints none and says nothing of the window."""
    out = tmp_path / "smol-fw.gguf"
    res = run_convert(smollm2, "-o", out, "--prerope-k", "--kv-bits", "3.6", "--sensitivity", "forward", *CALIB)
    line = next(x for x in res.stdout.splitlines() if "share per layer" in x)
    shares = [float(x) for x in line.split("K ")[1].replace("; V", "").split()]
    assert len(shares) == 2 * read_gguf(out).layer_count() and all(0.0 <= x <= 1.0 for x in shares)
    assert "counts the errors of reads the window leaves quantized" in res.stdout
    res = run_convert(smollm2, "-o", tmp_path / "smol-fu.gguf", "--prerope-k", "--kv-bits", "3.6", "--sensitivity",
                      "forward", "--kv-bits-weights", "uniform", *CALIB)
    assert "share per layer" not in res.stdout and "window leaves quantized" not in res.stdout
