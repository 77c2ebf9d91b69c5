"""--kv-window auto (convert/window_choice.py): the lengths tried, the judge's KL divergence against the full one,
the held-out sequences, and a real conversion that keeps the length its judge measured best."""
from __future__ import annotations

import numpy as np
import pytest

from convert import window_choice
from convert.gguf_io import ConvertError, read_gguf
from pykvq.keys import Keys


def _full_kl(p_logits, q_logits):
    lp = p_logits - np.log(np.exp(p_logits).sum(axis=1, keepdims=True))
    lq = q_logits - np.log(np.exp(q_logits).sum(axis=1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def test_candidates_leave_the_cache_its_cheapest_types():
    # 4 sinks at 4096 cells: 16 x (4 + W + 1) / 4096 bits; the cheapest K and V types 2.625 bits
    assert window_choice.candidates(3.0, 4, 4096, 2.625) == [16, 32, 64]          # W 128: 2.48 bits left
    assert window_choice.candidates(3.5, 4, 4096, 2.625) == [16, 32, 64, 128]     # W 256: 2.48 bits left
    assert window_choice.candidates(3.0, 4, 16384, 2.625) == [16, 32, 64, 128, 256]
    assert window_choice.candidates(3.0, 4, 256, 2.625) == []                     # 16 costs 1.3 bits at 256
    assert window_choice.candidates(6.0, 4, 256, 2.625) == [16, 32]               # at most an eighth of the context


def test_kl_over_the_top_tokens():
    rng = np.random.default_rng(0)
    p = 3 * rng.standard_normal((6, 40))
    q = p + 0.3 * rng.standard_normal((6, 40))
    full = _full_kl(p, q)
    # every token kept: exactly the full KL divergence
    np.testing.assert_allclose(window_choice.kl_rows(window_choice.top_of(p, 40), q), full, rtol=1e-10, atol=1e-14)
    # fewer: a lower bound (log-sum inequality), most of it where the reference is peaked
    part = window_choice.kl_rows(window_choice.top_of(p, 8), q)
    assert np.all(part <= full + 1e-12) and np.all(part >= 0)
    assert part.sum() > 0.5 * full.sum()
    # identical distributions: zero
    np.testing.assert_allclose(window_choice.kl_rows(window_choice.top_of(p, 8), p), 0, atol=1e-12)


def test_held_out_sequences_follow_the_calibration_windows():
    toks = list(range(10_000))
    # calibration: 4 windows of 512 at 0, 2500, 5000, 7500
    seqs = window_choice.sequences(toks, 4, 512, 2, 1024)
    assert [s[0] for s in seqs] == [512, 3012] and all(len(s) == 1024 for s in seqs)
    # fewer windows than sequences: a second one after the first window
    assert [s[0] for s in window_choice.sequences(toks, 2, 512, 3, 1000)] == [512, 5512, 1512]
    # 2000 tokens do not fit between the windows: too short, said so
    with pytest.raises(ConvertError, match="too short"):
        window_choice.sequences(toks, 4, 512, 2, 2000)


def test_auto_needs_a_budget_and_a_context(smollm2, tmp_path):
    from convert import to_gguf
    for flag in ("--kv-window", "--kv-heavy"):
        for extra in ([], ["--kv-bits", "4"], ["--kv-bits-ctx", "512"]):
            args = to_gguf.build_parser().parse_args([str(smollm2), "-o", str(tmp_path / "x.gguf"), "--prerope-k",
                                                      flag, "auto", *extra])
            with pytest.raises(ConvertError, match=f"{flag} auto .* needs --prerope-k, --kv-bits B and --kv-bits-ctx N"):
                to_gguf.convert(args)
    with pytest.raises(SystemExit):
        to_gguf.build_parser().parse_args([str(smollm2), "-o", "x", "--kv-window", "long"])
    assert not list(tmp_path.iterdir())


def test_auto_keeps_the_window_it_measured_best(smollm2, tmp_path):
    """A real conversion (the default calibration, its gradients taken again per window; 512 tokens so that it is
    quick): the file written is the tried file with the lowest KL divergence, and the judge gives that file the same
    number again. With --kv-heavy auto, each length is tried without and with 1% heavy hitters, paid from the types."""
    from convert import to_gguf
    out = tmp_path / "auto.gguf"
    s = to_gguf.convert(to_gguf.build_parser().parse_args(
        [str(smollm2), "-o", str(out), "--prerope-k", "--kv-bits", "3.6", "--kv-bits-ctx", "512", "--kv-window", "auto",
         "--kv-heavy", "auto", "--calib-seqs", "2", "--calib-len", "256", "--no-progress"]))
    r = s["window_choice"]
    # at 512 cells a window of 64 leaves the types less than the cheapest (2.625 bits); the heavy hitters: 6 more rows
    assert [(t["window"], t["heavy"]) for t in r["tried"]] == [(16, 0), (16, 0.01), (32, 0), (32, 0.01)]
    for a, b in (r["tried"][0:2], r["tried"][2:4]):
        assert b["bits_per_value"] <= a["bits_per_value"]
    best = min(r["tried"], key=lambda t: t["kld"])
    assert (r["chosen"], r["heavy"]) == (best["window"], best["heavy"]) == (s["prerope_k"]["kv_window"],
                                                                           s["prerope_k"].get("kv_heavy", 0.0))
    f = read_gguf(out).fields
    assert f[Keys.Cache.KV_WINDOW].value == best["window"]
    assert (f[Keys.Cache.KV_HEAVY].value if best["heavy"] else Keys.Cache.KV_HEAVY not in f) == \
        (pytest.approx(0.01) if best["heavy"] else True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto.gguf"]       # no candidate left behind
    from convert.calib import calibration_text
    judge = window_choice.Judge(smollm2, calibration_text("canterbury")[0], 512, 2, 256)
    assert judge.kld(out) == pytest.approx(best["kld"], rel=1e-6)
    assert 0 < best["kld"] < 0.5


def test_judge_reads_logits_without_copies_or_repacked_weights(smollm2):
    """The judge's Model (window_choice.REPACK: no repacked copy of the weights) and its views of llama.cpp's logits
    buffer (iter_logits(copy=False)) give the rows eval_logits gives."""
    from pykvq import Model
    text = "The quick brown fox jumps over the lazy dog. " * 40
    with Model(smollm2, n_ctx=512, n_batch=128, cache_type_k="f16", cache_type_v="f16", flash_attn=True) as m:
        toks = m.tokenize(text)[:300]
        ref = m.eval_logits(toks, output_from=100)
    with Model(smollm2, n_ctx=512, n_batch=128, cache_type_k="f16", cache_type_v="f16", flash_attn=True,
               repack_weights=window_choice.REPACK) as m:
        views = []
        for x in m.iter_logits(toks, output_from=100, copy=False):
            assert not x.flags.writeable
            views.append(x.copy())
    got = np.concatenate(views)
    assert got.shape == ref.shape == (200, m.n_vocab)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3 * np.abs(ref).max())
