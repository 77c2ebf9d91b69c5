"""Converter --prerope-k: per-layer pre-RoPE K mean / scale tensors, the k_domain key, and codebooks
fitted in the pre-RoPE centred domain (convert/prerope.py, convert/cache_domain.py).

Everything runs on the real SmolLM2 file with a small calibration (2 x 256 tokens of the default
text), which the converter caches under $PYKVQ_CACHE/calib/stats: the test's own Calib and every
conversion below read the same statistics, so recomputing the file's numbers from them is exact.
The runtime side (loading such a file) is tested with the runtime; these files are not loaded here.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from convert import cache_domain, codebook, prerope, rows
from convert.calib import Calib, calibration_text, collect_cached
from convert.geometry import Geometry, geometry
from convert.gguf_io import read_gguf
from pykvq.keys import Keys, Tensors, Values

from test_convert import CONVERT, run_convert

CALIB = ["--calib-seqs", "2", "--calib-len", "256"]


@pytest.fixture(scope="module")
def geo(smollm2) -> Geometry:
    return geometry(read_gguf(smollm2))


@pytest.fixture(scope="module")
def calib(smollm2_hf, geo) -> Calib:
    """The calibration the converter runs for CALIB (same HF dir, text and settings: the same cache entry)."""
    text, source = calibration_text("canterbury")
    return collect_cached(smollm2_hf, text, geo, n_seq=2, seq_len=256, source=source, fisher=True)


def convert_in_process(*args) -> dict:
    """to_gguf.convert() in this process: its summary carries the per-layer codebook errors."""
    from convert import to_gguf
    return to_gguf.convert(to_gguf.build_parser().parse_args([*map(str, args), "--no-progress"]))


@pytest.fixture(scope="module")
def files(smollm2, smollm2_hf, calib, module_tmp):
    d = module_tmp("prerope")
    out = {}
    assert prerope.DEFAULT_SCALE == "fisher"                              # what the checks below recompute
    for name, flags in (("plain", ["--prerope-k"]),
                        ("one", ["--prerope-k", "--prerope-k-scale", "one"]),
                        ("ksort", ["--ksort", "--prerope-k"])):
        path = d / f"{name}.gguf"
        res = run_convert(smollm2, "-o", path, "--hf-dir", smollm2_hf, *flags, *CALIB)
        out[name] = (path, res.stdout)
    return out


@pytest.fixture(scope="module")
def nuq_files(smollm2, smollm2_hf, calib, module_tmp):
    """nuq4 K with Fisher codebooks, pre-RoPE and (for comparison) post-RoPE; V stays q4_0 (no V codebooks)."""
    d = module_tmp("prerope-nuq")
    out = {}
    for name, flags in (("pre", ["--prerope-k"]), ("post", [])):
        path = d / f"{name}.gguf"
        s = convert_in_process(smollm2, "-o", path, "--hf-dir", smollm2_hf, "--codebooks", "fisher",
                               "--cache-type-k", "nuq4", "--cache-type-v", "q4_0", *flags, *CALIB)
        out[name] = (path, s)
    return out


def _stats(m, i, names=(Tensors.K_MEAN, Tensors.K_SCALE)):
    return tuple(np.asarray(m.tensors[t.format(bid=i)].data) for t in names)


def test_file_has_mean_and_scale_for_every_layer(files, smollm2, geo):
    path, stdout = files["plain"]
    m, src = read_gguf(path), read_gguf(smollm2)
    assert m.meta(Keys.Cache.K_DOMAIN) == Values.K_DOMAIN_PREROPE
    assert m.meta(Keys.Cache.K_SCALE_METHOD) == prerope.DEFAULT_SCALE
    assert m.meta(Keys.Cache.CODEBOOK_ROT_K) is None                   # no codebooks asked for
    for i in range(geo.n_layer):
        for name in (Tensors.K_MEAN.format(bid=i), Tensors.K_SCALE.format(bid=i), Tensors.K_STD.format(bid=i),
                     Tensors.Q_MEAN.format(bid=i)):
            t = m.tensors[name]
            assert t.qtype.name == "F32" and t.data.dtype == np.float32
            assert t.data.shape == (geo.n_head_kv, geo.head_dim)           # ggml ne = [head_dim, n_head_kv]
            assert np.isfinite(t.data).all()
        assert (m.tensors[Tensors.K_SCALE.format(bid=i)].data > 0).all()
    # nothing else changes: the weights are the input's, byte for byte
        assert np.abs(m.tensors[Tensors.Q_MEAN.format(bid=i)].data).max() > 0     # the heavy hitters' score
    assert len(m.tensors) == len(src.tensors) + 4 * geo.n_layer            # mean, scale, std, the queries' mean
    for name, t in src.tensors.items():
        assert m.tensors[name].qtype == t.qtype and np.array_equal(m.tensors[name].data, t.data), name
    assert "pre-RoPE key domain: on" in stdout and "turned by the online Hadamard" in stdout
    assert "scale = per-channel std^0.5 / Fisher^0.25" in stdout


def test_file_layout_and_reader_agree(files, geo):
    """gguf-py's reader gives numpy [n_head_kv, head_dim], i.e. ggml ne = [head_dim, n_head_kv]."""
    import gguf
    r = gguf.GGUFReader(files["plain"][0], "r")
    t = next(t for t in r.tensors if t.name == Tensors.K_MEAN.format(bid=3))
    assert [int(n) for n in t.shape] == [geo.head_dim, geo.n_head_kv]
    assert r.get_field(Keys.Cache.K_DOMAIN).contents() == Values.K_DOMAIN_PREROPE


def test_mean_and_scale_match_the_calibration_keys(files, calib, geo):
    """SmolLM2 is a llama file: its layout is NORM, which is also calibration's order, and without
    other transforms k_pre is calib.k itself (k_proj output; a bias would be in it)."""
    m = read_gguf(files["plain"][0])
    one = read_gguf(files["one"][0])
    clipped = 0
    for i in range(geo.n_layer):
        k = calib.k[i].astype(np.float64)
        mean, scale, std = _stats(m, i, (Tensors.K_MEAN, Tensors.K_SCALE, Tensors.K_STD))
        want_mean = k.mean(axis=0)
        np.testing.assert_allclose(mean, want_mean, rtol=1e-4, atol=1e-4 * np.abs(want_mean).max())
        spread = k.std(axis=0)
        want_std = np.maximum(spread, prerope.STD_FLOOR * np.median(spread, axis=1, keepdims=True))
        np.testing.assert_allclose(std, want_std, rtol=1e-4)
        # the default scale, by hand: s = std^0.5 / F^0.25 (F = mean squared gradient), clipped to 16x the
        # head's median, then normalised so that the median std / s is 1
        assert prerope.FISHER_POWER == 0.25
        f = (calib.gk[i].astype(np.float64) ** 2).mean(axis=0)
        s = want_std ** 0.5 / f ** 0.25
        med = np.median(s, axis=1, keepdims=True)
        clipped += int(((s < med / 16) | (s > med * 16)).sum())
        s = np.clip(s, med / 16, med * 16)
        np.testing.assert_allclose(scale, s * np.median(want_std / s, axis=1, keepdims=True), rtol=1e-4)
        np.testing.assert_allclose(np.median(want_std / scale, axis=1), 1.0, rtol=1e-4)
        m1, s1 = _stats(one, i)
        np.testing.assert_array_equal(m1, mean)
        assert (s1 == 1.0).all()
    assert one.meta(Keys.Cache.K_SCALE_METHOD) == "one" and "1 (mean only)" in files["one"][1]
    print(f"{clipped} of {geo.n_layer * geo.n_head_kv * geo.head_dim} fisher scales clipped")


def test_ksort_mean_is_in_the_permuted_layout(files, smollm2, geo):
    """K-sort moves whole W_k rows within each KV head; the mean/scale of channel c of the sorted file
    are those of the unsorted file's channel the row came from."""
    plain, ks = read_gguf(files["plain"][0]), read_gguf(files["ksort"][0])
    src = read_gguf(smollm2)
    moved = 0
    for i in range(geo.n_layer):
        w0 = rows.to_f32(src.tensors[f"blk.{i}.attn_k.weight"]).reshape(geo.n_head_kv, geo.head_dim, -1)
        w1 = rows.to_f32(ks.tensors[f"blk.{i}.attn_k.weight"]).reshape(geo.n_head_kv, geo.head_dim, -1)
        perm = np.empty((geo.n_head_kv, geo.head_dim), np.int64)
        for h in range(geo.n_head_kv):
            for c in range(geo.head_dim):
                hit = np.flatnonzero((w0[h] == w1[h, c]).all(axis=1))
                assert len(hit) >= 1, (i, h, c)
                perm[h, c] = hit[0]
        assert all(sorted(p) == list(range(geo.head_dim)) for p in perm)
        moved += int((perm != np.arange(geo.head_dim)).any())
        mean0, scale0 = _stats(plain, i)
        mean1, scale1 = _stats(ks, i)
        np.testing.assert_allclose(mean1, np.take_along_axis(mean0, perm, axis=1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(scale1, np.take_along_axis(scale0, perm, axis=1), rtol=1e-5)
    assert moved > geo.n_layer // 2                                       # the sort really moved channels
    assert ks.meta(Keys.Cache.K_DOMAIN) == Values.K_DOMAIN_PREROPE and Tensors.ROPE_FREQS.format(bid=0) in ks.tensors


def test_codebooks_are_fitted_in_the_prerope_domain(nuq_files, calib, geo):
    (pre_path, pre), (post_path, post) = nuq_files["pre"], nuq_files["post"]
    mp, mq = read_gguf(pre_path), read_gguf(post_path)
    assert mp.meta(Keys.Cache.K_DOMAIN) == Values.K_DOMAIN_PREROPE and mq.meta(Keys.Cache.K_DOMAIN) is None
    assert mp.meta(Keys.Cache.CODEBOOK_ROT_K) is True                  # the centred keys are turned too
    assert mq.meta(Keys.Cache.CODEBOOK_ROT_K) is True
    differ = 0
    for i in range(geo.n_layer):
        cb_pre = np.asarray(mp.tensors[Tensors.CODEBOOK_K.format(bid=i)].data)
        cb_post = np.asarray(mq.tensors[Tensors.CODEBOOK_K.format(bid=i)].data)
        assert Tensors.CODEBOOK_V.format(bid=i) not in mp.tensors
        mean, scale = _stats(mp, i)
        d = cache_domain.Domain(k_prerope=True, k_mean=mean, k_div=scale, rot_k=True)
        x = cache_domain.keys(calib, i, geo, d)
        fit = calib.pos >= 4            # the sinks a pre-RoPE file keeps exact (--kv-sinks 4) are left out of the fit
        want = codebook.fit(x.x[fit], x.fisher[fit], "nuq4", "fisher", q_norm=True)
        np.testing.assert_array_equal(cb_pre[:16], want)
        differ += int(not np.array_equal(cb_pre, cb_post))
        # the error the converter reports is sum F (c - Q(c))^2 in this domain, with the file's codebook
        err = codebook.weighted_error(x.x, x.fisher, "nuq4", cb_pre[:16])
        assert pre["codebook_errors"][i]["k:nuq4"] == pytest.approx(err, rel=1e-6)
        post_x = cache_domain.keys(calib, i, geo, cache_domain.Domain(rot_k=True))
        assert post["codebook_errors"][i]["k:nuq4"] == pytest.approx(
            codebook.weighted_error(post_x.x, post_x.fisher, "nuq4", cb_post[:16]), rel=1e-6)
    assert differ > geo.n_layer // 2
    # both are loss-increase estimates (F = (dL/dvalue)^2), so they compare across domains
    tot = {k: sum(e["k:nuq4"] for e in s["codebook_errors"]) for k, s in (("pre", pre), ("post", post))}
    assert tot["pre"] < tot["post"]
    assert pre["prerope_k"]["scale"] == prerope.DEFAULT_SCALE and post["prerope_k"] is None


def test_domain_maps_values_and_gradients(geo):
    """keys() in the pre-RoPE domain: the baked transforms, then (x - mean)/scale; gradients times scale,
    so sum F (c - c')^2 = sum (dL/dx)^2 (x - x')^2 whatever the scale."""
    rng = np.random.default_rng(0)
    T, H, D = 40, geo.n_head_kv, geo.head_dim
    k = rng.standard_normal((T, H, D)).astype(np.float32) * 3 + 5
    gk = rng.standard_normal((T, H, D)).astype(np.float32)
    c = Calib(q=[None], k=[k], pos=np.arange(T), source="synthetic", v=[k], gk=[gk], gv=[gk])
    s = np.exp2(rng.integers(-2, 3, (H, D // 2))).astype(np.float32)
    perm = np.stack([rng.permutation(D // 2) for _ in range(H)])
    from convert.geometry import pair_perms_to_channels
    cp = pair_perms_to_channels(perm, geo)
    base = cache_domain.Domain(k_scale=s, k_perm=cp)
    kp = cache_domain.prerope_keys(c, 0, geo, base)
    want = np.take_along_axis(k / np.repeat(s, 2, axis=1)[None], cp[None], axis=2)
    np.testing.assert_allclose(kp, want, rtol=1e-6)
    mean, scale = prerope.stats(kp, "std")
    import dataclasses
    x = cache_domain.keys(c, 0, geo, dataclasses.replace(base, k_prerope=True, k_mean=mean, k_div=scale))
    np.testing.assert_allclose(x.x, prerope.encode(kp, mean, scale), rtol=1e-5, atol=1e-5)
    g_x = np.take_along_axis(gk * np.repeat(s, 2, axis=1)[None], cp[None], axis=2)
    np.testing.assert_allclose(x.fisher, (g_x * scale) ** 2, rtol=1e-5)
    with pytest.raises(ValueError, match="mean and scale"):
        cache_domain.keys(c, 0, geo, cache_domain.Domain(k_prerope=True))
    # a NEOX file (qwen2 without K-sort): the mean is in NEOX order, channel j pairs with j + n_rot/2
    from convert.rope_layout import neox_to_norm
    gx = geo.with_layout("neox")
    kx = cache_domain.prerope_keys(c, 0, gx, cache_domain.Domain(layout="neox"))
    np.testing.assert_array_equal(kx[..., neox_to_norm(gx)], k)


def test_stats_floor_and_methods():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((500, 2, 64)) * np.linspace(0.5, 4, 64) + 10
    k[:, 0, 5] = 3.0                                                      # a channel that never moves
    mean, scale = prerope.stats(k, "std")
    med = np.median(k.std(axis=0), axis=1)
    assert scale[0, 5] == pytest.approx(prerope.STD_FLOOR * med[0], rel=1e-5) and mean[0, 5] == pytest.approx(3.0)
    np.testing.assert_allclose(scale[1], k[:, 1].std(axis=0), rtol=1e-5)
    _, amax = prerope.stats(k, "absmax")
    np.testing.assert_allclose(amax[1], np.abs(k[:, 1] - k[:, 1].mean(axis=0)).max(axis=0), rtol=1e-5)
    assert amax[0, 5] == pytest.approx(prerope.STD_FLOOR * np.median(amax[0]), rel=1e-2)
    _, p2 = prerope.stats(k, "pow2")
    assert np.array_equal(np.exp2(np.round(np.log2(p2))), p2)
    assert (prerope.stats(k, "one")[1] == 1).all()
    with pytest.raises(ValueError):
        prerope.stats(k, "bogus")


def test_fisher_power_follows_the_key_types():
    """a = 1/4 for keys of 3.5 bits/value or more, 0.15 once any layer's keys may take fewer (measured, prerope.py);
    given, it is used as given; the scale follows it (std^(1-2a) / F^a before the clip and normalisation)."""
    from convert.pipeline import Options
    assert Options(prerope_k=True).fisher_power() == prerope.FISHER_POWER == 0.25            # q4_0 keys
    assert Options(prerope_k=True, cache_type_k="q53_64", cache_type_v="q4_0").fisher_power() == 0.25
    assert Options(prerope_k=True, cache_type_k="nuq4").fisher_power() == 0.25
    assert Options(prerope_k=True, cache_type_k="q42_64", cache_type_v="nuq2o").fisher_power() == 0.25
    assert Options(prerope_k=True, cache_type_k="nuq2o").fisher_power() == prerope.FISHER_POWER_LOW == 0.15
    assert Options(prerope_k=True, kv_bits=3.5).fisher_power() == 0.15                        # the ladder has nuq2o
    assert Options(prerope_k=True, kv_bits=4.5, ladder_k=("q42_64", "q53_64", "q8_0")).fisher_power() == 0.25
    assert Options(prerope_k=True, cache_type_k="nuq2o", prerope_power=0.3).fisher_power() == 0.3
    rng = np.random.default_rng(2)
    std, f = rng.uniform(0.5, 2, (2, 64)), rng.uniform(0.5, 2, (2, 64))
    for a in (0.15, 0.25):
        s = prerope.fisher_scale(std, f, clip=1e9, power=a)
        np.testing.assert_allclose(s / s[:, :1], (std ** (1 - 2 * a) / f ** a) / (std[:, :1] ** (1 - 2 * a) / f[:, :1] ** a),
                                   rtol=1e-12)
    res = subprocess.run([sys.executable, str(CONVERT), "x.gguf", "-o", "y.gguf", "--prerope-k-power", "0.7"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "within [0, 0.5]" in res.stderr


def test_help_explains_prerope():
    res = subprocess.run([sys.executable, str(CONVERT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    for what in ("--prerope-k", "--prerope-k-scale", "before RoPE", "kvq_k_mean", "online K Hadamard"):
        assert what in text, what
