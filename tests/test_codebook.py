"""Converter side of the NUQ types: codebook fitting, Q-Norm, per-layer type budgets,
and the calibration domain (K/V as the cache holds them)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convert import cache_domain, codebook, layer_types
from convert.geometry import Geometry
from convert.hadamard import hadamard
from pykvq.ref import nuq


def test_to_int8_is_strictly_ascending_and_clipped():
    c = codebook.to_int8([-300, -126.6, -126.4, 0.2, 0.4, 127.2, 200])
    assert c.dtype == np.int8
    assert c.tolist() == [-127, -126, -125, 0, 1, 126, 127]
    nuq.check_codebook(c[:4], "nuq2")


def test_weighted_kmeans_finds_the_two_weighted_means():
    v = np.array([-100, -90, -80, 50, 60, 70], np.float32)
    w = np.array([1, 1, 2, 1, 0, 1], np.float64)
    c = codebook.weighted_kmeans(v, w, 2)
    assert c == pytest.approx([(-100 - 90 - 160) / 4, (50 + 70) / 2])


def test_fisher_codebook_lowers_the_weighted_error_it_optimises():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 2, 64)).astype(np.float32) * np.linspace(0.2, 3, 64, dtype=np.float32)
    f = rng.gamma(0.3, 1.0, x.shape).astype(np.float32)           # heavy-tailed sensitivities
    for t in ("nuq3", "nuq2o"):
        err = {m: codebook.weighted_error(x, f, t, None if m == "fallback" else
                                          codebook.fit(x, f, t, m, q_norm=False))
               for m in ("fallback", "uniform", "kmeans", "fisher")}
        assert err["fisher"] < err["kmeans"] * 1.001
        assert err["fisher"] < err["fallback"]
        assert err["fisher"] < err["uniform"]


def test_qnorm_matches_mean_and_std():
    rng = np.random.default_rng(1)
    v = (rng.standard_normal(20000) * 40 + 5).clip(-127, 127).astype(np.float32)
    c = codebook.qnorm(codebook.uniform(8).astype(np.float64) * 0.6, v)
    deq = c[nuq.assign(v, codebook.to_int8(c))]
    assert deq.mean() == pytest.approx(v.mean(), abs=1.5)
    assert deq.std() == pytest.approx(v.std(), rel=0.03)


def test_layer_budget_upgrades_where_error_drops_most():
    errors = {("0", "k"): {"nuq2o": 100.0, "nuq3": 50.0, "nuq3o": 45.0, "nuq4": 20.0, "q8_0": 1.0},
              ("1", "k"): {"nuq2o": 2.0, "nuq3": 1.0, "nuq3o": 0.9, "nuq4": 0.5, "q8_0": 0.01}}
    lo = layer_types.assign(errors, 2.625)
    assert lo == {("0", "k"): "nuq2o", ("1", "k"): "nuq2o"}
    mid = layer_types.assign(errors, (2.625 + 8.5) / 2)
    assert mid == {("0", "k"): "q8_0", ("1", "k"): "nuq2o"}
    assert layer_types.mean_bits(mid) <= (2.625 + 8.5) / 2
    with pytest.raises(ValueError, match="below the cheapest"):
        layer_types.assign(errors, 2.0)


def test_layer_budget_takes_each_slots_own_candidates():
    """K and V with different ladders: each slot starts at its own cheapest type and upgrades within its own
    candidates (K's q42_64 at 3.5 bits next to V's nuq3 at 3.5 bits)."""
    errors = {(0, "k"): {"nuq2o": 10.0, "q42_64": 2.0, "q53_64": 1.0},
              (0, "v"): {"nuq2o": 3.0, "nuq3": 2.5, "nuq4": 1.0}}
    assert layer_types.assign(errors, 2.625) == {(0, "k"): "nuq2o", (0, "v"): "nuq2o"}
    # 0.875 more bits: K's upgrade buys 8 / 0.875, V's 0.5 / 0.875
    assert layer_types.assign(errors, (3.5 + 2.625) / 2) == {(0, "k"): "q42_64", (0, "v"): "nuq2o"}
    assert layer_types.assign(errors, 4.5) == {(0, "k"): "q53_64", (0, "v"): "nuq4"}


def test_prerope_key_ladder_takes_q32_below_three_bits():
    """q32_64 (3.0 bits) joins the default pre-RoPE K candidates, after nuq2o, where the cache's share of the budget
    is below 3 bits/value (--kv-bits 3.0 at 4096 cells with the default window: 3.0 - 16 x 69 / 4096 = 2.73)."""
    base = layer_types.PREROPE_K_LADDER
    assert "q32_64" not in base
    assert layer_types.prerope_k_ladder(3.0 - 16 * 69 / 4096) == ("nuq2o", "q32_64") + base[1:]
    assert layer_types.prerope_k_ladder(3.5 - 16 * 69 / 4096) == base
    assert layer_types.prerope_k_ladder(3.0) == base and layer_types.prerope_k_ladder(None) == base


def test_prerope_key_ladder_takes_nuq2_64_below_nuq2o():
    """nuq2_64 (2.25 bits) heads K's default candidates where the cache's share is below nuq2o's 2.625 bits/value
    (--kv-bits 2.5 at 4096 cells with the default window in q8_0 rows: 2.5 - 8.5 x 69 / 4096 = 2.357), not at 3.0
    (2.857 in q8_0 rows, 2.73 in f16)."""
    base = layer_types.PREROPE_K_LADDER
    assert layer_types.prerope_k_ladder(2.5 - 8.5 * 69 / 4096) == ("nuq2_64", "nuq2o", "q32_64") + base[1:]
    assert layer_types.prerope_k_ladder(3.0 - 8.5 * 69 / 4096)[0] == "nuq2o"
    assert layer_types.prerope_k_ladder(3.0 - 16 * 69 / 4096)[0] == "nuq2o"


def test_value_ladder_takes_nuq2_64_below_three_bits():
    """V's default candidates hold nuq3_64 (3.25 bits) always and nuq2_64 (2.25), first, where the cache's share of
    the budget is below 3 bits/value, as q32_64 joins K's."""
    base = layer_types.VALUE_LADDER
    assert "nuq3_64" in base and "nuq2_64" not in base
    assert layer_types.value_ladder(3.0 - 16 * 69 / 4096) == ("nuq2_64",) + base
    assert layer_types.value_ladder(3.5 - 16 * 69 / 4096) == base == layer_types.value_ladder(None)
    assert [layer_types.bits_per_value(t) for t in layer_types.value_ladder(2.9)[:3]] == [2.25, 2.625, 3.25]


@pytest.mark.parametrize("hd, want", [(64, (32, 0)), (128, (128, 32)), (96, (32, 0))])
def test_online_k_rotation_never_mixes_the_halves_of_a_halves_type(hd, want):
    """With a q53_64 / q42_64 K layer the runtime turns every layer's keys within each 32-value half
    (llama_kvq_new_k_rot_tensor): the converter's key samples the same way, so a key in one half stays there."""
    assert cache_domain.online_rot_k(hd, False) == (cache_domain.online_rot_k_size(hd), 0)
    assert cache_domain.online_rot_k(hd, True) == want
    from convert.calib import Calib
    T = 4
    k = np.zeros((T, 1, hd), np.float32)
    k[:, :, :32] = np.random.default_rng(0).standard_normal((T, 1, 32))
    c = Calib([None], [k], np.arange(T), "test", [k], [k], [k])
    mean, div = np.zeros((1, hd)), np.ones((1, hd))
    d = cache_domain.Domain(rot_k=True, rot_k_halves=True, k_prerope=True, k_mean=mean, k_div=div)
    x = cache_domain.keys(c, 0, _geom(hd=hd), d).x
    assert not x[:, :, 32:64].any() and np.abs(x[:, :, :32]).sum() > 0
    np.testing.assert_allclose(np.linalg.norm(x, axis=-1), np.linalg.norm(k, axis=-1), rtol=1e-5)
    plain = cache_domain.keys(c, 0, _geom(hd=hd), dataclasses.replace(d, rot_k_halves=False)).x
    assert hd % 64 or np.abs(plain[:, :, 32:64]).sum() > 0      # a 64-wide turn mixes them


def _geom(layout="norm", hd=64):
    return Geometry(arch="llama", n_layer=1, n_head=2, n_head_kv=1, head_dim=hd, n_rot=hd, freq_base=10000.0,
                    layout=layout, rope_freqs=None)


def test_cache_domain_keeps_the_first_order_loss_change():
    """Every map is orthogonal or diagonal, so g.x (the first-order loss change) is invariant,
    and the rotated/permuted/scaled values are the ones the cache would hold."""
    from convert.calib import Calib
    rng = np.random.default_rng(2)
    g = _geom("neox")
    T = 16
    k, gk = rng.standard_normal((T, 1, 64)).astype(np.float32), rng.standard_normal((T, 1, 64)).astype(np.float32)
    v, gv = rng.standard_normal((T, 1, 64)).astype(np.float32), rng.standard_normal((T, 1, 64)).astype(np.float32)
    c = Calib([None], [k], np.arange(T), "test", [v], [gk], [gv])
    s = np.exp2(rng.integers(-2, 3, (1, 32))).astype(np.float32)
    perm = np.stack([np.random.default_rng(3).permutation(64)])
    d = cache_domain.Domain(k_scale=s, k_perm=perm, layout="neox", rotate_v=True, rot_k=True, rot_v=True)
    ks, vs = cache_domain.keys(c, 0, g, d), cache_domain.values(c, 0, g, d)
    # K: the samples' norms are those of x/s (RoPE, permutation, relayout and Hadamard keep norms)
    from convert.smooth import rope_norm
    kr = rope_norm(k, c.pos, g) / np.repeat(s, 2, axis=1)[None]
    np.testing.assert_allclose(np.linalg.norm(ks.x, axis=-1), np.linalg.norm(kr, axis=-1), rtol=1e-5)
    # V: rotate_v then the online 64-block rotation; hadamard(64) twice is the identity
    np.testing.assert_allclose(vs.x, v @ hadamard(64).astype(np.float32) @ hadamard(64).astype(np.float32),
                               atol=1e-5)
    assert vs.fisher.shape == v.shape and np.all(vs.fisher >= 0)
