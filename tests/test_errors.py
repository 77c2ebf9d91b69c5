"""Bad input gives a clear error and loses nothing."""
from __future__ import annotations

import pytest

from pykvq import (CacheTypeError, ContextOverflowError, Model, ModelLoadError)
from pykvq.cli import main as cli_main


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(p)
    assert p.read_text() == "hello, I am not a model\n"


def test_truncated_gguf(tmp_path, smollm2):
    p = tmp_path / "cut.gguf"
    p.write_bytes(smollm2.read_bytes()[: 1 << 20])
    with pytest.raises(ModelLoadError, match="could not load"):
        Model(p)


def test_unknown_cache_type(smollm2):
    with pytest.raises(CacheTypeError, match="unknown KV-cache type 'q3_z'.*q8_0"):
        Model(smollm2, cache_type_k="q3_z")


def test_quantized_v_without_flash_attention(smollm2):
    with pytest.raises(CacheTypeError, match="flash attention"):
        Model(smollm2, cache_type_v="q4_0", flash_attn=False)


def test_runtime_cache_type_checks_keep_upstreams_messages(smollm2):
    """llama_init_from_model's cache-type checks (now llama_kvq_check_cache_types, per layer) refuse a quantized V
    without flash attention with upstream's message, and a tool run with it on goes through."""
    from conftest import run_tool
    base = ("-m", smollm2, "-ctk", "q4_0", "-ctv", "nuq4", "-p", "hi", "-n", "1", "-no-cnv", "-t", "2")
    off = run_tool("llama-completion", *base, "-fa", "off", timeout=120)
    assert off.returncode != 0
    assert "llama_init_from_model: quantized V cache requires flash_attn to be enabled" in off.stderr
    on = run_tool("llama-completion", *base, "-fa", "on", timeout=120)
    assert on.returncode == 0, on.stderr[-2000:]


def test_prompt_longer_than_context(smollm2):
    # llama.cpp rounds n_ctx up to a multiple of 256
    with Model(smollm2, n_ctx=256) as m:
        assert m.n_ctx == 256
        with pytest.raises(ContextOverflowError, match="context holds 256"):
            m.generate("word " * 400)


def test_eval_context_larger_than_model(f16_model, passage):
    with pytest.raises(ContextOverflowError, match="exceeds the model's context"):
        f16_model.perplexity(passage, n_ctx=4096)


def test_text_shorter_than_one_chunk(f16_model):
    with pytest.raises(ContextOverflowError, match="at least 512"):
        f16_model.perplexity("Too short.", n_ctx=512)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    rc = cli_main(["generate", "hi", "-m", str(tmp_path / "missing.gguf")])
    assert rc == 2
    assert "pykvq: error: model file not found" in capsys.readouterr().err
