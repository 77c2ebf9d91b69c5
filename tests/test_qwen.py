"""Qwen2.5-Coder-1.5B (1.1 GB): run with PYKVQ_TEST_QWEN=1."""
from __future__ import annotations

import pytest

from pykvq import Model
from pykvq.keys import Keys, Values

pytestmark = pytest.mark.qwen


@pytest.fixture(scope="module")
def qwen():
    from pykvq.registry import fetch
    return fetch("qwen2.5-coder-1.5b")


def test_qwen_writes_python(qwen):
    with Model(qwen, n_ctx=1024) as m:
        assert m.arch == "qwen2" and m.head_dim_k == 128 and m.n_head_kv == 2
        out = m.generate("Write a Python function that returns the square of x.", max_tokens=64)
        assert "def " in out and "return" in out


def test_qwen_q8_0_kld_is_small(qwen, passage):
    with Model(qwen, n_ctx=512) as base, \
            Model(qwen, n_ctx=512, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn=True) as q8:
        r = q8.kl_divergence(passage, baseline=base, n_ctx=512, n_chunks=1)
        assert 0 < r.mean_kld < 0.05, r


@pytest.fixture(scope="module")
def qwen_hf(qwen):
    from convert.hf_checkpoint import hf_checkpoint
    return hf_checkpoint(qwen)


def _f32_logits(path, tokens):
    with Model(path, n_ctx=256, cache_type_k="f32", cache_type_v="f32", flash_attn=False) as m:
        return m.eval_logits(tokens)


def test_qwen_smoothing_on_k_quants(qwen, qwen_hf, passage, tmp_path):
    """Power-of-two pair scales on Q4_K / Q6_K rows (block scales d, dmin) and f32 q/k biases: exact
    but for f16-subnormal block scales, which the converter counts and reports."""
    import numpy as np
    from pykvq.metrics import log_softmax
    from test_convert import run_convert
    out = tmp_path / "smooth.gguf"
    res = run_convert(qwen, "-o", out, "--hf-dir", qwen_hf, "--smooth-qk", "--calib-seqs", "2", "--calib-len", "256")
    with Model(qwen, n_ctx=256) as m:
        toks = m.tokenize(passage)[:96]
    a, b = _f32_logits(qwen, toks), _f32_logits(out, toks)
    if "rounded" not in res.stdout:
        np.testing.assert_array_equal(a, b)
    la, lb = log_softmax(a.astype(np.float64)), log_softmax(b.astype(np.float64))
    assert float((np.exp(la) * (la - lb)).sum(-1).mean()) < 0.01


def test_qwen_ksort_relayout_and_v_rotation_keep_the_model(qwen, qwen_hf, passage, tmp_path):
    """K-sort on a NEOX model (re-laid as NORM, biases moved) + smoothing + V/O Hadamard: within the
    activation-rounding floor of the Q4_K_M file (its matmuls quantize activations to q8_K)."""
    import numpy as np
    from pykvq.metrics import log_softmax
    from test_convert import run_convert
    out = tmp_path / "all.gguf"
    run_convert(qwen, "-o", out, "--hf-dir", qwen_hf, "--ksort", "--smooth-qk", "--rotate-v", "hadamard",
                "--calib-seqs", "2", "--calib-len", "256")
    with Model(out, n_ctx=256) as m:
        assert m.meta(Keys.Rope.LAYOUT) == Values.ROPE_LAYOUT_NORM and m.cache_type_k == "bfp4_32"
        toks = m.tokenize(passage)[:128]
    a, b = _f32_logits(qwen, toks), _f32_logits(out, toks)
    la, lb = log_softmax(a.astype(np.float64)), log_softmax(b.astype(np.float64))
    kld = float((np.exp(la) * (la - lb)).sum(-1).mean())
    assert kld < 0.01 and (a.argmax(-1) == b.argmax(-1)).mean() > 0.9, kld


def test_qwen_q53_keys_on_a_128_head(qwen, qwen_hf, wikitext, tmp_path):
    """q53_64 keys on a 128 head: the online K rotation is the 128-wide Hadamard without its stride-32 butterfly
    (the two blocks' 5-bit halves turn together), a plain matrix written by llama_kvq_k_rot_fill and undone in
    flash attention. A rotation the write side took for upstream's Hadamard (its fast path ignores the matrix)
    measured KLD 1.48 here; right, 0.0075 over 8 chunks (docs/prerope-study.md)."""
    from test_convert import run_convert
    out = tmp_path / "q53.gguf"
    run_convert(qwen, "-o", out, "--hf-dir", qwen_hf, "--prerope-k", "--cache-type-k", "q53_64",
                "--cache-type-v", "f16", "--calib-seqs", "2", "--calib-len", "256")
    with Model(qwen, n_ctx=512) as base, Model(out, n_ctx=512, flash_attn=True) as m:
        assert m.cache_type_k == "q53_64" and m.k_domain.startswith("pre")
        r = m.kl_divergence(wikitext, baseline=base, n_ctx=512, n_chunks=2, progress=False)
    assert r.mean_kld < 0.02, r


def test_info_flags_the_key_outliers_that_break_post_rope_keys(qwen, capsys):
    """pykvq info --check-keys on Qwen2.5-Coder-1.5B: key channels with |mean|/std in the hundreds (359 on 256 tokens
    of WikiText-2; the converter's log says 479 on its corpus), so it names the converter (stock q4_0 KLD 5.7)."""
    import re

    from pykvq.cli import main
    assert main(["info", "-m", str(qwen), "--check-keys"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"keys: channels with \|mean\|/std up to (\d+): quantized post-RoPE keys", out)
    assert m and int(m.group(1)) >= 100 and "fix: pykvq-convert " in out, out
