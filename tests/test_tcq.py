"""tcq3_64 / tcq2_64 and tcq3_128 / tcq2_128 (trellis-coded values): the numpy reference rule against hand-checked properties, the C
reference and the CPU traits bit for bit against numpy, K·Q against q8_0, row validation, and the squared error the
format exists for (against nuq3_64 / nuq2_64 at the same bits, on Gaussian values as the head's Hadamard leaves them)."""
from __future__ import annotations

import numpy as np
import pytest

from pykvq import cache_types
from pykvq._lib import ffi, lib
from pykvq.ref import nuq, roundtrip, tcq
from test_q53 import c_quantize as c_codec   # ggml's reference codec of a type, through its traits
from test_q53 import cpu_traits_match, exact_dot

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TYPES = ["tcq3_64", "tcq2_64", "tcq3_128", "tcq2_128", "tcq25_64", "tcq35_64"]


def blocks_of(name: str) -> dict:
    """quantize_blocks' block arguments for a type: values under one scale, its runs of 64, its scale's bytes."""
    return {"n": tcq.BLOCK[name], "run": tcq.N, "scale_bytes": tcq.SCALE_BYTES[name]}


def gaussian(n: int, seed: int) -> np.ndarray:
    """Values like a Hadamard-turned cache row: Gaussian, block scales over a wide (f16) range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    return (x * np.exp2(rng.integers(-10, 6, n // 64).repeat(64))).astype(np.float32)


def edge_rows() -> np.ndarray:
    z = np.zeros((8, 64), np.float32)                 # (a last row of zeros: whole blocks of 128)
    z[1, 3], z[1, 40] = np.nan, 2.0
    z[2, 5], z[2, 50] = np.inf, -np.inf
    z[3, :] = 3e38
    z[4, 0], z[4, 33] = -1e-30, 1e-30
    z[5, 7] = 1e-42                                   # a subnormal alone: the unit-RMS factor saturates
    z[6, :] = 65504.0 * 20                            # |d| saturates
    return z.reshape(-1)


@pytest.mark.parametrize("name", TYPES)
def test_states_are_the_streams_windows_around_the_block(name):
    """Every state of an encoded path is the 8-bit window of the stored stream that ends with its value's bits
    (tail-biting included), so the decoder reads the levels the encoder chose."""
    k, nb = tcq.bits_of(name), blocks_of(name)
    d, st = tcq.quantize_blocks(gaussian(64 * 40, 1), k, **nb)
    d2, st2 = tcq.unpack(tcq.pack(d, st, k), k, **nb)
    np.testing.assert_array_equal(st2, st)
    assert d2.dtype == d.dtype and d2.tobytes() == d.tobytes()
    st = st.reshape(-1, tcq.N)                                              # each run of 64
    ks = tcq.steps(k)[0]
    for j in range(tcq.N):                                                  # each state shifts the last one's bits
        ml = (1 << (8 - ks[j])) - 1                                         # by its own, around the run
        assert (st[:, j] & ml).tolist() == (st[:, j - 1] >> ks[j]).tolist()


def test_hand_checked_block():
    """A block of zeros but value 0 = 1: r2 = 1, unit RMS scales by 8, and the path's least-squares scale reads back
    the levels' fit, stored as the nearest scale code; a block of zeros is all zero bits and code 0."""
    x = np.zeros(64, np.float32)
    d, st = tcq.quantize_blocks(x, 2)
    assert d[0] == 0 and not st.any()
    assert tcq.pack(d, st, 2) == bytes(17)
    x[0] = 1.0
    d, st = tcq.quantize_blocks(x, 2)
    lut = tcq.levels(2).astype(np.float64)
    y = lut[st[0]]
    ls = y[0] / (y @ y)
    c = int(np.floor(8 * np.log2(ls))) + tcq.SCALE_BIAS                 # the codes either side of the scale
    assert d[0] == min((c, c + 1), key=lambda i: abs(float(tcq.scales()[i]) - ls))
    assert tcq.levels(2)[0] == np.float32((2008 + 933) / 4096)


def test_scale_codes():
    """The one-byte scale: 2^((c - 159)/8), hand-checked at whole octaves and the ends; every step 1/8 octave; a scale
    goes to its nearest code (ties to the lower), nothing positive to 0 unless it is nearer 0 than 2^-19.75, anything
    from 4096 up to 255; 0, negatives and NaN to 0."""
    t = tcq.scales()
    assert t[0] == 0 and t[159] == 1 and t[167] == 2 and t[151] == 0.5 and t[255] == 4096
    assert t[1] == np.float32(2 ** -19.75)
    np.testing.assert_allclose(t[2:] / t[1:-1], 2 ** (1 / 8), rtol=1e-6)
    mid = (t[159].astype(np.float64) + t[160]) / 2
    assert tcq.scale_codes(np.array([mid, mid * (1 + 1e-12), t[1] * 0.49, t[1] * 0.51, 1e9, 0.0, -1.0, np.nan])
                           ).tolist() == [159, 160, 0, 1, 255, 0, 0, 0]
    d = np.exp2(np.random.default_rng(0).uniform(-19, 11, 5000))
    e = np.abs(t[tcq.scale_codes(d)] / d - 1)
    assert e.max() < 2 ** (1 / 16) - 1 + 1e-6                            # within half a step


@pytest.mark.parametrize("k, most", [(2, 1.01), (3, 1.03)])
def test_the_scale_code_costs_little(k, most):
    """What the scale code costs against an f16 scale on unit Gaussian blocks. Measured 2026-12-07: tcq2 0.0823 against
    0.0817 (+0.7%), tcq3 0.0227 against 0.0221 (+2.5%), for 0.125 bits/value less."""
    x = np.random.default_rng(3).standard_normal(64 * 400).astype(np.float32)
    e = {}
    for sb in (1, 2):
        d, st = tcq.quantize_blocks(x, k, scale_bytes=sb)
        e[sb] = float(((tcq.dequantize_blocks(d, st, k) - x) ** 2).mean())
    assert e[2] < e[1] < most * e[2], e


@pytest.mark.parametrize("name", TYPES)
def test_c_reference_and_cpu_traits_match_numpy_bit_for_bit(name):
    L = lib()
    k = tcq.bits_of(name)
    t = cache_types.resolve(name)
    for j in (0, 1):                                  # the even values' tables and bits, then the odd ones'
        tab = L.ggml_kvq_tcq_tables(t, j)
        assert [tab[i] for i in range(32)] == list(tcq.TABLES[k])[32 * j % len(tcq.TABLES[k]):][:32]
        assert L.ggml_kvq_tcq_bits(t, j) == tcq.steps(k)[0][j]
    x = np.concatenate([gaussian(64 * 48, 2), edge_rows()])
    raw, back = c_codec(name, x)
    d, st = tcq.quantize_blocks(x, k, **blocks_of(name))
    assert raw == tcq.pack(d, st, k)
    want = tcq.dequantize_blocks(d, st, k)
    np.testing.assert_array_equal(back.view(np.uint32), want.view(np.uint32))
    read_back_dot_matches(name, cpu_traits_match(name, x, raw, want))


def read_back_dot_matches(name: str, cpu) -> None:
    """K·Q against q8_0 (the CPU traits' vec_dot) is the read-back values times Q's levels, to float accumulation
    order, for a head of 64 and of 128 (128 and 256 for a block of 128)."""
    s = ffi.new("float *")
    for head in (128, 256) if tcq.BLOCK.get(name) == 128 else (64, 128):
        kx, qx = gaussian(head, 10 + head), gaussian(head, 20 + head)
        kb, kv = c_codec(name, kx)
        qb = ffi.new("uint8_t[]", head // 32 * 34)
        lib().quantize_row_q8_0_ref(ffi.cast("float *", ffi.from_buffer(qx)), qb, head)
        want_dot, mag = exact_dot(kv.astype(np.float64).reshape(-1, 32), np.ones(head // 32), qb)
        cpu.vec_dot(head, s, 0, kb, 0, qb, 0, 1)
        assert abs(s[0] - want_dot) <= 1e-5 * mag


@pytest.mark.parametrize("name, scalar, most", [("tcq3_64", "nuq3_64", 0.75), ("tcq2_64", "nuq2_64", 0.8)])
def test_less_squared_error_than_the_scalar_code_of_the_same_bits(name, scalar, most):
    """The reason for the format: on unit Gaussian blocks (what the head's Hadamard makes of a cache row) the trellis
    path's squared error is at most `most` of nuq's with its fallback codebook at the same bits per value. Measured
    2026-12-01: tcq3_64 0.0221 against nuq3_64 0.0318 (0.70x), tcq2_64 0.0817 against 0.120 (0.68x)."""
    x = np.random.default_rng(3).standard_normal(64 * 400).astype(np.float32)
    assert cache_types.bits_per_value(name) == cache_types.bits_per_value(scalar) - 0.125     # the scale code
    e_t = float(((roundtrip(x, name) - x) ** 2).mean())
    e_n = float(((nuq.roundtrip(x, scalar) - x) ** 2).mean())
    assert e_t < most * e_n, (e_t, e_n)


def test_the_alternating_trellis_beats_its_two_widths_mixed():
    """tcq25_64 (3 and 2 bits by turns, one path) against tcq3_64 and tcq2_64 in equal parts, at the same bits per
    value (2.625), on unit Gaussian blocks. Measured 2026-12-08: 0.0433 against (0.0823 + 0.0227)/2 = 0.0525 (0.82x):
    one trellis shares its bits across both parities, a mix of widths cannot."""
    x = np.random.default_rng(3).standard_normal(64 * 400).astype(np.float32)
    e = {n: float(((roundtrip(x, n) - x) ** 2).mean()) for n in ("tcq25_64", "tcq3_64", "tcq2_64")}
    assert cache_types.bits_per_value("tcq25_64") == (cache_types.bits_per_value("tcq3_64")
                                                      + cache_types.bits_per_value("tcq2_64")) / 2
    assert e["tcq25_64"] < 0.9 * (e["tcq3_64"] + e["tcq2_64"]) / 2, e


def test_tcq35_beats_the_types_either_side_mixed():
    """tcq35_64 (4 and 3 bits by turns, 3.625 bits/value) against tcq3_64 (3.125) and nuq4 (4.5) mixed to the same
    bits (0.636 / 0.364), on unit Gaussian blocks. Measured 2026-12-08: 0.0133 against 0.636 x 0.0227 + 0.364 x 0.0065
    = 0.0168 (0.79x)."""
    x = np.random.default_rng(3).standard_normal(64 * 400).astype(np.float32)
    e = {n: float(((roundtrip(x, n) - x) ** 2).mean()) for n in ("tcq35_64", "tcq3_64", "nuq4")}
    bits = {n: cache_types.bits_per_value(n) for n in e}
    a = (bits["nuq4"] - bits["tcq35_64"]) / (bits["nuq4"] - bits["tcq3_64"])
    assert e["tcq35_64"] < 0.85 * (a * e["tcq3_64"] + (1 - a) * e["nuq4"]), e


@pytest.mark.parametrize("name, same_bits_of", [("tcq3_128", "tcq3_64"), ("tcq2_128", "tcq2_64")])
def test_a_scale_code_per_64_beats_an_f16_scale_per_128(name, same_bits_of):
    """tcq*_128 (one f16 scale per 128 values) and tcq*_64 (a scale code per 64) cost the same bits and, on Gaussian
    rows of 128, the same squared error within 1% (2026-12-07: tcq2 0.0823 / 0.0836, tcq3 0.02281 / 0.02279); on real
    value rows the 128-wide scale lost ~9% (Qwen2.5-Coder-1.5B, docs/RESULTS-BY-DATE.md 2026-12-07), so the ladders
    keep tcq*_64."""
    x = np.random.default_rng(3).standard_normal(128 * 300).astype(np.float32)
    assert cache_types.bits_per_value(same_bits_of) == cache_types.bits_per_value(name)
    e_128 = float(((roundtrip(x, name) - x) ** 2).mean())
    e_64 = float(((roundtrip(x, same_bits_of) - x) ** 2).mean())
    assert abs(e_64 / e_128 - 1) < 0.01, (e_128, e_64)


@pytest.mark.parametrize("name", TYPES)
def test_registry_and_row_validation(name):
    L = lib()
    t = cache_types.resolve(name)
    k, qk = tcq.bits_of(name), tcq.BLOCK[name]
    assert ffi.string(L.ggml_type_name(t)).decode() == name
    assert L.ggml_blck_size(t) == qk and L.ggml_is_quantized(t)
    assert L.ggml_kvq_tcq_block(t) == qk
    sb = tcq.SCALE_BYTES[name]
    assert L.ggml_row_size(t, 2 * qk) == 2 * tcq.block_bytes(k, qk, sb)
    good = bytearray(tcq.pack(*tcq.quantize_blocks(gaussian(4 * qk, 5), k, **blocks_of(name)), k))
    assert L.ggml_validate_row_data(t, bytes(good), len(good))
    bad = bytearray(good)
    off = tcq.block_bytes(k, qk, sb)                  # d of the second block
    if sb == 1:                                       # every code is a finite scale
        for c in (0, 255):
            bad[off] = c
            assert L.ggml_validate_row_data(t, bytes(bad), len(bad))
    else:
        bad[off:off + 2] = np.float16(np.inf).tobytes()
        assert not L.ggml_validate_row_data(t, bytes(bad), len(bad))


def test_converter_prices_with_the_library_codec():
    """The converter's round trip of a trellis type (the library's codec, for speed) is the numpy reference's."""
    from convert import codebook
    x = gaussian(64 * 24, 7).reshape(-1, 128)
    for name in TYPES:
        np.testing.assert_array_equal(codebook.roundtrip(x, name).view(np.uint32), roundtrip(x, name).view(np.uint32))


@pytest.mark.parametrize("which", ["k", "v"])
def test_a_head_of_64_refuses_the_128_blocks(smollm2, which):
    """SmolLM2's heads of 64 cannot hold tcq*_128 rows: a clear error naming the block and the head, no context."""
    from pykvq.errors import CacheTypeError
    from pykvq.model import Model
    kw = {f"cache_type_{which}": "tcq2_128"}
    with pytest.raises(CacheTypeError, match="blocks of 128 values.*head size 64"):
        Model(smollm2, n_ctx=256, flash_attn=True, **kw)
