"""The converter's candidate pricing (convert/candidate_prices.py): a cache error mapped back to the unconverted
model's K / V nodes must be exactly the change those nodes need for the cache to hold the rounded values."""
from __future__ import annotations

import numpy as np
import pytest

from convert import cache_domain
from convert.calib import Calib, hf_to_norm
from convert.geometry import Geometry


def _geom(layout):
    return Geometry(arch="llama", n_layer=1, n_head=4, n_head_kv=2, head_dim=64, n_rot=64, freq_base=10000.0,
                    layout=layout, rope_freqs=None)


@pytest.mark.parametrize("layout", ["norm", "neox"])
@pytest.mark.parametrize("prerope", [False, True])
def test_errors_map_back_to_the_model(layout, prerope):
    rng = np.random.default_rng(1)
    g = _geom(layout)
    T = 12
    k = rng.standard_normal((T, 2, 64)).astype(np.float32)
    dk = 1e-2 * rng.standard_normal((T, 2, 64)).astype(np.float32)
    v = rng.standard_normal((T, 2, 64)).astype(np.float32)
    dv = 1e-2 * rng.standard_normal((T, 2, 64)).astype(np.float32)
    pos = np.arange(T) + 3
    ones = np.ones_like(k)
    s = np.exp2(rng.integers(-2, 3, (2, 32))).astype(np.float32)
    perm = np.stack([rng.permutation(64) for _ in range(2)])
    d = cache_domain.Domain(k_scale=s, k_perm=perm, layout=layout, rotate_v=True, rot_k=True, rot_v=True,
                            rot_k_halves=prerope, k_prerope=prerope,
                            k_mean=rng.standard_normal((2, 64)) if prerope else None,
                            k_div=np.exp(rng.standard_normal((2, 64))) if prerope else None)
    before = Calib([None], [k], pos, "t", [v], [ones], [ones])
    after = Calib([None], [k + dk], pos, "t", [v + dv], [ones], [ones])
    ek = cache_domain.keys(after, 0, g, d).x - cache_domain.keys(before, 0, g, d).x
    ev = cache_domain.values(after, 0, g, d).x - cache_domain.values(before, 0, g, d).x
    to_file = hf_to_norm(g) if layout == "neox" else np.arange(64)
    from convert.smooth import rope_norm
    want_k = np.empty_like(dk)
    want_k[..., to_file] = rope_norm(dk, pos, g)          # the model's post-RoPE K, in the file's channel order
    np.testing.assert_allclose(cache_domain.key_error_to_model(ek, pos, g, d, to_file), want_k, atol=2e-5)
    np.testing.assert_allclose(cache_domain.value_error_to_model(ev, g, d), dv, atol=2e-5)


def test_costs_by_hand():
    """KL divergence less the layer's floor; a candidate at or below it costs a twentieth of the cheapest one above."""
    from convert.candidate_prices import CandidateProbe
    kld = {(0, "k", "nuq2o"): 0.010, (0, "k", "q8_0"): 0.0039, (1, "v", "nuq3"): 0.005}
    cp = CandidateProbe(np.arange(4), 1, 4, np.arange(64), 0, lambda d: kld, np.array([0.004, 0.002]))
    cp.deltas = dict.fromkeys(kld)
    got = cp.costs()
    assert got[(0, "k", "nuq2o")] == pytest.approx(0.006)
    assert got[(1, "v", "nuq3")] == pytest.approx(0.003)
    assert got[(0, "k", "q8_0")] == pytest.approx(0.003 / 20)


def test_rows_of_takes_each_sequence_from_its_start():
    from convert.candidate_prices import CandidateProbe
    pos = np.concatenate([np.arange(8)] * 3)
    np.testing.assert_array_equal(CandidateProbe.rows_of(pos, 2, 3), [0, 1, 2, 8, 9, 10])


def test_probe_deltas_exact_quadratic_and_checked(smollm2_f32):
    """On exact (f32) weights: a zero change leaves the numbers alone (KLD exactly 0), twice a change costs four
    times the KL divergence within 10% for K and V (second order), and a change of the wrong size is refused."""
    from convert.calib import calibration_text
    from pykvq import calibrate, sensitivity
    text = calibration_text("canterbury")[0]
    st = calibrate.collect(smollm2_f32, text, n_seq=2, seq_len=128, samples=True, n_threads=2)
    rng = np.random.default_rng(0)
    d = {}
    for i, w in ((4, "k"), (20, "v")):
        x = st.layers[i].samples[w]                       # [2 x 96, 3, 64]
        noise = (0.05 * x.std() * rng.standard_normal((2, 96) + x.shape[1:])).astype(np.float32)
        d[(i, w, "zero")] = list(np.zeros_like(noise))
        d[(i, w, "lo")] = list(noise)
        d[(i, w, "hi")] = list(2 * noise)
    got = sensitivity.probe_deltas(smollm2_f32, text, d, n_seq=2, seq_len=128, use=2, length=96, n_threads=2)
    for i, w in ((4, "k"), (20, "v")):
        assert got[(i, w, "zero")] == 0.0
        assert got[(i, w, "lo")] > 1e-6
        assert got[(i, w, "hi")] / got[(i, w, "lo")] == pytest.approx(4.0, rel=0.10), (i, w)
    with pytest.raises(sensitivity.ProbeError, match="values, the delta"):
        sensitivity.probe_deltas(smollm2_f32, text, {(4, "k", "bad"): [np.zeros((95, 3, 64), np.float32)] * 2},
                                 n_seq=2, seq_len=128, use=2, length=96, n_threads=2)
