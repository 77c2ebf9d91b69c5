"""The evaluation/benchmark suite: setting syntax, resumable results, and a real --quick run
(SmolLM2, WikiText-2) checked against direct measurements."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from pykvq import Model
from pykvq.cli import main
from pykvq.errors import PykvqError
from pykvq.suite import passkey, report
from pykvq.suite.settings import Setting, matrix, parse_setting
from pykvq.suite.store import ResultStore


@pytest.mark.parametrize("spec,label,variant,flags", [
    ("q4_0", "q4_0", None, None),
    ("q8_0/q4_0", "q8_0/q4_0", None, None),
    ("nuq3o@fisher", "nuq3o@fisher", "cb-fisher-nuq3o", ["--cache-type-k", "nuq3o", "--cache-type-v", "nuq3o"]),
    ("nuq4@smooth+vrot", "nuq4@smooth+vrot", "smooth+vrot+cb-nuq4",
     ["--smooth-qk", "--rotate-v", "hadamard", "--cache-type-k", "nuq4", "--cache-type-v", "nuq4"]),
    ("auto@kvbits-3.6", "auto@kvbits-3.6", "mixed-3.6", ["--kv-bits", "3.6"]),
    ("q4_0:rot-off", "q4_0:rot-off", None, None),
    ("q4_0@prerope", "q4_0@prerope", "prerope+cb-q4_0", ["--prerope-k", "--cache-type-k", "q4_0", "--cache-type-v", "q4_0"]),
    ("auto@prerope+kvbits-4.5", "auto@prerope+kvbits-4.5", "prerope-mixed-4.5", ["--prerope-k", "--kv-bits", "4.5"]),
    ("q4_0@prerope:rot-off:centred", "q4_0@prerope:rot-off:centred", "prerope+cb-q4_0",
     ["--prerope-k", "--cache-type-k", "q4_0", "--cache-type-v", "q4_0"]),
    ("q53_64/q4_0@prerope:stock-scales", "q53_64/q4_0@prerope:stock-scales", "prerope+cb-q53_64-q4_0",
     ["--prerope-k", "--cache-type-k", "q53_64", "--cache-type-v", "q4_0"]),
    ("q4_0:lsq-scales", "q4_0:lsq-scales", None, None),
])
def test_setting_syntax_round_trips(spec, label, variant, flags):
    s = parse_setting(spec)
    assert s.label == label and parse_setting(s.label) == s
    assert s.variant() == variant
    if flags is not None:
        assert s.converter_flags() == flags


def test_setting_model_kwargs_and_stock_flag():
    assert parse_setting("q4_0:rot-off").model_kwargs() == dict(
        cache_type_k="q4_0", cache_type_v="q4_0", attn_rot_k="off", attn_rot_v="off", kv_sinks=0, kv_window=0)
    assert parse_setting("auto@kvbits-2.75").model_kwargs()["cache_type_k"] is None
    assert parse_setting("q8_0/q4_0").stock and not parse_setting("nuq4").stock
    assert not parse_setting("q4_0@smooth+vrot").stock
    assert parse_setting("q4_0@prerope:centred").model_kwargs()["k_domain"] == "centred"
    assert "k_domain" not in parse_setting("q4_0@prerope").model_kwargs()
    assert parse_setting("q4_0@prerope:stock-scales").model_kwargs()["encoder"] == "stock"
    assert "encoder" not in parse_setting("q4_0@prerope").model_kwargs()
    assert not parse_setting("q4_0:lsq-scales").stock and parse_setting("q4_0:stock-scales").stock


@pytest.mark.parametrize("spec,msg", [
    ("q3_z", "unknown cache type 'q3_z'"),
    ("q4_0@magic", "unknown transform 'magic'"),
    ("auto", "'auto' types need a per-layer conversion"),
    ("q4_0@fisher", "Fisher codebooks need a nuq type"),
    ("f16:rot-on", "rotation applies to quantized caches only"),
    ("q4_0:centred", "':centred' needs a file with pre-RoPE statistics"),
    ("nuq4:lsq-scales", "applies to q4_0 / q5_0 caches only"),
])
def test_bad_settings_are_clear_errors(spec, msg):
    with pytest.raises(PykvqError, match=msg):
        parse_setting(spec)


def test_matrices_parse():
    full = matrix("full")
    assert len(full) == len({s.label for s in full}) >= 20
    assert matrix("q8_0,nuq4") == [Setting("q8_0", "q8_0"), Setting("nuq4", "nuq4")]


def test_headline_speed_comes_from_the_row_that_decodes_that_cache():
    bench = {"f16": {}, "q4_0": {}, "nuq4": {}, "q4_0@prerope": {}}
    assert report.bench_label("q4_0", bench) == "q4_0"
    assert report.bench_label("nuq4@fisher", bench) == "nuq4"          # codebooks: same read path
    assert report.bench_label("q4_0@prerope", bench) == "q4_0@prerope"
    assert report.bench_label("nuq4@prerope", bench) is None           # pre-RoPE decodes differently
    assert report.bench_label("q4_0@prerope:centred", bench) is None
    assert report.bench_label("auto@kvbits-3.6", bench) is None
    # every headline row exists in the matrices the suite runs
    assert set(report.HEADLINE) <= {s.label for s in matrix("full")}


def test_pareto_front():
    rows = [{"label": a, "bits_per_value": b, "mean_kld": k} for a, b, k in
            [("a", 4.5, 0.04), ("b", 4.5, 0.05), ("c", 3.6, 0.17), ("d", 8.5, 0.004), ("e", 4.25, 0.11),
             ("f", 3.5, 0.19), ("g", 2.6, 0.87)]]
    assert [r["label"] for r in report.pareto_front(rows)] == ["g", "f", "c", "e", "a", "d"]


def test_store_resumes_and_sets_aside_other_configs(tmp_path):
    p = tmp_path / "eval_x.json"
    s = ResultStore(p, {"n_ctx": 512})
    s.put("q4_0", {"mean_kld": 0.04})
    assert "q4_0" in ResultStore(p, {"n_ctx": 512})
    other = ResultStore(p, {"n_ctx": 256})            # a different configuration starts afresh
    assert "q4_0" not in other and (tmp_path / "eval_x.stale.json").is_file()


def test_passkey_answer_check():
    assert passkey.found(" 71432. Remember", 71432)
    assert not passkey.found(" 71437. The", 71432)
    assert not passkey.found(" a magical item 71432", 12345)
    assert not passkey.found(" no number", 71432)


def test_suite_help_explains_settings(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "K[/V][@TRANSFORM]" in out and "kvbits-B" in out


def test_eval_with_exact_weights(tmp_path):
    """--weights f32 evaluates the dequantized model (made once by the converter, cached) into its own file: a
    q8_0 cache's KLD there is its own error, not the quantized file's activation-rounding floor (~3e-3)."""
    assert main(["eval", "--weights", "f32", "-s", "q8_0", "--n-ctx", "256", "--chunks", "1",
                 "--out", str(tmp_path), "--docs", str(tmp_path / "docs")]) == 0
    res = _load(tmp_path / "eval_smollm2-135m-f32w.json")
    assert res["meta"]["config"]["model"].endswith(".f32w.gguf")
    assert res["rows"]["q8_0"]["mean_kld"] < 1e-3, res["rows"]["q8_0"]


@pytest.fixture(scope="module")
def quick(module_tmp):
    """`pykvq results --quick` into a temporary directory (runs once for the module)."""
    out = module_tmp("suite")
    assert main(["results", "--quick", "--out", str(out)]) == 0
    return out


def _load(path):
    return json.loads(path.read_text())


def test_quick_run_writes_results_report_and_plots(quick):
    for kind in ("eval", "bench", "passkey"):
        assert (quick / f"{kind}_smollm2-135m.json").is_file()
    docs = quick / "docs"
    md = (docs / "RESULTS.md").read_text()
    for needle in ("## Headline", "### Quality", "### Speed and memory", "### Passkey retrieval", "### Long context",
                   "pareto_smollm2-135m.png", "speed_smollm2-135m.png"):
        assert needle in md
    # the long-context part: the quick preset's 1024 tokens beside the 256-token matrix, as a ratio to q8_0
    long = _load(quick / "long" / "eval_smollm2-135m_ctx1024_c1.json")
    assert long["meta"]["config"]["n_ctx"] == 1024 and set(long["rows"]) == {"q8_0", "nuq4", "f16"}
    nuq4 = long["rows"]["nuq4"]["mean_kld"] / long["rows"]["q8_0"]["mean_kld"]
    assert f"| nuq4 | 4.500 | " in md and f"({nuq4:.1f}×) |" in md
    for png in ("pareto_smollm2-135m.png", "speed_smollm2-135m.png"):
        assert (docs / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_eval_matches_a_direct_kld_against_an_f16_model(quick, smollm2, wikitext):
    """The suite's row (scored against the saved base-logits file) agrees with Model.kl_divergence
    against a live f16 Model on the same chunks; the file's uint16 log-probs cost < 2% of the KLD."""
    rows = _load(quick / "eval_smollm2-135m.json")["rows"]
    n_ctx, chunks = 256, 2
    with Model(smollm2, n_ctx=n_ctx, flash_attn=True) as base, \
            Model(smollm2, n_ctx=n_ctx, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True) as m:
        r = m.kl_divergence(wikitext, baseline=base, n_ctx=n_ctx, n_chunks=chunks)
    row = rows["q4_0"]
    assert row["n_tokens"] == r.n_tokens == chunks * (n_ctx // 2 - 1)
    assert row["mean_kld"] == pytest.approx(r.mean_kld, rel=0.02)
    assert row["same_top1"] == pytest.approx(r.same_top1, abs=1.5 / r.n_tokens)
    assert row["bits_per_value"] == 4.5 and rows["q8_0"]["bits_per_value"] == 8.5
    assert rows["f16"]["mean_kld"] == 0 and rows["f16"]["ppl"] == pytest.approx(r.ppl_base, rel=1e-3)
    assert rows["q8_0"]["mean_kld"] < rows["q4_0"]["mean_kld"]


def test_quick_bench_and_passkey_rows(quick, smollm2):
    bench = _load(quick / "bench_smollm2-135m.json")
    assert set(bench["rows"]) == {"f16", "f16 (upstream kernel)", "q4_0", "nuq4", "q4_0@prerope"}
    for r in bench["rows"].values():
        assert set(r["tokens_per_s"]) == {"tg8 @ d0", "tg8 @ d256", "pp64 @ d0", "pp64 @ d256"}
        assert all(np.isfinite(v) and v > 0 for v in r["tokens_per_s"].values())
        assert r["peak_rss_bytes"] > 50 * 2**20          # the model alone is 94 MiB
    # 4.5 bits against f16's 16: the exact KV bytes per token (30 layers x 2 x 3 heads x 64)
    assert bench["rows"]["f16"]["kv_bytes_per_token"] == 30 * 2 * 192 * 2
    assert bench["rows"]["q4_0"]["kv_bytes_per_token"] == 30 * 2 * 6 * 18
    # a converted setting runs on its converted file: the pre-RoPE key cache, same bytes as q4_0
    pre = bench["rows"]["q4_0@prerope"]
    assert pre["kv_bytes_per_token"] == 30 * 2 * 6 * 18 and "keys cached pre-RoPE" in pre["active"]
    pk = _load(quick / "passkey_smollm2-135m.json")
    # hand-checked: SmolLM2 with an f16 cache finds the key at 256 and 512 tokens
    assert pk["rows"]["f16"]["success"] == {"256": 1.0, "512": 1.0}


def test_quick_run_resumes_without_measuring_again(quick, capsys):
    before = {p.name: p.read_text() for p in quick.glob("*.json")}
    assert main(["results", "--quick", "--out", str(quick)]) == 0
    assert {p.name: p.read_text() for p in quick.glob("*.json")} == before
    assert "3 of 3 settings already in" in capsys.readouterr().err


def test_converted_files_are_remade_when_the_converter_changes(tmp_path, monkeypatch, smollm2):
    """A cached conversion is reused only if its fingerprint (converter sources + flags + input)
    matches; a stale or unmarked one is made again. The converter here is a stand-in command that
    copies its input (this checks the cache logic, not a conversion)."""
    from pykvq.suite import converted as cv
    monkeypatch.setenv("PYKVQ_CACHE", str(tmp_path))
    calls = tmp_path / "calls"
    stand_in = ("import shutil, sys; a = sys.argv[1:]; shutil.copy(a[0], a[a.index('-o') + 1]); "
                f"open({str(calls)!r}, 'a').write('x')")
    monkeypatch.setattr(cv, "CONVERTER", [sys.executable, "-c", stand_in])
    fp = cv.converter_fingerprint(smollm2, ["--prerope-k"])
    assert fp and fp == cv.converter_fingerprint(smollm2, ["--prerope-k"]) != cv.converter_fingerprint(smollm2, [])
    out, meta = cv.converted(smollm2, "v", ["--prerope-k"])
    assert meta["fingerprint"] == fp and calls.read_text() == "x"
    cv.converted(smollm2, "v", ["--prerope-k"])                       # cached: not made again
    assert calls.read_text() == "x"
    m = out.with_suffix(".json")
    m.write_text(json.dumps({**json.loads(m.read_text()), "fingerprint": "0" * 16}))   # another converter's
    cv.converted(smollm2, "v", ["--prerope-k"])
    assert calls.read_text() == "xx" and json.loads(m.read_text())["fingerprint"] == fp


def test_report_puts_the_generated_tables_first(tmp_path):
    """RESULTS.md holds what `make results` regenerates, from its first section on, and links the sections
    measured by hand (RESULTS-BY-DATE.md), which a regeneration leaves alone."""
    from pykvq.suite.report import BY_DATE, write
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / BY_DATE).write_text("# by hand\n\n## CUDA on an H200\n\n| a |\n")
    (docs / "RESULTS.md").write_text("# old\n\n## A study measured by hand\n\n## Headline\n")
    md = write(tmp_path / "results", docs).read_text()
    assert md.split("\n## ")[1].startswith("Headline") and f"]({BY_DATE})" in md
    assert "A study measured by hand" not in md
    assert (docs / BY_DATE).read_text() == "# by hand\n\n## CUDA on an H200\n\n| a |\n"
