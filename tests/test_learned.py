"""Learned invertible transforms (--rotate-v learned, --learn-k): the math against closed forms and the
numpy reference, invariance on the real model (f32 weights, f32 cache), guard rails and bad input."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from convert import invariant, learn_v, sherman_morrison as sm, ste
from convert.gguf_io import read_gguf
from convert.hadamard import hadamard
from convert.smooth import rope_norm
from pykvq import Model
from pykvq.keys import Keys
from pykvq.ref import roundtrip

from test_convert import (FAST_CALIB, assert_same_model, eval_tokens, f32_logits, geo, ref_logits,  # noqa: F401
                          run_convert)


# ---- the math ----------------------------------------------------------------------------------
def test_sherman_morrison_inverse_is_exact():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3, 16, 16, generator=g, dtype=torch.float64) * 0.3
    v = torch.randn(3, 16, 16, generator=g, dtype=torch.float64) * 0.3
    base = torch.from_numpy(hadamard(16))
    a, a_inv = sm.matrix(u, v, base), sm.inverse(u, v, base)
    # the closed forms against the products they stand for, one factor at a time
    un, vn = u.numpy(), v.numpy()
    for h in range(3):
        prod, inv = np.eye(16), np.eye(16)
        for k in range(16):
            prod = prod @ (np.eye(16) + np.outer(un[h, k], vn[h, k]))
            inv = (np.eye(16) - np.outer(un[h, k], vn[h, k]) / (1 + vn[h, k] @ un[h, k])) @ inv
        np.testing.assert_allclose(a[h].numpy(), prod @ hadamard(16), atol=1e-9)
        np.testing.assert_allclose(a_inv[h].numpy(), hadamard(16).T @ inv, atol=1e-9)
    np.testing.assert_allclose((a @ a_inv).numpy(), np.broadcast_to(np.eye(16), (3, 16, 16)), atol=1e-9)
    # det A = det B * prod(1 + v.u): invertible exactly when no denominator is zero
    want = np.linalg.det(hadamard(16)) * sm.denominators(u, v).prod(-1).numpy()
    np.testing.assert_allclose(np.linalg.det(a.numpy()), want, rtol=1e-8)


@pytest.mark.parametrize("t", ["q4_0", "bfp4_32", "nuq3", "nuq3o"])
def test_ste_forward_is_the_reference_and_gradient_follows_the_block_scale(t):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_(True)
    e = ste.error(xt, t)
    np.testing.assert_array_equal(e.detach().numpy(), roundtrip(x, t) - x)           # exact forward
    e.sum().backward()
    block, outliers = ste.block_of(t)
    xb, gb, eb = x.reshape(-1, block), xt.grad.numpy().reshape(-1, block), e.detach().numpy().reshape(-1, block)
    for xr, gr, er in zip(xb, gb, eb):
        order = np.argsort(-np.abs(xr))
        j = order[1] if outliers else order[0]                 # the value that sets the block scale
        want = np.zeros(block, np.float32)
        want[j] = np.sign(xr[j]) * er.sum() / np.abs(xr[j])   # d(s * r)/dx_j with r = e / s held constant
        np.testing.assert_allclose(gr, want, rtol=1e-5, atol=1e-6)


def test_pair_transform_commutes_with_rope():
    g = geo(head_dim=16, n_rot=16, n_head=4, n_head_kv=2)
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((40, 4, 16)), rng.standard_normal((40, 2, 16))
    pos = np.arange(40) * 37
    l, phi = rng.normal(0, 0.7, (2, 8)), rng.uniform(-np.pi, np.pi, (2, 8))
    q2 = invariant.pair_transform(q, np.repeat(l, 2, axis=0), np.repeat(phi, 2, axis=0), 1.0)
    k2 = invariant.pair_transform(k, l, phi, -1.0)
    kv = np.arange(4) // 2
    ref = np.einsum("qhd,khd->hqk", rope_norm(q, pos, g), rope_norm(k, pos, g)[:, kv])
    got = np.einsum("qhd,khd->hqk", rope_norm(q2, pos, g), rope_norm(k2, pos, g)[:, kv])
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert np.abs(k2 - k).max() > 0.5                           # and K itself did change


@pytest.mark.parametrize("layout", ["norm", "neox"])
def test_baked_pair_rows_act_like_the_activation_transform(layout):
    g = geo(head_dim=16, n_rot=16, n_head=4, n_head_kv=2, layout=layout)
    rng = np.random.default_rng(3)
    wk, x = rng.standard_normal((2 * 16, 10)), rng.standard_normal(10)
    l, phi = rng.normal(0, 0.5, (2, 8)), rng.uniform(-3, 3, (2, 8))
    from convert.cache_domain import norm_to_layout
    from convert.geometry import pair_channels
    k_file = (wk @ x).reshape(2, 16)
    src, dst = pair_channels(g, "norm"), pair_channels(g, layout)
    k_norm = np.empty_like(k_file)                                # file layout -> NORM
    k_norm[:, src[:, 0]], k_norm[:, src[:, 1]] = k_file[:, dst[:, 0]], k_file[:, dst[:, 1]]
    want = norm_to_layout(invariant.pair_transform(k_norm, l, phi, -1.0), g, layout)
    got = (invariant.bake_pairs(wk, l, phi, -1.0, g, 2) @ x).reshape(2, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_baked_v_transform_is_invisible_to_attention():
    rng = np.random.default_rng(4)
    n_head, n_kv, hd, n_embd = 6, 2, 8, 12
    wv, wo = rng.standard_normal((n_kv * hd, n_embd)), rng.standard_normal((n_embd, n_head * hd))
    bv = rng.standard_normal(n_kv * hd)
    a = np.eye(hd) + 0.4 * rng.standard_normal((n_kv, hd, hd))
    wv2, bv2, wo2 = invariant.bake_v(wv, bv, wo, a, np.linalg.inv(a), n_head, n_kv, hd)
    x, p = rng.standard_normal((7, n_embd)), rng.dirichlet(np.ones(7), size=(n_head,))   # [n_head, 7]
    kv = np.arange(n_head) // (n_head // n_kv)

    def out(wv_, bv_, wo_):
        v = (x @ wv_.T + bv_).reshape(7, n_kv, hd)[:, kv]                                # [7, n_head, hd]
        return np.einsum("ht,thd->hd", p, v).reshape(-1) @ wo_.T
    np.testing.assert_allclose(out(wv2, bv2, wo2), out(wv, bv, wo), rtol=1e-4, atol=1e-4)


# ---- guard rails (synthetic data: the bookkeeping, not a quality claim) --------------------------
def _synthetic(hd=32, n_kv=1, n_head=2, t=64, seqs=3, seed=5):
    rng = np.random.default_rng(seed)
    g = geo(head_dim=hd, n_rot=hd, n_head=n_head, n_head_kv=n_kv)
    scale = np.ones(hd)
    scale[3] = 20.0                                                 # one outlier channel, as V often has
    v = [(rng.standard_normal((t, n_kv, hd)) * scale).astype(np.float32) for _ in range(seqs)]
    p = [rng.dirichlet(np.ones(t), size=(n_head, 16)).astype(np.float32) for _ in range(seqs)]
    return learn_v.VData(v, p, np.broadcast_to(np.eye(hd, dtype=np.float32), (n_head, hd, hd)).copy()), g


def test_no_steps_falls_back_to_hadamard():
    d, g = _synthetic()
    r = learn_v.learn(d, g, "q4_0", steps=0)
    assert r.choice == "hadamard" and "does not beat" in r.reason
    np.testing.assert_allclose(r.a, np.broadcast_to(hadamard(32), r.a.shape))


def test_condition_number_stays_bounded():
    d, g = _synthetic()
    r = learn_v.learn(d, g, "q4_0", steps=60, max_cond=1.5, lr=5e-2)
    assert r.cond <= 1.5 * 1.05 or r.choice == "hadamard"
    np.testing.assert_allclose(np.einsum("nij,njk->nik", r.a, r.a_inv), np.broadcast_to(np.eye(32), r.a.shape),
                               atol=1e-4)


# ---- the real model ----------------------------------------------------------------------------
LEARNED = ["--rotate-v", "learned", "--learn-k", "--smooth-qk", "--cache-type-k", "q4_0", "--cache-type-v",
           "q4_0", "--learn-steps", "25", *FAST_CALIB]


@pytest.fixture(scope="module")
def learned_f32(smollm2_f32, smollm2_hf, module_tmp):
    out = module_tmp("learned") / "learned-f32.gguf"
    res = run_convert(smollm2_f32, "-o", out, "--outtype", "f32", "--hf-dir", smollm2_hf, *LEARNED)
    return out, res.stdout


def test_learned_transforms_leave_the_model_unchanged(learned_f32, ref_logits, eval_tokens):
    out, stdout = learned_f32
    m = re.search(r"learned V transform: kept in (\d+)/30 layers .* largest cond\(A\) ([\d.]+)", stdout)
    assert m, stdout
    assert int(m.group(1)) > 0                                 # learned matrices really are baked in
    assert float(m.group(2)) <= 100 * 1.05
    assert re.search(r"learned K pair transform: kept in [1-9]\d*/30", stdout), stdout
    assert_same_model(f32_logits(out, eval_tokens), ref_logits)


def test_learned_file_keys_and_runtime_log(learned_f32):
    out, _ = learned_f32
    r = read_gguf(out)
    layers = list(r.meta(Keys.Baked.ROTATE_V_LAYERS))
    assert len(layers) == 30 and set(layers) <= {"learned", "hadamard"}
    assert max(r.meta(Keys.Baked.ROTATE_V_COND)) <= 105
    with Model(out, n_ctx=256) as m:
        assert m.attn_rotation["V"] is False                   # the learned transform replaces the online one
        assert "V/O learned" in m.transforms() and "learned Q/K pair transform" in m.transforms()
        assert (m.cache_type_k, m.cache_type_v) == ("q4_0", "q4_0")


@pytest.mark.parametrize("flags, msg", [
    (["--rotate-v", "learned", "--cache-type-v", "f16"], "learned for a quantized V cache type"),
    (["--learn-k", "--ksort"], "--learn-k with --ksort is not supported"),
    (["--rotate-v", "learned", "--calib-seqs", "1", "--calib-len", "256"], "at least 2 calibration sequences"),
    (["--rotate-v", "learned", "--max-cond", "1"], "--max-cond"),
])
def test_bad_learning_options_are_refused(smollm2, smollm2_hf, tmp_path, flags, msg):
    out = tmp_path / "x.gguf"
    res = run_convert(smollm2, "-o", out, "--hf-dir", smollm2_hf, *flags, check=False)
    assert res.returncode == 2 and msg in res.stderr, res.stderr
    assert not out.exists()
