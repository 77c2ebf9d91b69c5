"""q4t2_64 / t32_64 (key blocks split by importance with trellis-coded halves): the numpy reference against
hand-checked properties, the C reference and the CPU traits bit for bit against numpy, K·Q against q8_0, row
validation, and the squared error the types exist for (against q42_64 / q32_64 at the same bits)."""
from __future__ import annotations

import numpy as np
import pytest

from pykvq import cache_types
from pykvq._lib import ffi, lib
from pykvq.ref import q53, roundtrip, tcq
from test_q53 import c_quantize as c_codec
from test_q53 import cpu_traits_match
from test_tcq import edge_rows, gaussian, read_back_dot_matches

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CODECS = {"q4t2_64": (q53.q4t2_quantize_blocks, q53.q4t2_dequantize_blocks, q53.q4t2_pack, q53.q4t2_unpack, 27),
          "t32_64": (q53.t32_quantize_blocks, q53.t32_dequantize_blocks, q53.t32_pack, q53.t32_unpack, 22)}


@pytest.mark.parametrize("name", CODECS)
def test_layout_and_states_round_trip(name):
    """Block sizes by hand (27 = 2 + 1 + 16 + 8, 22 = 1 + 1 + 12 + 8: an f16 scale, trellis halves' scale codes), and the stored streams
    give back the encoder's states: each the 8-bit window of its half's stream, around the half."""
    quantize, _, pack, unpack, size = CODECS[name]
    assert cache_types.KVQ_TYPES[name].block_bytes == size and name in q53.HALVES_TYPES
    parts = quantize(gaussian(64 * 30, 1))
    raw = pack(*parts)
    assert len(raw) == 30 * size
    for a, b in zip(parts, unpack(raw)):
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
    for st, k in ((parts[3], 2),) + (((parts[1], 3),) if name == "t32_64" else ()):
        ml = (1 << (8 - k)) - 1
        assert (st[:, 1:] & ml).tolist() == (st[:, :-1] >> k).tolist()
        assert (st[:, 0] & ml).tolist() == (st[:, -1] >> k).tolist()


def test_q4t2_first_half_is_q42s():
    """q4t2_64's first half is q42_64's, byte for byte (scale, nibbles); only the second half's code differs."""
    x = gaussian(64 * 20, 4)
    a = np.frombuffer(q53.q4t2_pack(*q53.q4t2_quantize_blocks(x)), np.uint8).reshape(-1, 27)
    b = np.frombuffer(q53.q42_pack(*q53.q42_quantize_blocks(x)), np.uint8).reshape(-1, 28)
    np.testing.assert_array_equal(a[:, 0:2], b[:, 0:2])
    np.testing.assert_array_equal(a[:, 3:19], b[:, 4:20])


@pytest.mark.parametrize("name", CODECS)
def test_c_reference_and_cpu_traits_match_numpy_bit_for_bit(name):
    quantize, dequantize, pack, _, _ = CODECS[name]
    x = np.concatenate([gaussian(64 * 48, 2), edge_rows()])
    raw, back = c_codec(name, x)
    parts = quantize(x)
    assert raw == pack(*parts)
    want = dequantize(*parts).reshape(-1)
    np.testing.assert_array_equal(back.view(np.uint32), want.view(np.uint32))
    read_back_dot_matches(name, cpu_traits_match(name, x, raw, want))


@pytest.mark.parametrize("name, scalar, half, most", [("q4t2_64", "q42_64", slice(32, 64), 0.8),
                                                      ("t32_64", "q32_64", slice(0, 64), 0.8)])
def test_less_squared_error_than_the_scalar_halves(name, scalar, half, most):
    """On unit Gaussian blocks the trellis halves read back with at most `most` of the scalar split's squared error,
    in fewer bits (their scale codes: 0.125 / 0.25 bits/value). Measured 2026-12-01 with f16 scales: q4t2_64's second
    half 0.081 against q42_64's 0.109 (0.75x); t32_64 0.051 against q32_64's 0.067 (0.76x)."""
    x = np.random.default_rng(3).standard_normal(64 * 400).astype(np.float32).reshape(-1, 64)
    assert cache_types.bits_per_value(name) < cache_types.bits_per_value(scalar)
    e_t = float(((roundtrip(x, name) - x)[:, half] ** 2).mean())
    e_s = float(((roundtrip(x, scalar) - x)[:, half] ** 2).mean())
    assert e_t < most * e_s, (e_t, e_s)


@pytest.mark.parametrize("name", CODECS)
def test_registry_and_row_validation(name):
    L = lib()
    t = cache_types.resolve(name)
    quantize, _, pack, _, size = CODECS[name]
    assert ffi.string(L.ggml_type_name(t)).decode() == name
    assert L.ggml_blck_size(t) == 64 and L.ggml_row_size(t, 128) == 2 * size
    good = bytearray(pack(*quantize(gaussian(256, 5))))
    assert L.ggml_validate_row_data(t, bytes(good), len(good))
    if name == "q4t2_64":                             # the second block's f16 scale
        bad = bytearray(good)
        bad[size:size + 2] = np.float16(np.nan).tobytes()
        assert not L.ggml_validate_row_data(t, bytes(bad), len(bad))
    for off in (size + 2,) if name == "q4t2_64" else (size, size + 1):   # scale codes: every byte a finite scale
        for c in (0, 255):
            ok = bytearray(good)
            ok[off] = c
            assert L.ggml_validate_row_data(t, bytes(ok), len(ok))
