"""Pre-RoPE key cache: the FA read path (decode, restore mean/scale, RoPE at each cell's position)
against the numpy reference (pykvq/ref/prerope.py), and the rotary frequencies against ggml's rope."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_graph import Graph
from pykvq._lib import ffi
from pykvq.ref import prerope
from test_fattn import attention_ref, cache_like, fa_node, quantize, rel_err


def _freqs_c(g, n_dims, n_cols, ff=None, **kw):
    out = np.zeros((n_cols, n_dims // 2), np.float32)
    args = dict(n_ctx_orig=kw.get("n_ctx_orig", 0), freq_base=kw.get("freq_base", 10000.0),
                freq_scale=kw.get("freq_scale", 1.0), ext_factor=kw.get("ext_factor", 0.0),
                attn_factor=kw.get("attn_factor", 1.0), beta_fast=kw.get("beta_fast", 32.0),
                beta_slow=kw.get("beta_slow", 1.0))
    ffp = ffi.NULL if ff is None else ffi.cast("float *", ffi.from_buffer(np.ascontiguousarray(ff, np.float32)))
    ms = g.L.ggml_kvq_rope_freqs(n_dims, args["n_ctx_orig"], args["freq_base"], args["freq_scale"], args["ext_factor"],
                                 args["attn_factor"], args["beta_fast"], args["beta_slow"], ffp,
                                 1 if ff is None or np.ndim(ff) == 1 else n_cols, n_cols,
                                 ffi.cast("float *", ffi.from_buffer(out)))
    return out, ms


@pytest.mark.parametrize("kw", [dict(), dict(freq_base=1e6, freq_scale=0.25),
                                dict(freq_base=5e5, freq_scale=0.125, ext_factor=1.0, n_ctx_orig=4096, attn_factor=1.0)])
def test_rope_freqs_match_reference(kw):
    g = Graph(1 << 20)
    try:
        ff = np.linspace(1.0, 8.0, 32)
        for f in (None, ff):
            w, ms = _freqs_c(g, 64, 3, f, **kw)
            rw, rms = prerope.rope_freqs(64, kw.get("freq_base", 10000.0), kw.get("freq_scale", 1.0),
                                         kw.get("ext_factor", 0.0), kw.get("attn_factor", 1.0),
                                         kw.get("n_ctx_orig", 0), ff=f, n_cols=3)
            np.testing.assert_allclose(w, rw, rtol=2e-5)
            assert ms == pytest.approx(rms, rel=1e-6)
    finally:
        g.close()


def cell_positions(n_kv, S, start=None):
    """[S, n_kv] cell positions: consecutive runs, a gap (removed cells), a shifted block and one out of order;
    or (start given) one consecutive run from start."""
    pos = np.arange(n_kv, dtype=np.int32) + 7
    if start is None:
        pos[100:] += 50
        pos[200:230] -= 300
        pos[250] = 3
    else:
        pos += start - 7
    return np.stack([pos + 1000 * s for s in range(S)])


def rope_inputs(rng, n_kv, S, N, Hkv, n_dims, per_head, start):
    """Cell positions (cell_positions), each KV head's rotary frequencies (per-head factors, as K-sort's, when
    per_head) and a mask hiding cell 5."""
    pos = cell_positions(n_kv, S, start)
    ff = np.exp(rng.standard_normal((Hkv, n_dims // 2)) * 0.3) if per_head else None
    w, _ = prerope.rope_freqs(n_dims, 10000.0, ff=ff, n_cols=Hkv)
    mask = np.zeros((S, N, n_kv), np.float32)
    mask[:, :, 5] = -np.inf
    return pos, w.astype(np.float32), mask


def run_prerope_fa(kt, vt, *, mode, n_dims, D=64, N=1, n_kv=300, H=6, Hkv=2, S=1, mscale=1.0, per_head=False,
                   rot=0, skip=0, seed=0, n_threads=2, start=None, use_ref=None, k_decoded=False):
    """k_decoded: the cache holds K's decoded values as f32 (the rows kt's decoder gives) instead of kt's blocks."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((S, H, N, D)).astype(np.float32)
    # pre-RoPE keys with a large per-channel mean (a k_proj bias), centred and scaled by calibrated statistics
    mean = (rng.standard_normal((Hkv, D)) * 20).astype(np.float32)
    scale = np.exp(rng.standard_normal((Hkv, D)) * 0.5).astype(np.float32)
    C = cache_like(rng, S, Hkv, n_kv, D)                                 # what the cache quantizes
    kb, Cd = quantize(kt, C, None)
    if k_decoded:
        kt, kb = "f32", Cd.tobytes()
    Vx = cache_like(rng, S, Hkv, n_kv, D)
    vb, Vd = quantize(vt, Vx, None)
    pos, w, mask = rope_inputs(rng, n_kv, S, N, Hkv, n_dims, per_head, start)
    g = Graph(256 << 20)
    try:
        fa = fa_node(g, Q, kt, kb, vt, vb, Hkv, mask, 1.0 / np.sqrt(D))
        g.L.ggml_kvq_fa_set_prerope(fa, g.tensor("i32", n_kv, S, data=pos), g.tensor("f32", D, Hkv, data=mean),
                                    g.tensor("f32", D, Hkv, data=scale), g.tensor("f32", n_dims // 2, Hkv, data=w),
                                    n_dims, mode, mscale, rot)
        g.L.ggml_kvq_fa_set_hadamard_skip(fa, skip)
        if use_ref is None:
            g.compute(fa, n_threads=n_threads)
        else:
            g.compute_cpu_backend(fa, n_threads=n_threads, use_ref=use_ref)
        out = g.f32(fa).reshape(S, N, H, D)
    finally:
        g.close()
    Kpost = np.stack([prerope.decode(Cd[s].transpose(1, 0, 2), mean, scale, pos[s], w.astype(np.float64), mode,
                                     n_dims, mscale, rot, skip).transpose(1, 0, 2) for s in range(S)])
    ref = attention_ref(Q.transpose(0, 2, 1, 3), Kpost, Vd, mask, 1.0 / np.sqrt(D))
    return out, ref


@pytest.mark.parametrize("kt,vt", [("q4_0", "q4_0"), ("nuq4", "nuq4"), ("bfp4_32", "q8_0"), ("f16", "f16")])
@pytest.mark.parametrize("mode", [prerope.NORM, prerope.NEOX])
@pytest.mark.parametrize("rot", [0, 64])
def test_decode_matches_reference(kt, vt, mode, rot):
    """One query over 300 cells with gaps, a shifted block and an out-of-order cell (exact cos/sin
    after every jump, the one-step recurrence in between), with and without the Hadamard."""
    out, ref = run_prerope_fa(kt, vt, mode=mode, n_dims=64, rot=rot)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("kt,vt,D,rot,skip", [("nuq4", "nuq4", 64, 64, 0), ("f16", "f16", 64, 64, 0),
                                              ("q53_64", "q4_0", 128, 128, 32), ("q42_64", "nuq3", 64, 32, 0)])
@pytest.mark.parametrize("N", [1, 3])
def test_reference_mode_reads_prerope(kt, vt, D, rot, skip, N):
    """The CPU backend in reference mode (use_ref: what test-backend-ops holds every GPU kernel against) still
    reads a pre-RoPE cache with pykvq's kernel: upstream's per-row loop ignores src[5..8] and would attend to the
    raw cached values. That is what made every pre-RoPE CUDA case 'fail' on the H100 (2026-11-24). Keys in halves
    with the Hadamard that leaves out a stride: the reference test-backend-ops holds the CUDA kernels to."""
    for use_ref in (False, True):
        out, ref = run_prerope_fa(kt, vt, mode=prerope.NORM, n_dims=D, D=D, N=N, S=2, rot=rot, skip=skip, use_ref=use_ref)
        assert rel_err(out, ref) < 1e-4, use_ref


@pytest.mark.parametrize("N", [1, 3])
def test_reference_mode_reads_centred(N):
    """test-backend-ops' CPU reference (use_ref) reads a centred cache with pykvq's kernel too: what the CUDA centred
    cases are held against."""
    for use_ref in (False, True):
        out, ref = run_centred_fa("q4_0", "q4_0", mode=prerope.NEOX, n_dims=64, D=64, N=N, S=2, rot=64, use_ref=use_ref)
        assert rel_err(out, ref) < 1e-4, use_ref


@pytest.mark.parametrize("D,n_dims,rot", [(64, 64, 64), (128, 128, 128), (128, 128, 64), (128, 96, 32), (64, 64, 0),
                                          (64, 40, 0)])
@pytest.mark.parametrize("mode", [prerope.NORM, prerope.NEOX])
def test_decode_consecutive_tiles(D, n_dims, rot, mode):
    """Decode (3 tokens x G = 3 rows) over 1500 consecutive cells starting at position 20000: Q turned
    back by each tile's position (advanced tile to tile from an exact anchor), keys by their
    offset in the tile from a per-head table; the fused path (full rotary) and the table path
    (partial rotary), per-head frequencies and mscale."""
    out, ref = run_prerope_fa("q4_0", "q8_0", mode=mode, n_dims=n_dims, D=D, N=3, n_kv=1500, H=6, Hkv=2,
                              mscale=1.1, per_head=True, rot=rot, start=20000)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("D,rot", [(64, 64), (64, 16), (64, 8), (64, 0), (128, 128), (128, 32)])
@pytest.mark.parametrize("mode", [prerope.NORM, prerope.NEOX])
def test_q4_0_keys_turned_while_decoded(D, rot, mode):
    """q4_0 keys over consecutive cells take a path that decodes and turns each row in one pass (the Hadamard's
    first butterflies on the 4-bit integers, fa_prerope_tile_rel_q4_0 where the CPU has AVX2 or AVX-512): the same bits
    as the same keys decoded first, held as f32 (the decoder, then the transform)."""
    kw = dict(mode=mode, n_dims=D, D=D, N=3, n_kv=1500, H=6, Hkv=2, mscale=1.1, per_head=True, rot=rot, start=20000)
    out, ref = run_prerope_fa("q4_0", "q8_0", **kw)
    out_f32, _ = run_prerope_fa("q4_0", "q8_0", k_decoded=True, **kw)
    assert rel_err(out, ref) < 1e-4
    np.testing.assert_array_equal(out, out_f32)


@pytest.mark.parametrize("D,N,start", [(128, 3, 20000), (128, 1, None), (128, 40, None), (64, 3, 20000)])
def test_hadamard_without_stride_32(D, N, start):
    """q53_64 keys: the Hadamard over a whole head without its stride-32 butterfly (on a 128 head the two blocks'
    5-bit halves turn together, and their 3-bit halves), in the decode path held in registers (consecutive tiles),
    per key (cells with gaps), the prefill path (40 rows) and on a 64 head (= 32-wide blocks)."""
    out, ref = run_prerope_fa("q53_64", "q4_0", mode=prerope.NORM, n_dims=D, D=D, N=N, n_kv=700, H=6, Hkv=2,
                              per_head=True, rot=D, skip=32, start=start)
    assert rel_err(out, ref) < 1e-4
    # the centred domain turns Q by the same matrix
    out, ref = run_centred_fa("q53_64", "q4_0", mode=prerope.NORM, n_dims=D, D=D, N=N, rot=D, skip=32, start=start)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("mode", [prerope.NORM, prerope.NEOX])
def test_decode_scalar_rotation(mode):
    """40 of 64 channels rotary (not a multiple of 16: the scalar rotation), cells with gaps and out of order."""
    out, ref = run_prerope_fa("q4_0", "q4_0", mode=mode, n_dims=40, rot=0)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("mode", [prerope.NORM, prerope.NEOX])
def test_prefill_partial_rotary_per_head_freqs(mode):
    """40 query tokens (GEMM path), 2 streams, head size 128 with 96 rotary channels (partial
    rotary), per-KV-head frequencies (K-sort factors) and a YaRN-like mscale."""
    out, ref = run_prerope_fa("q8_0", "q4_0", mode=mode, n_dims=96, D=128, N=40, n_kv=260, H=8, Hkv=2, S=2,
                              mscale=1.2, per_head=True, rot=128 if mode == prerope.NORM else 32)
    # angles are p*w in float, as ggml's rope computes them: at p ~ 2300 that is ~1.4e-4 rad off the
    # float64 reference's angle, times keys of size ~|mean| = 20
    assert rel_err(out, ref) < 3e-4


def run_centred_fa(kt, vt, *, mode, n_dims, D=64, N=1, n_kv=300, H=6, Hkv=2, S=1, mscale=1.0, per_head=False,
                   rot=0, skip=0, seed=0, start=None, pairs=None, n_threads=2, use_ref=None):
    """FA over a centred post-RoPE cache (ggml_kvq_fa_set_centred) against attention over H R(p)k rebuilt in
    float64 (prerope.centred): the stored rows plus the mean's kept pairs rotated at each cell's position.
    pairs: the pairs with a mean (default: 40% of them at random)."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((S, H, N, D)).astype(np.float32)
    mean = (rng.standard_normal((Hkv, D)) * 20).astype(np.float32)
    a, b = prerope.pair_index(n_dims, mode)
    drop = rng.random((Hkv, n_dims // 2)) < 0.6          # the pairs the runtime would not keep
    if pairs is not None:
        drop[:] = True
        drop[:, pairs] = False
    for h in range(Hkv):
        mean[h, a[drop[h]]] = mean[h, b[drop[h]]] = 0.0
    mean[:, n_dims:] = 0.0
    C = cache_like(rng, S, Hkv, n_kv, D)
    kb, Cd = quantize(kt, C, None)
    vb, Vd = quantize(vt, cache_like(rng, S, Hkv, n_kv, D), None)
    pos, w, mask = rope_inputs(rng, n_kv, S, N, Hkv, n_dims, per_head, start)
    g = Graph(256 << 20)
    try:
        fa = fa_node(g, Q, kt, kb, vt, vb, Hkv, mask, 1.0 / np.sqrt(D))
        g.L.ggml_kvq_fa_set_centred(fa, g.tensor("i32", n_kv, S, data=pos), g.tensor("f32", D, Hkv, data=mean),
                                    g.tensor("f32", n_dims // 2, Hkv, data=w), n_dims, mode, mscale, rot)
        g.L.ggml_kvq_fa_set_hadamard_skip(fa, skip)
        assert g.L.ggml_kvq_fa_is_centred(fa) and g.L.ggml_kvq_fa_get_hadamard_skip(fa) == skip
        if use_ref is None:
            g.compute(fa, n_threads=n_threads)
        else:
            g.compute_cpu_backend(fa, n_threads=n_threads, use_ref=use_ref)
        out = g.f32(fa).reshape(S, N, H, D)
    finally:
        g.close()
    K = np.stack([prerope.centred(Cd[s].transpose(1, 0, 2), mean, pos[s], w.astype(np.float64), mode, n_dims,
                                  mscale, rot, skip).transpose(1, 0, 2) for s in range(S)])
    return out, attention_ref(Q.transpose(0, 2, 1, 3), K, Vd, mask, 1.0 / np.sqrt(D))


@pytest.mark.parametrize("kt,vt", [("q4_0", "q4_0"), ("nuq4", "q8_0"), ("f16", "f16")])
@pytest.mark.parametrize("mode", [prerope.NORM, prerope.NEOX])
@pytest.mark.parametrize("rot", [0, 64])
def test_centred_decode_matches_reference(kt, vt, mode, rot):
    """Centred post-RoPE K, one query over cells with gaps, a shifted block and an out-of-order cell
    (exact cos/sin per key in such tiles)."""
    out, ref = run_centred_fa(kt, vt, mode=mode, n_dims=64, rot=rot)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("D,n_dims,rot,mode", [(64, 64, 64, prerope.NORM), (128, 128, 128, prerope.NEOX),
                                               (128, 96, 32, prerope.NORM), (64, 40, 0, prerope.NEOX)])
def test_centred_consecutive_tiles(D, n_dims, rot, mode):
    """Decode over 1500 consecutive cells from position 20000: the coefficients turned by each tile's
    position (advanced tile to tile from an exact anchor), cos/sin of the offsets from a table (its low-rank form);
    per-head frequencies, mscale, partial rotary."""
    out, ref = run_centred_fa("q4_0", "q8_0", mode=mode, n_dims=n_dims, D=D, N=3, n_kv=1500, mscale=1.1,
                              per_head=True, rot=rot, start=20000)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("pairs", [[0, 1, 2], list(range(32))])
def test_centred_tile_forms(pairs):
    """A head's mean scores over a consecutive tile come from the table of cos/sin(t w) (a few fast pairs: the
    table is cheaper) or from its low-rank form (every pair: rank 21 of 64 rows); the default 40% of the pairs in
    the tests above take the low-rank form too."""
    out, ref = run_centred_fa("q4_0", "q8_0", mode=prerope.NORM, n_dims=64, D=64, N=3, n_kv=700, rot=64,
                              start=5000, pairs=pairs)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("centred", [False, True])
def test_long_run_is_re_anchored(centred):
    """18000 consecutive cells from position 100000 in one KV chunk (one thread): the tile-to-tile turn runs 256
    tiles, is re-anchored exactly (fa_tile_anchor, FA_ANCHOR_STEPS) and runs on; both key domains."""
    run = run_centred_fa if centred else run_prerope_fa
    out, ref = run("q4_0", "q8_0", mode=prerope.NEOX, n_dims=64, D=64, N=1, n_kv=18000, H=2, Hkv=1, rot=64,
                   start=100000, n_threads=1)
    assert rel_err(out, ref) < 1e-4


def test_centred_prefill():
    """40 query tokens (the GEMM path), 2 streams, head size 128, 96 rotary channels, per-head frequencies."""
    out, ref = run_centred_fa("q8_0", "q4_0", mode=prerope.NEOX, n_dims=96, D=128, N=40, n_kv=260, H=8, Hkv=2, S=2,
                              mscale=1.2, per_head=True, rot=32)
    assert rel_err(out, ref) < 3e-4


# ---- the runtime on the real model -------------------------------------------------------------
import os  # noqa: E402

from pykvq import Model, log  # noqa: E402
from pykvq.errors import DecodeError, PykvqError  # noqa: E402
from pykvq.metrics import log_softmax  # noqa: E402
from pykvq.keys import Keys, Tensors  # noqa: E402


@pytest.fixture(scope="module")
def smol_pre(smollm2_prerope):
    return smollm2_prerope


def _kld(a: np.ndarray, b: np.ndarray) -> float:
    pa, pb = log_softmax(a.astype(np.float64)), log_softmax(b.astype(np.float64))
    return float((np.exp(pa) * (pa - pb)).sum(axis=1).mean())


def test_runtime_quality_beats_post_rope(smol_pre, f16_model, wikitext):
    """4-bit keys (V f16) on WikiText-2: the converted file's pre-RoPE centred cache against the same
    type after RoPE with upstream's Hadamard, KLD vs an f16 cache. Measured 0.025 vs 0.040 (16 chunks)."""
    kld = {}
    for dom in ("post", "auto", "centred"):
        with Model(smol_pre, n_ctx=512, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, k_domain=dom) as m:
            kld[dom] = m.kl_divergence(wikitext, baseline=f16_model, n_chunks=4, progress=False).mean_kld
    assert kld["auto"] < 0.8 * kld["post"], kld
    # the same file's mean taken off post-RoPE keys (PYKVQ_K_DOMAIN=centred): measured 0.025 (16 chunks)
    assert kld["centred"] < 0.8 * kld["post"], kld


def test_f32_cache_equals_post_rope(smol_pre, passage):
    """An unquantized pre-RoPE cache (forced with PYKVQ_K_DOMAIN=pre, f32 K and V) computes the same
    attention as the post-RoPE one. This model's logits move by KLD ~0.002 under float reordering
    alone (n_batch 512 vs 64 gives 0.0014-0.002), so the bound is that noise, and far below what a
    wrong rotation does (KLD > 1)."""
    logits = {}
    for dom in ("post", "pre"):
        with Model(smol_pre, n_ctx=512, cache_type_k="f32", cache_type_v="f32", flash_attn=True, k_domain=dom) as m:
            toks = m.tokenize(passage)[:300]
            logits[dom] = m.eval_logits(toks)
    assert _kld(logits["post"], logits["pre"]) < 0.01
    assert (logits["post"].argmax(1) == logits["pre"].argmax(1)).mean() > 0.93


def _shift_moves(path, dom, kt, prompt, deltas=(1, 300), n_next=32):
    """KLD after moving every cell by each delta, against no move: the mean over the next n_next tokens (teacher
    forced), summed over the deltas. One token's distribution alone is too close to a tie on this model: float
    rounding moved it by 0.004-0.012 (f16 cache) depending on the machine's SIMD, so a bound on it was a coin toss."""
    with Model(path, n_ctx=1024, cache_type_k=kt, cache_type_v="f16", flash_attn=True, k_domain=dom) as m:
        toks = m.tokenize(prompt)[:200 + n_next]
        m.decode(toks[:200], 0)
        state = m.get_state()

        def cont(d):
            return np.stack([m.decode([toks[200 + i]], 200 + i + d) for i in range(n_next)])
        base = cont(0)
        out = []
        for d in deltas:
            m.set_state(state)
            m.seq_add(0, -1, d)
            out.append(_kld(base, cont(d)))
        return sum(out)


def test_k_shift_is_free(smol_pre, passage):
    """Moving every cell keeps all relative positions. With a pre-RoPE cache only the cells' positions
    change (no dequantize-rotate-requantize round trip), so the next token moves no more than an f16
    cache's does from float rounding alone (this model is that sensitive); a post-RoPE 4-bit cache
    requantizes every key and moves more. Measured (mean KLD of the next 32 tokens, summed over shifts of 1 and
    300; AVX2, 2026-12-02): f16 0.0057, pre-RoPE q4_0 0.0065, post-RoPE q4_0 0.051."""
    f16 = _shift_moves(smol_pre, "post", "f16", passage)
    pre = _shift_moves(smol_pre, "auto", "q4_0", passage)
    post = _shift_moves(smol_pre, "post", "q4_0", passage)
    assert pre < 0.6 * post and pre < 2.5 * f16, (f16, pre, post)


def test_centred_k_shift(smol_pre, passage):
    """A centred post-RoPE cache is shifted by upstream's K-shift (dequantize, rotate, requantize R(p)(k - mean)),
    the mean's scores then taken at the new positions. With q8_0 keys (requantization nearly exact) a shift moves
    the next tokens as little as an f16 cache's does: the rotation and the positions agree. Measured (_shift_moves,
    2026-12-02): f16 0.0057, centred q8_0 0.0070; at 4 bits the requantization shows, as in any post-RoPE cache:
    centred q4_0 0.038, post-RoPE q4_0 0.051 (pre-RoPE q4_0: 0.0065, no requantization). A wrong rotation or stale
    positions give KLD > 1."""
    f16 = _shift_moves(smol_pre, "post", "f16", passage)
    q8 = _shift_moves(smol_pre, "centred", "q8_0", passage)
    q4 = _shift_moves(smol_pre, "centred", "q4_0", passage)
    assert q8 < 2 * f16 + 0.005, (q8, f16)
    assert q4 < 0.2, q4


def test_centred_state_is_refused_by_other_domains(smol_pre, passage):
    """A state saved by a centred context (Model(k_domain="centred"): PYKVQ_K_DOMAIN for that context only) is
    refused by pre-RoPE and post-RoPE contexts, naming both domains."""
    with Model(smol_pre, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, k_domain="centred") as m:
        assert m.k_domain == "centred post-RoPE" and "PYKVQ_K_DOMAIN" not in os.environ
        m.decode(m.tokenize(passage)[:20], 0)
        state = m.get_state()
    with pytest.raises(ValueError, match="k_domain must be one of"):
        Model(smol_pre, k_domain="sideways")
    for dom, name in (("auto", "pre-RoPE"), ("post", "post-RoPE")):
        with Model(smol_pre, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, k_domain=dom) as m:
            with pytest.raises(DecodeError, match=f"the state holds a centred post-RoPE K cache, this context's is {name}"):
                m.set_state(state)


def test_flash_attention_off_is_refused(smol_pre):
    with pytest.raises(PykvqError, match="flash attention"):
        Model(smol_pre, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=False, k_domain="auto")


@pytest.mark.parametrize("tensor,value,msg", [(Tensors.K_SCALE, 0.0, "finite and > 0"),
                                               (Tensors.K_SCALE, -1.0, "finite and > 0"),
                                               (Tensors.K_MEAN, np.nan, "must be finite")])
def test_bad_statistics_are_refused(smol_pre, tmp_path, tensor, value, msg):
    """A file whose pre-RoPE statistics cannot be honoured is refused when the context is made, naming
    the tensor and element, before anything is computed."""
    from convert.gguf_io import Tensor, read_gguf, write_gguf
    m = read_gguf(smol_pre)
    name = tensor.format(bid=7)
    data = np.array(m.tensors[name].data, np.float32)
    data[1, 5] = value
    m.tensors[name] = Tensor(name, m.tensors[name].qtype, data)
    bad = tmp_path / "bad.gguf"
    write_gguf(m, bad)
    with pytest.raises(PykvqError, match=rf"{name}\[\d+\].*{msg}"):
        Model(bad, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, k_domain="auto")


def test_tools_run_a_prerope_file(smol_pre):
    """llama-completion with its defaults (the -fit memory probe loads the model without weights first)."""
    from conftest import run_tool
    res = run_tool("llama-completion", "-m", smol_pre, "-p", "The capital of France is", "-n", "8", "--temp", "0",
                   "-no-cnv", "-c", "256", "-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Paris" in res.stdout, res.stdout[-1000:]


def _kept_logged() -> tuple[int, int]:
    import re
    found = re.findall(r"(\d+) of (\d+) mean pairs kept", "".join(log.recent()))
    assert found, log.recent_text(40)
    return tuple(map(int, found[-1]))


@pytest.mark.parametrize("residual", [None, "0", "0.25", "1.5e0"])
def test_centre_pairs_match_reference(smol_pre, monkeypatch, residual):
    """The pairs of the mean a centred cache keeps (llama_kvq_centre_pairs, logged as "N of M mean pairs kept")
    are the numpy reference's (pykvq.ref.prerope.centre_pairs) on the file's kvq_k_mean and kvq_k_std, for the
    default residual (0.5x the head's variance) and PYKVQ_K_CENTRE_RESIDUAL. Measured: 813 of 2880 at 0.5."""
    from convert.gguf_io import read_gguf
    if residual is not None:
        monkeypatch.setenv("PYKVQ_K_CENTRE_RESIDUAL", residual)
    f = read_gguf(smol_pre)
    assert f.meta(Keys.Cache.K_SCALE_METHOD) == "fisher"                # so the std is a tensor of its own
    n_layer = sum(1 for name in f.tensors if name.endswith(".kvq_k_mean"))
    want = 0
    for il in range(n_layer):
        mean = np.asarray(f.tensors[Tensors.K_MEAN.format(bid=il)].data, np.float32)
        std = np.asarray(f.tensors[Tensors.K_STD.format(bid=il)].data, np.float32)
        kept = prerope.centre_pairs(mean, std.astype(np.float64) ** 2, mean.shape[1], prerope.NORM,
                                    0.5 if residual is None else float(residual))
        want += int(kept.sum())
    log.clear()
    with Model(smol_pre, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, k_domain="centred"):
        got, total = _kept_logged()
    assert total == n_layer * mean.shape[0] * mean.shape[1] // 2
    assert got == want, (got, want, total)
    if residual == "0":
        assert got == total


@pytest.mark.parametrize("env,value,msg", [("PYKVQ_K_DOMAIN", "sideways", "expected auto, post, pre or centred"),
                                           ("PYKVQ_K_CENTRE_RESIDUAL", "half", "expected a number >= 0"),
                                           ("PYKVQ_K_CENTRE_RESIDUAL", "0.5x", "expected a number >= 0"),
                                           ("PYKVQ_K_CENTRE_RESIDUAL", "-1", "expected a number >= 0")])
def test_bad_domain_settings_are_refused(smol_pre, monkeypatch, env, value, msg):
    """A misspelt key-domain setting is an error naming the variable and what it takes, not a silent default."""
    monkeypatch.setenv(env, value)
    dom = "centred" if env == "PYKVQ_K_CENTRE_RESIDUAL" else None
    with pytest.raises(PykvqError, match=rf"{env} = '{value}': {msg}"):
        Model(smol_pre, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, k_domain=dom)


def as_mrope(src, out):
    """The file relabelled as qwen2vl (the same tensors, M-RoPE with sections 8/12/12/0): what a multimodal model's
    keys look like to the runtime. No quality claim: only which RoPE mode each side is told."""
    from gguf import GGUFValueType as VT

    from convert.gguf_io import read_gguf, write_gguf
    m = read_gguf(src)
    for k in [k for k in m.fields if k.startswith("llama.")]:
        f = m.fields.pop(k)
        m.set("qwen2vl." + k[len("llama."):], f.value, f.vtype, f.sub_type)
    m.set("general.architecture", "qwen2vl", VT.STRING)
    m.set("qwen2vl.rope.dimension_sections", [8, 12, 12, 0], VT.ARRAY, VT.INT32)
    write_gguf(m, out)
    return out


def test_mrope_is_refused_by_the_converter_and_kept_post_rope_at_run_time(smollm2, smol_pre, tmp_path):
    """M-RoPE keys cannot be cached pre-RoPE: the converter refuses by name, and a pre-RoPE file whose model turns
    out to be M-RoPE keeps post-RoPE keys, warning for each layer, with the logits of an explicit post-RoPE run."""
    from test_convert import run_convert
    res = run_convert(as_mrope(smollm2, tmp_path / "in.gguf"), "-o", tmp_path / "out.gguf", "--prerope-k", check=False)
    assert res.returncode != 0 and not (tmp_path / "out.gguf").exists()
    assert "RoPE mode 8 (multimodal M-RoPE)" in res.stderr, res.stderr[-2000:]
    path = as_mrope(smol_pre, tmp_path / "pre.gguf")
    kw = dict(n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True)
    toks = list(range(1000, 1040))
    log.clear()
    with Model(path, **kw) as m:
        got = m.eval_logits(toks, output_from=0)
    text = log.recent_text(200000)
    for il in (0, 29):
        assert f"layer {il} keeps a post-RoPE K cache: only NORM and NEOX RoPE are supported (not M-RoPE" in text
    assert "pre-RoPE key cache in 0 of 30 layers" in text
    with Model(path, k_domain="post", **kw) as m:
        assert np.array_equal(got, m.eval_logits(toks, output_from=0))


def test_settings_are_per_context_and_reported_as_run(smol_pre, monkeypatch):
    """Key domain and encoder are parameters of each context (llama_kvq_params): three contexts of one process
    run three settings side by side, the environment untouched; each reports what it runs (llama_kvq_get), and
    gives the logits it gives alone. The environment is the fallback, below an explicit setting."""
    kw = dict(n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True)
    toks = list(range(1000, 1040))
    env = dict(os.environ)
    with Model(smol_pre, k_domain="post", **kw) as a, Model(smol_pre, **kw) as b, \
            Model(smol_pre, k_domain="centred", encoder="stock", **kw) as c:
        assert dict(os.environ) == env
        assert (a.k_domain, b.k_domain, c.k_domain) == ("post-RoPE", "pre-RoPE", "centred post-RoPE")
        assert (a.encoder, b.encoder, c.encoder) == ("least-squares", "least-squares", "stock")
        assert a.setting("attn_rot_k") == "on" and a.setting("no_such_setting") is None
        got = {m: m.eval_logits(toks, output_from=0) for m in (a, b, c)}
    assert not np.array_equal(got[a], got[b]) and not np.array_equal(got[b], got[c])
    with Model(smol_pre, k_domain="post", **kw) as alone:
        assert np.array_equal(alone.eval_logits(toks, output_from=0), got[a])
    monkeypatch.setenv("PYKVQ_K_DOMAIN", "post")
    with Model(smol_pre, **kw) as m:
        assert m.k_domain == "post-RoPE"
    with Model(smol_pre, k_domain="auto", **kw) as m:
        assert m.k_domain == "pre-RoPE"
    with pytest.raises(ValueError, match=r"k_centre_residual = 'half': expected a number >= 0"):
        Model(smol_pre, k_centre_residual="half", **kw)


def test_tools_take_the_settings_as_flags(smol_pre, tmp_path):
    """llama tools: --kv-domain / --kv-encoder (PYKVQ_K_DOMAIN / PYKVQ_ENCODER as their environment fallback);
    a bad value is refused by the argument parser, naming the setting."""
    from conftest import run_tool
    base = ["-m", smol_pre, "-p", "The capital of France is", "-n", "2", "--temp", "0", "-no-cnv", "-fa", "on",
            "-c", "256", "-t", "2", "-ctk", "q4_0", "-ctv", "q4_0", "-lv", "4"]
    res = run_tool("llama-completion", *base, "--kv-domain", "post", "--kv-encoder", "stock", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "pre-RoPE key cache off (k_domain = post)" in res.stderr
    assert "q4_0 / q5_0 cache writes: stock encoder (the encoder setting)" in res.stderr
    res = run_tool("llama-completion", *base, timeout=300, env={"PYKVQ_K_DOMAIN": "centred"})
    assert res.returncode == 0 and "centred post-RoPE key cache in 30 of 30 layers" in res.stderr, res.stderr[-2000:]
    res = run_tool("llama-completion", *base, "--kv-domain", "sideways", timeout=300)
    assert res.returncode != 0 and "k_domain = 'sideways': expected auto, post, pre or centred" in res.stderr, \
        res.stderr[-2000:]
    # llama-bench has no --kv-* flags: it takes the same environment (what gpu_check's pre/post rows rely on)
    bench = ["-m", smol_pre, "-p", "0", "-n", "1", "-r", "1", "-fa", "1", "-t", "2", "-ctk", "q4_0", "-ctv", "q4_0"]
    res = run_tool("llama-bench", *bench, "-v", timeout=300, env={"PYKVQ_K_DOMAIN": "post"})
    assert res.returncode == 0 and "pre-RoPE key cache off (k_domain = post)" in res.stderr, res.stderr[-2000:]
    res = run_tool("llama-bench", *bench, timeout=300, env={"PYKVQ_K_DOMAIN": "sideways"})
    assert res.returncode != 0 and "PYKVQ_K_DOMAIN: k_domain = 'sideways': expected auto" in res.stderr, res.stderr[-2000:]
    # every setting with a variable in the library's table, PYKVQ_K_CENTRE_RESIDUAL included (once missed)
    from pykvq._lib import setting_envs
    assert setting_envs() == {"k_domain": "PYKVQ_K_DOMAIN", "encoder": "PYKVQ_ENCODER",
                              "k_centre_residual": "PYKVQ_K_CENTRE_RESIDUAL", "kv_window": "PYKVQ_KV_WINDOW",
                              "kv_sinks": "PYKVQ_KV_SINKS", "kv_window_type": "PYKVQ_KV_WINDOW_TYPE",
                              "kv_heavy": "PYKVQ_KV_HEAVY"}
    for name, env in setting_envs().items():
        res = run_tool("llama-bench", *bench, timeout=300, env={env: "-1"})
        assert res.returncode != 0 and f"{env}: {name} = '-1'" in res.stderr, (env, res.stderr[-2000:])
