"""`pykvq demo`: its table on the real default model and real WikiText-2 text (a small budget),
and the pure formatting / explanation helpers."""
from __future__ import annotations

import pytest

from pykvq import demo
from pykvq.model import Model
from pykvq.suite.settings import parse_setting


@pytest.fixture(scope="module")
def table(smollm2):
    # 1 chunk of 128 tokens of WikiText-2 test (pykvq.data.eval_text), at a small demo context: seconds
    return demo.demo_table(smollm2, n_ctx=1024, eval_ctx=128, n_chunks=1)


def test_table_rows(table):
    rows, text = table
    assert [r.label for r in rows] == [label for label, _ in demo.ROWS]
    assert len(rows) == 3 and rows[0].label == "f16"
    assert "stock" in rows[1].label and "pykvq" in rows[2].label
    for r in rows:                                   # every row appears in the printed table
        assert r.label in text
    lines = text.splitlines()
    assert lines[1].startswith("---") and [ln.split("  ")[0] for ln in lines[2:5]] == [r.label for r in rows]
    f16, q4, ours = rows
    assert f16.mean_kld == pytest.approx(0.0, abs=1e-6) and f16.same_top1 == 1.0
    assert q4.mean_kld > 0 and ours.mean_kld > 0     # measured, and quantization costs something
    assert all(r.n_tokens == f16.n_tokens > 0 for r in rows)
    assert (f16.cache_k, q4.cache_k, ours.cache_k, ours.cache_v) == ("f16", "q4_0", "q53_64", "q4_0")


def test_kv_sizes_match_the_models(table, smollm2):
    rows, _ = table
    for (label, spec), row in zip(demo.ROWS, rows):
        s = parse_setting(spec)
        with Model(demo.model_file(smollm2, s), n_ctx=1024, flash_attn=True, **s.model_kwargs()) as m:
            info = m.kv_cache_info()
            if spec == demo.PYKVQ_SETTING:           # the explanation comes from what the file holds
                line = demo.explain_model(spec, m)
                assert "before RoPE" in line and "keys in q53_64" in line, line
                assert "--prerope-k" in line and "block scales by least squares" in line, line
            if spec == "q4_0":                       # stock: upstream's default online Hadamard on K and V
                assert m.attn_rotation == {"K": True, "V": True}
        assert row.n_ctx == info.n_ctx == 1024
        assert row.kv_mib == pytest.approx(info.total_bytes / 2**20, rel=1e-12)
        assert row.bits_per_value == pytest.approx(info.bits_per_value)
        assert row.ratio_vs_f16 == pytest.approx(info.ratio_vs_f16)
    f16, q4, ours = rows
    assert f16.bits_per_value == 16.0 and f16.ratio_vs_f16 == 1.0
    assert q4.bits_per_value == ours.bits_per_value == 4.5
    assert ours.kv_mib == pytest.approx(f16.kv_mib * 4.5 / 16)


def test_format_table_is_pure():
    row = demo.Row(label="x", cache_k="q8_0", cache_v="q4_0", kv_mib=12.5, n_ctx=4096, bits_per_value=6.5,
                   ratio_vs_f16=0.40625, mean_kld=0.01234, kld_se=0.0005, same_top1=0.9321, n_tokens=255)
    lines = demo.format_table([row]).splitlines()
    assert lines[0].split()[:2] == ["setting", "K"] and "KV MiB @ 4096" in lines[0]
    assert lines[2].split() == ["x", "q8_0", "/", "q4_0", "12.50", "6.50", "0.406x", "0.0123", "±", "0.0005", "93.2%"]
    assert demo.format_table([]) == ""


def test_explain():
    line = demo.explain("nuq4@prerope", "nuq4", "pre-RoPE", "std", {"K": True, "V": True}, {"file"}, "fisher",
                        "convert/to_gguf.py --prerope-k")
    assert line.startswith("pykvq's setting: nuq4@prerope = nuq4 K+V, per-layer fisher codebooks from the converter")
    assert "before RoPE" in line and "Hadamard on K+V" in line and "(convert/to_gguf.py --prerope-k)" in line
    assert "\n" not in line
    line = demo.explain("q4_0", "q4_0", "post-RoPE", None, {"K": False, "V": False}, set())
    assert "before RoPE" not in line and "no online rotation" in line and "codebook" not in line
    assert "convert" not in line
