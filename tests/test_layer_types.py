"""Per-layer KV-cache types and nuq codebooks from the GGUF (the model loading and KV cache seams).

Each test works on a copy of SmolLM2 with pykvq.cache.* keys (and blk.N.kvq_codebook_k/v tensors)
added; the weights are untouched, so a run with per-layer keys can be compared with a run of the
original file whose cache type is forced for all layers.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf_variants import variant

from pykvq import Model, cache_types, log
from pykvq.errors import CacheTypeError, DecodeError
from pykvq.keys import Keys, Tensors, suffix
from pykvq.model import KV_CACHE_TYPE_MODEL

N_LAYER = 30
N_CTX = 512
N_TOK = 160
OTHER3 = np.array([-120, -80, -45, -15, 15, 45, 80, 120], np.int8)   # a file codebook for nuq3


@pytest.fixture(scope="module")
def files(smollm2, module_tmp):
    d = module_tmp("layer_types")
    mixed_k = ["q8_0"] + ["q4_0"] * (N_LAYER - 2) + ["q8_0"]
    return {
        # layer 0 and the last K in q8_0, the rest q4_0; V all q8_0
        "mixed": variant(smollm2, d / "mixed.gguf", layer_types_k=mixed_k, layer_types_v=["q8_0"] * N_LAYER,
                         type_k="q4_0", type_v="q8_0"),
        # every layer the same type through the per-layer keys
        "uniform": variant(smollm2, d / "uniform.gguf", layer_types_k=["q4_0"] * N_LAYER,
                           layer_types_v=["q8_0"] * N_LAYER),
        # only pykvq.cache.type_k/v (the sentinel path without per-layer keys)
        "typed": variant(smollm2, d / "typed.gguf", type_k="q8_0", type_v="q4_0"),
        # one quantized V layer: needs flash attention
        "one_quant_v": variant(smollm2, d / "one_quant_v.gguf", layer_types_k=["f16"] * N_LAYER,
                               layer_types_v=["f16"] * (N_LAYER - 1) + ["q8_0"]),
    }


@pytest.fixture(scope="module")
def tokens(smollm2, passage):
    with Model(smollm2, n_ctx=N_CTX, flash_attn=True) as m:
        return m.tokenize(passage)[:N_TOK]


def logits(path, tokens, **kw):
    with Model(path, n_ctx=N_CTX, flash_attn=True, **kw) as m:
        return m.eval_logits(tokens, output_from=0)


def test_model_sentinel_is_ggml_type_count(files):
    """Model passes LLAMA_KV_CACHE_TYPE_MODEL (= GGML_TYPE_COUNT) for a type left open; a wrong value
    would allocate some other type (or crash)."""
    with Model(files["typed"], n_ctx=N_CTX, flash_attn=True) as m:
        assert m.layer_cache_types() == [("q8_0", "q4_0")] * N_LAYER
        assert (m.cache_type_k, m.cache_type_v) == ("q8_0", "q4_0")
    assert KV_CACHE_TYPE_MODEL == max(cache_types.CACHE_TYPES.values()) + 1


def test_per_layer_types_are_allocated(files):
    with Model(files["mixed"], n_ctx=N_CTX, flash_attn=True) as m:
        lib = m._lib
        q8, q4 = cache_types.resolve("q8_0"), cache_types.resolve("q4_0")
        for il in range(N_LAYER):
            want = q8 if il in (0, N_LAYER - 1) else q4
            assert lib.llama_kvq_layer_type(m._ctx, il, False) == want
            assert lib.llama_kvq_layer_type(m._ctx, il, True) == q8
            assert lib.llama_kvq_codebook_source(m._ctx, il, False) == 0
        assert lib.llama_kvq_layer_type(m._ctx, N_LAYER, False) == -1
        assert lib.llama_kvq_layer_type(m._ctx, -1, True) == -1
        assert m.cache_type_k == "mixed" and m.cache_type_v == "q8_0"
        assert m.cache_type_source["K"] == f"GGUF {Keys.Cache.LAYER_TYPES_K}"
        types = m.layer_cache_types()
        assert types[0] == ("q8_0", "q8_0") and types[1] == ("q4_0", "q8_0") and types[-1] == ("q8_0", "q8_0")
        text = log.recent_text(5000)
        assert "K cache types per layer: q4_0 \u00d728, q8_0 \u00d72 (layers 0,29)" in text
        info = m.kv_cache_info()
        assert info.mixed and info.type_summary("k") == "q4_0 x28, q8_0 x2 (layers 0,29)"


def test_per_layer_keys_give_the_same_logits_as_a_forced_type(smollm2, files, tokens):
    ref = logits(smollm2, tokens, cache_type_k="q4_0", cache_type_v="q8_0")
    got = logits(files["uniform"], tokens)
    assert np.array_equal(got, ref)


def test_forced_type_overrides_per_layer_keys(smollm2, files, tokens):
    with Model(files["mixed"], n_ctx=N_CTX, flash_attn=True, cache_type_k="q4_0") as m:
        assert m.layer_cache_types() == [("q4_0", "q8_0")] * N_LAYER
        assert m.cache_type_source == {"K": "caller", "V": f"GGUF {Keys.Cache.LAYER_TYPES_V}"}
        got = m.eval_logits(tokens, output_from=0)
    assert np.array_equal(got, logits(smollm2, tokens, cache_type_k="q4_0", cache_type_v="q8_0"))


def test_mixed_types_change_the_logits(smollm2, files, tokens):
    mixed = logits(files["mixed"], tokens)
    all_q4 = logits(smollm2, tokens, cache_type_k="q4_0", cache_type_v="q8_0")
    all_q8 = logits(smollm2, tokens, cache_type_k="q8_0", cache_type_v="q8_0")
    assert np.all(np.isfinite(mixed))
    assert not np.array_equal(mixed, all_q4) and not np.array_equal(mixed, all_q8)
    # two of thirty K layers in q8_0: closer to all-q8_0 than all-q4_0 is
    assert np.abs(mixed - all_q8).mean() < np.abs(all_q4 - all_q8).mean()


def test_cache_size_is_the_per_layer_sum(files):
    with Model(files["mixed"], n_ctx=N_CTX, flash_attn=True) as m:
        text = log.recent_text(5000)
        info = m.kv_cache_info()
        lib = m._lib
        nk = nv = m.n_head_kv * m.head_dim_k
        want = sum(lib.ggml_row_size(lib.llama_kvq_layer_type(m._ctx, il, False), nk)
                   + lib.ggml_row_size(lib.llama_kvq_layer_type(m._ctx, il, True), nv) for il in range(N_LAYER)) * m.n_ctx
        assert m.kv_cache_bytes() == info.total_bytes == want
        mib = float(re.findall(r"llama_kv_cache: size = +([0-9.]+) MiB", text)[-1])
        assert abs(mib - want / 2**20) < 0.006
        bits = float(re.findall(r"KV cache bits/value: K [0-9.]+, V [0-9.]+, K\+V ([0-9.]+)", text)[-1])
        assert abs(bits - info.bits_per_value) < 5e-4
        # 2 layers of q8_0 (8.5 bits) and 28 of q4_0 (4.5) for K, q8_0 for V
        assert info.bits_per_value == pytest.approx(((2 * 8.5 + 28 * 4.5) / 30 + 8.5) / 2)


def test_quantized_v_in_any_layer_needs_flash_attention(files):
    with pytest.raises(CacheTypeError):
        Model(files["one_quant_v"], n_ctx=N_CTX, flash_attn=False)
    with Model(files["one_quant_v"], n_ctx=N_CTX, flash_attn="auto") as m:
        assert m.layer_cache_types()[-1] == ("f16", "q8_0") and m.cache_type_v == "mixed"


def test_state_round_trip_and_type_check_per_layer(smollm2, files, tokens):
    with Model(files["mixed"], n_ctx=N_CTX, flash_attn=True) as m:
        m.eval_logits(tokens[:100])
        state = m.get_state()
        a = m.decode(tokens[100:110], 100)
        m.reset()
        m.set_state(state)
        b = m.decode(tokens[100:110], 100)
        assert np.array_equal(a, b)
    # the same layer count and sizes, but layer 0's K is q4_0 here: rejected
    with Model(smollm2, n_ctx=N_CTX, flash_attn=True, cache_type_k="q4_0", cache_type_v="q8_0") as other:
        with pytest.raises(DecodeError):
            other.set_state(state)
        assert "mismatched key type" in log.recent_text(50)


def shift_kl(path, tokens, **kw) -> float:
    """K-shift against a direct evaluation: 100 tokens decoded at 0.. and moved by +37, then the next
    token, vs. the same tokens decoded at 37.. (RoPE is relative: equal up to rounding and requantization)."""
    with Model(path, n_ctx=N_CTX, flash_attn=True, **kw) as m:
        m.decode(tokens[:100], 0)
        m.seq_add(0, 100, 37)
        shifted = m.decode(tokens[100:101], 137)
        m.reset()
        m.decode(tokens[:100], 37)
        ref = m.decode(tokens[100:101], 137)
    assert np.all(np.isfinite(shifted))
    p, q = np.exp(shifted - shifted.max()), np.exp(ref - ref.max())
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30))))


def test_k_shift_with_mixed_types(smollm2, files, tokens):
    """Context shift re-ropes each layer's K in its own type, f16 layers of a rotated cache included
    (they must be un-rotated around the RoPE like the quantized ones)."""
    path = variant(files["mixed"], files["mixed"].with_name("shift.gguf"),
                   layer_types_k=["f16"] * 3 + ["q4_0"] * (N_LAYER - 3), layer_types_v=["f16"] * N_LAYER)
    with Model(path, n_ctx=N_CTX, flash_attn=True) as m:
        assert m.attn_rotation["K"]                      # some layers are quantized: the whole cache is rotated
    # measured: f16 ~0.001, f16 rotated ~0.001, q4_0 ~0.06, this file ~0.06
    assert shift_kl(smollm2, tokens, cache_type_k="f16", cache_type_v="f16", attn_rot_k="on") < 0.01
    kl_q4 = shift_kl(smollm2, tokens, cache_type_k="q4_0", cache_type_v="f16")
    assert shift_kl(path, tokens) < 1.5 * kl_q4 + 0.01


# ---- nuq codebooks ---------------------------------------------------------------------------------

def _has_nuq() -> bool:
    if "nuq3" not in cache_types.CACHE_TYPES:
        return False
    from pykvq._lib import lib
    try:
        return bool(lib().ggml_kvq_is_nuq(cache_types.resolve("nuq3")))
    except (AttributeError, OSError):
        return False


nuq = pytest.mark.skipif(not _has_nuq(), reason="this build has no nuq cache types")


@pytest.fixture(scope="module")
def nuq_files(smollm2, module_tmp):
    from pykvq.ref import nuq as ref
    d = module_tmp("codebooks")
    fb3 = ref.fallback("nuq3")
    other3 = OTHER3
    types = dict(layer_types_k=["nuq3"] * N_LAYER, layer_types_v=["q8_0"] * N_LAYER, type_k="nuq3", type_v="q8_0")
    return {
        "none": variant(smollm2, d / "none.gguf", **types),
        "fallback": variant(smollm2, d / "fallback.gguf", **types, rot_k=True,
                            codebooks_k={il: fb3 for il in range(N_LAYER)}),
        "other": variant(smollm2, d / "other.gguf", **types, rot_k=True,
                         codebooks_k={il: other3 for il in range(N_LAYER)}),
        "partial": variant(smollm2, d / "partial.gguf", **types, rot_k=True, codebooks_k={0: other3, 5: other3}),
        "bad": variant(smollm2, d / "bad.gguf", **types, codebooks_k={0: other3[::-1].copy()}),
        "rot_off": variant(smollm2, d / "rot_off.gguf", **types, rot_k=False, codebooks_k={0: other3}),
    }


@nuq
def test_codebook_sources(nuq_files):
    with Model(nuq_files["other"], n_ctx=N_CTX, flash_attn=True) as m:
        assert m.layer_cache_types() == [("nuq3", "q8_0")] * N_LAYER
        assert [m._lib.llama_kvq_codebook_source(m._ctx, il, False) for il in range(N_LAYER)] == [1] * N_LAYER
        assert [m._lib.llama_kvq_codebook_source(m._ctx, il, True) for il in range(N_LAYER)] == [0] * N_LAYER
        assert "K codebooks: file for 30 layers, fallback for 0" in log.recent_text(5000)
    # the codebooks were calibrated for nuq3: a forced nuq2 cache falls back
    with Model(nuq_files["other"], n_ctx=N_CTX, flash_attn=True, cache_type_k="nuq2") as m:
        assert [m._lib.llama_kvq_codebook_source(m._ctx, il, False) for il in range(N_LAYER)] == [2] * N_LAYER
        assert m.codebook_sources()[0] == ("fallback", "")
    with Model(nuq_files["partial"], n_ctx=N_CTX, flash_attn=True) as m:
        src = [s for s, _ in m.codebook_sources()]
        assert src[0] == src[5] == "file" and src.count("fallback") == N_LAYER - 2
        assert "K codebooks: file for 2 layers, fallback for 28" in log.recent_text(5000)


@nuq
def test_fallback_codebook_in_the_file_equals_no_codebook(nuq_files, tokens):
    none = logits(nuq_files["none"], tokens)
    assert np.array_equal(logits(nuq_files["fallback"], tokens), none)
    other = logits(nuq_files["other"], tokens)
    assert np.all(np.isfinite(other)) and not np.array_equal(other, none)
    # one layer's codebook is enough to change the result, and only a codebook in use does
    assert not np.array_equal(logits(nuq_files["partial"], tokens), none)
    assert np.array_equal(logits(nuq_files["other"], tokens, cache_type_k="nuq4"),
                          logits(nuq_files["none"], tokens, cache_type_k="nuq4"))


@nuq
def test_codebook_with_k_shift_and_fa_off(nuq_files, tokens):
    """A file codebook reaches the K·Q MUL_MAT (flash attention off) and the K-shift graph."""
    a = logits(nuq_files["other"], tokens)
    with Model(nuq_files["other"], n_ctx=N_CTX, flash_attn=False, cache_type_v="f16") as m:
        b = m.eval_logits(tokens, output_from=0)
    with Model(nuq_files["none"], n_ctx=N_CTX, flash_attn=False, cache_type_v="f16") as m:
        c = m.eval_logits(tokens, output_from=0)
    # with FA off the file codebook still matters, and the result tracks the FA run with the same codebook
    assert not np.array_equal(b, c)
    assert np.abs(b[:, :] - a[:, :]).mean() < np.abs(c - a).mean()
    # a K-shift runs with a file codebook (measured 0.016 and 0.0005; a stale cell gives 1-10): which codebook it
    # requantizes with is too small a difference for the model's KLD, tests/test_k_shift.py checks the bytes
    kl_file, kl_none = shift_kl(nuq_files["other"], tokens), shift_kl(nuq_files["none"], tokens)
    assert kl_file < 0.2 and kl_none < 0.2


@nuq
def test_bad_codebook_fails_and_rotation_mismatch_warns(nuq_files):
    with pytest.raises(CacheTypeError, match=suffix(Tensors.CODEBOOK_K)):
        Model(nuq_files["bad"], n_ctx=N_CTX, flash_attn=True)
    with Model(nuq_files["rot_off"], n_ctx=N_CTX, flash_attn=True) as m:
        assert m.attn_rotation["K"]
        assert "calibrated with the online Hadamard rotation off" in log.recent_text(5000)
    with Model(nuq_files["rot_off"], n_ctx=N_CTX, flash_attn=True, attn_rot_k="off") as m:
        assert "calibrated with the online Hadamard rotation" not in log.recent_text(5000)
