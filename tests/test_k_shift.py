"""The K-shift graph at the op level: a context shift dequantizes each K cell, re-ropes it by the shift and
quantizes it again (upstream's build_rope_shift: cast to f32, ggml_rope_ext, ggml_cpy into the cache). Here the
shifted cells' bytes, read from a sequence state, are held against the numpy references doing the same.

At the model level a broken shift hides in the noise of requantization (measured on SmolLM2, +64 and back, KLD over
the next 48 tokens: q4_0 0.037 shifted, 0.066 with the re-rope skipped; nuq3 with a file codebook, +37: 0.17
requantized with the file's codebook, 0.20 with the fallback's). In the bytes it does not: a skipped shift and a
shift requantized with another codebook are the controls below.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf_variants import variant

from pykvq import Model, cache_types
from pykvq.ref import bfp, nuq
from pykvq.ref.prerope import NORM, rope, rope_freqs

N_LAYER, N_HEAD_KV, HEAD = 30, 3, 64      # SmolLM2-135M
FREQ_BASE = 100000.0
N, DELTA = 100, 37
OTHER3 = np.array([-120, -80, -45, -15, 15, 45, 80, 120], np.int8)


def codec(type_name: str, cb=None):
    """(quantize, dequantize) of a row by the numpy reference of the type."""
    if type_name.startswith("nuq"):
        return (lambda x: nuq.quantize_bytes(x, type_name, cb)), (lambda b: nuq.dequantize_bytes(b, type_name, cb))
    return (lambda x: bfp.quantize_row(x, type_name)), (lambda b: bfp.dequantize_row(b, type_name))


def type_word(type_name: str, cb=None) -> int:
    """llama_kvq_state_type_word for a K layer without rotation or pre-RoPE: the type id, and a file codebook's
    fingerprint (FNV-1a of its entries, 1 + h % 255) in bits 20..27 (native/llama/llama-kvq-memory.cpp)."""
    word = cache_types.resolve(type_name)
    if cb is not None:
        h = 2166136261
        for c in np.asarray(cb, np.int8).view(np.uint8):
            h = ((h ^ int(c)) * 16777619) & 0xFFFFFFFF
        word |= (1 + h % 255) << 20
    return word


def state_k_rows(state: bytes, word: int, n_cells: int) -> list[bytes]:
    """Each layer's K rows from a sequence state (llama_kv_cache::state_write_data: per layer the type word, the
    row size as u64, then the cells' rows): found where N_LAYER such records follow one another."""
    tag = struct.pack("<i", word)
    start = state.find(tag)
    while start >= 0:
        rows, at = [], start
        while len(rows) < N_LAYER and state[at:at + 4] == tag:
            size = struct.unpack_from("<Q", state, at + 4)[0]
            rows.append(state[at + 12:at + 12 + size * n_cells])
            at += 12 + size * n_cells
        if len(rows) == N_LAYER:
            return rows
        start = state.find(tag, start + 1)
    raise AssertionError(f"no {N_LAYER} K records with type word {word:#x} in the state")


def shifted_cells(path, tokens, type_name: str, cb=None, **kw) -> tuple[list[bytes], list[bytes]]:
    """Each layer's K rows of N cells before and after moving them by DELTA."""
    with Model(path, n_ctx=512, flash_attn=True, cache_type_v="f16", attn_rot_k="off", **kw) as m:
        m.decode(tokens[:N], 0)
        before = m.get_seq_state()
        m.seq_add(0, N, DELTA)
        m.decode(tokens[N:N + 1], N + DELTA)          # the shift runs before this batch
        after = m.get_seq_state()
    word = type_word(type_name, cb)
    k0 = state_k_rows(before, word, N)
    return k0, [r[:len(k0[0])] for r in state_k_rows(after, word, N + 1)]   # cells 0..N-1 are the shifted ones


def equal_fraction(k0: list[bytes], k1: list[bytes], type_name: str, cb_read=None, cb_write=None) -> np.ndarray:
    """Per layer: the share of values where the reference shift of k0 (read with cb_read, re-roped in float64,
    written with cb_write) decodes to exactly what the cache holds in k1."""
    _, deq = codec(type_name, cb_read)
    quant, _ = codec(type_name, cb_write)
    w, _ = rope_freqs(HEAD, FREQ_BASE, n_cols=N_HEAD_KV)
    out = []
    for a, b in zip(k0, k1):
        x = deq(a).reshape(N, N_HEAD_KV, HEAD)
        y = rope(x, np.full(N, DELTA), w, NORM, HEAD).astype(np.float32).reshape(-1)
        out.append(np.mean(deq(quant(y)) == deq(b)))
    return np.array(out)


@pytest.fixture(scope="module")
def tokens(smollm2, passage):
    with Model(smollm2, n_ctx=512) as m:
        return m.tokenize(passage)[:N + 1]


@pytest.fixture(scope="module")
def codebook_file(smollm2, module_tmp):
    """nuq3 K with a codebook of the file's own in every layer."""
    return variant(smollm2, module_tmp("k_shift") / "codebook.gguf", layer_types_k=["nuq3"] * N_LAYER,
                   layer_types_v=["f16"] * N_LAYER, type_k="nuq3", type_v="f16", rot_k=True,
                   codebooks_k={il: OTHER3 for il in range(N_LAYER)})


# bounds: ggml ropes in f32, the reference in float64, so a value on a rounding boundary may land on the
# neighbouring code (measured below 0.2% of values); a skipped shift or another codebook changes far more
@pytest.mark.parametrize("k_type", ["nuq4", "nuq3o", "bfp4_32", "bfp8_32"])
def test_k_shift_requantizes_what_the_reference_does(smollm2, tokens, k_type):
    k0, k1 = shifted_cells(smollm2, tokens, k_type, cache_type_k=k_type)
    shift = equal_fraction(k0, k1, k_type)
    skipped = np.array([np.mean(np.frombuffer(a, np.uint8) == np.frombuffer(b, np.uint8)) for a, b in zip(k0, k1)])
    print(f"{k_type}: equal to the reference {shift.min():.4f}; bytes unchanged (as if skipped) {skipped.max():.4f}")
    assert shift.min() > 0.99
    assert skipped.max() < 0.9          # control: a skipped re-rope would leave the bytes as they were


def test_k_shift_requantizes_with_the_files_codebook(codebook_file, tokens):
    k0, k1 = shifted_cells(codebook_file, tokens, "nuq3", OTHER3)
    shift = equal_fraction(k0, k1, "nuq3", OTHER3, OTHER3)
    fallback = equal_fraction(k0, k1, "nuq3", OTHER3, None)       # control: requantized with the fallback codebook
    print(f"nuq3, file codebook: equal to the reference {shift.min():.4f}; with the fallback's {fallback.max():.4f}")
    assert shift.min() > 0.99
    assert fallback.max() < 0.98        # measured 0.96: the two codebooks differ by a few steps of 127
