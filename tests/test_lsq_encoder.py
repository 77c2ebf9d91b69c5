"""Least-squares block scales (pykvq/ref/scale_search.py, native/ggml/lsq.c): the C encoders of stock q4_0 /
q5_0 against the numpy rule bit for bit, never worse than ggml's own encoder and better on Gaussian
blocks, and the CPU's SET_ROWS taking them only where the node is tagged (what a pykvq-converted file's
cache writes are; a stock file's stay upstream's byte for byte)."""
from __future__ import annotations

import numpy as np
import pytest

from pykvq import cache_types, log
from pykvq._lib import ffi, lib
from pykvq.ref import scale_search
from pykvq.ref.stock import pack_q4_0, pack_q5_0

from ggml_graph import Graph
from test_q53 import cache_like

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

HALF = {"q4_0": 8, "q5_0": 16}
PACK = {"q4_0": pack_q4_0, "q5_0": pack_q5_0}
LSQ = 1     # GGML_KVQ_ENCODER_LSQ


def edge_rows() -> np.ndarray:
    z = np.zeros((9, 32), np.float32)
    z[7, 4], z[7, 9] = 1e-39, -3e-40                    # subnormal: 1/d overflows to inf, 0 * inf is NaN
    z[8, 2], z[8, 3] = np.inf, -np.inf                  # both signs in one block: d saturates, -inf * id overflows
    z[1, 3], z[1, 20] = np.nan, 2.0
    z[2, 5], z[2, 30] = np.inf, -np.inf
    z[3, :] = 3e38
    z[4, 0], z[4, 17] = -1e-30, 1e-30                   # scales that round to f16 zero
    z[5, 10], z[5, 11] = 5.0, -5.0                      # equal magnitudes: the first one wins
    z[6, 0] = 65504.0 * 20                               # |d| saturates
    return z.reshape(-1)


def c_lsq(name: str, x: np.ndarray) -> bytes:
    L = lib()
    x = np.ascontiguousarray(x, np.float32)
    tr = L.ggml_get_type_traits(cache_types.resolve(name))
    out = ffi.new("uint8_t[]", x.size // 32 * tr.type_size)
    getattr(L, f"quantize_row_{name}_lsq")(ffi.cast("float *", ffi.from_buffer(x)), out, x.size)
    return bytes(ffi.buffer(out))


def c_stock(name: str, x: np.ndarray) -> bytes:
    L = lib()
    x = np.ascontiguousarray(x, np.float32)
    tr = L.ggml_get_type_traits(cache_types.resolve(name))
    out = ffi.new("uint8_t[]", x.size // 32 * tr.type_size)
    tr.from_float_ref(ffi.cast("float *", ffi.from_buffer(x)), out, x.size)
    return bytes(ffi.buffer(out))


def c_decode(name: str, buf: bytes, n: int) -> np.ndarray:
    L = lib()
    tr = L.ggml_get_type_traits(cache_types.resolve(name))
    back = np.empty(n, np.float32)
    tr.to_float(ffi.from_buffer(buf), ffi.cast("float *", ffi.from_buffer(back)), n)
    return back


def c_blocks(fn, x: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, q) of each block of 32 by a C block function (the reference's or the CPU's SIMD one)."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1, 32)
    d, q = np.zeros(len(x), np.float16), np.zeros(x.shape, np.uint8)
    db, qb = ffi.new("uint8_t[2]"), ffi.new("uint8_t[32]")
    for i, row in enumerate(x):
        fn(ffi.cast("float *", ffi.from_buffer(row)), half, db, qb)
        d[i] = np.frombuffer(bytes(db), np.float16)[0]
        q[i] = np.frombuffer(bytes(qb), np.uint8)
    return d, q


def np_lsq(name: str, x: np.ndarray) -> bytes:
    d, q = scale_search.quantize(np.asarray(x, np.float32).reshape(-1, 32), HALF[name])
    return PACK[name](d, q)


def test_rule_hand_checked():
    # levels -8..7 exactly (vmax -8 first of equals -> d = 1 at f = 1): no other scale is exact
    x = np.tile(np.arange(-8.0, 8.0), 2).astype(np.float32)
    d, q = scale_search.quantize(x[None], 8)
    assert float(d[0]) == 1.0
    np.testing.assert_array_equal(q[0], x + 8)
    # vmax -8 and 31 values of 3.5: q4_0's d = 1 reads 3.5 as 3 (error 31 * 0.25 = 7.75). f = 1.16 reads 3.5 as
    # 3 levels of 1.1602 = 3.4805 and -8 as -7 levels = -8.121 (error 0.027); f = 0.88 would read 3.5 as 3.52
    # but clip -8 to -7.04 (error 0.93)
    y = np.full(32, 3.5, np.float32)
    y[0] = -8.0
    d, q = scale_search.quantize(y[None], 8)
    assert float(d[0]) == float(np.float16(1.16))
    e = lambda d_: float((((np.clip(np.trunc(y / d_ + 8.5), 0, 15) - 8) * d_ - y) ** 2).sum())
    assert e(float(d[0])) < 0.1 * e(1.0)
    np.testing.assert_array_equal(scale_search.roundtrip(x, 8), x)


@pytest.mark.parametrize("name", ["q4_0", "q5_0"])
def test_c_encoder_matches_numpy_bit_for_bit(name):
    x = np.concatenate([cache_like(32 * 400, 3), edge_rows()])
    got = c_lsq(name, x)
    assert got == np_lsq(name, x)
    back = c_decode(name, got, x.size)                   # ggml's own decoder reads it
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back, scale_search.roundtrip(np.nan_to_num(x, nan=0.0, posinf=3.4028235e38,
                                                                            neginf=-3.4028235e38), HALF[name]))


@pytest.mark.parametrize("impl", ["ggml_kvq_lsq_block", "ggml_kvq_cpu_lsq_block"])
@pytest.mark.parametrize("half", [4, 8, 16])
def test_block_rule_matches_numpy_bit_for_bit(impl, half):
    """The reference block and the CPU's (AVX2: 26 candidates in lanes, sums kept in order per lane)."""
    x = np.concatenate([cache_like(32 * 300, 5), edge_rows()])
    d, q = c_blocks(getattr(lib(), impl), x, half)
    dn, qn = scale_search.quantize(x.reshape(-1, 32), half)
    np.testing.assert_array_equal(d.view(np.uint16), dn.view(np.uint16))
    np.testing.assert_array_equal(q, qn)


@pytest.mark.parametrize("name", ["q4_0", "q5_0"])
def test_never_worse_than_ggml_and_better_on_gaussian_blocks(name):
    x = np.random.default_rng(9).standard_normal(32 * 4000).astype(np.float32)
    e_lsq = ((c_decode(name, c_lsq(name, x), x.size) - x) ** 2).reshape(-1, 32).sum(axis=1, dtype=np.float64)
    e_std = ((c_decode(name, c_stock(name, x), x.size) - x) ** 2).reshape(-1, 32).sum(axis=1, dtype=np.float64)
    assert (e_lsq <= e_std * (1 + 1e-6)).all()          # q*_0's own scale (f = 1) is among those tried
    ratio = e_lsq.sum() / e_std.sum()
    assert ratio < 0.92, ratio                           # measured 0.890 (q4_0), 0.887 (q5_0)


@pytest.mark.parametrize("name", ["q4_0", "q5_0"])
def test_set_rows_uses_the_encoder_only_where_tagged(name):
    D, N = 128, 24
    src = cache_like(D * N, 17).reshape(N, D)
    perm = np.random.default_rng(2).permutation(N).astype(np.int64)
    g = Graph()
    L = g.L
    try:
        tagged, plain = g.tensor(name, D, N), g.tensor(name, D, N)
        a = L.ggml_set_rows(g.ctx, tagged, g.tensor("f32", D, N, data=src), g.tensor("i64", N, data=perm))
        b = L.ggml_set_rows(g.ctx, plain, g.tensor("f32", D, N, data=src), g.tensor("i64", N, data=perm))
        assert L.ggml_kvq_get_encoder(a) == 0
        L.ggml_kvq_set_encoder(a, LSQ)
        assert L.ggml_kvq_get_encoder(a) == LSQ and L.ggml_kvq_get_encoder(b) == 0
        g.compute(a, b)
        rows = np.empty_like(src)
        rows[perm] = src
        assert g.raw(tagged) == np_lsq(name, rows)
        assert g.raw(plain) == c_stock(name, rows)      # untagged: ggml's encoder, as upstream
        assert g.raw(tagged) != g.raw(plain)
    finally:
        g.close()


# --- the runtime: which files get it, and what it buys (SmolLM2-135M, real text) ---

def test_converted_file_gets_least_squares_scales(smollm2_prerope, smollm2, f16_model, wikitext):
    """A pykvq-converted file's q4_0 cache is written with least-squares scales (its default), a stock
    file's with ggml's encoder; on the pre-RoPE file the search lowers KLD vs an f16 cache. Measured
    (16 chunks, q4_0 K and V): 0.0247 stock encoder -> 0.0223 least squares."""
    from pykvq import Model
    kld = {}
    for enc in (None, "stock"):
        with Model(smollm2_prerope, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True,
                   encoder=enc) as m:
            assert m.encoder == ("stock" if enc else "least-squares")
            assert m.transforms().endswith(f"q4_0/q5_0 scales {m.encoder}")
            kld[m.encoder] = m.kl_divergence(wikitext, baseline=f16_model, n_chunks=4, progress=False).mean_kld
    assert kld["least-squares"] < kld["stock"], kld
    # what the runtime itself chose (its log line), for a stock file by default and when forced
    for enc, said in ((None, "stock encoder (not a pykvq-converted file)"),
                      ("lsq", "least-squares block scales (the encoder setting)")):
        with Model(smollm2, n_ctx=256, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, encoder=enc) as m:
            assert m.encoder == ("least-squares" if enc else "stock")
            assert f"q4_0 / q5_0 cache writes: {said}" in "".join(log.recent()), said


def test_bad_encoder_setting_is_refused(smollm2, monkeypatch):
    from pykvq import Model
    from pykvq.errors import PykvqError
    with pytest.raises(ValueError, match="encoder must be one of"):
        Model(smollm2, n_ctx=256, encoder="best")
    monkeypatch.setenv("PYKVQ_ENCODER", "best")
    with pytest.raises(PykvqError, match=r"PYKVQ_ENCODER = 'best': expected auto, stock or lsq"):
        Model(smollm2, n_ctx=256, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True)


def test_reference_roundtrip_names_the_encoder():
    """pykvq.ref.roundtrip(..., lsq=True) is what a converted file's q4_0 / q5_0 cache holds (the converter's
    error estimates use it); without it, ggml's encoder."""
    from pykvq.ref import roundtrip
    from pykvq.ref.stock import roundtrip_q4_0
    x = cache_like(32 * 64, 4)
    np.testing.assert_array_equal(roundtrip(x, "q4_0", lsq=True), scale_search.roundtrip(x, 8))
    np.testing.assert_array_equal(roundtrip(x, "q5_0", lsq=True), scale_search.roundtrip(x, 16))
    np.testing.assert_array_equal(roundtrip(x, "q4_0"), roundtrip_q4_0(x))
    np.testing.assert_array_equal(roundtrip(x, "q8_0", lsq=True), roundtrip(x, "q8_0"))
