"""The pykvq command line on the real default model."""
from __future__ import annotations

import json
import re

from pykvq.cli import main


def test_generate_prints_answer_and_cache_info(capsys):
    assert main(["generate", "What is the capital of France?", "-n", "24", "-ctk", "q8_0", "-ctv", "q8_0"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "K=q8_0 V=q8_0" in err and "online Hadamard rotation: K+V" in err


def test_info_without_model(capsys):
    assert main(["info", "--no-model"]) == 0
    assert "KVQ : version = " in capsys.readouterr().out


def test_perplexity_json(tmp_path, passage, capsys):
    f = tmp_path / "p.txt"
    f.write_text(passage)
    assert main(["perplexity", "-f", str(f), "--chunks", "1", "--json", "-c", "512"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["n_chunks"] == 1 and r["ppl"] > 1


def test_unknown_cache_type_is_a_clear_cli_error(capsys):
    assert main(["generate", "hi", "-ctk", "q3_z"]) == 2
    assert "unknown KV-cache type 'q3_z'" in capsys.readouterr().err


def test_kld_diagnoses_a_broken_cache_and_prints_the_fix(tmp_path, passage, capsys):
    """2-bit post-RoPE keys and values on the real model: the KLD says the setting breaks it, and the command that
    prepares the file (pykvq-convert, pre-RoPE keys) is printed."""
    f = tmp_path / "p.txt"
    f.write_text(passage)
    assert main(["kld", "-f", str(f), "--chunks", "1", "-c", "512", "-ctk", "nuq2", "-ctv", "nuq2"]) == 0
    out = capsys.readouterr().out
    assert "diagnosis: KLD" in out and "keys after RoPE" in out
    assert "pykvq-convert " in out and "-kvq.gguf" in out


def test_info_checks_the_keys(capsys):
    """SmolLM2's pre-RoPE key channels measured on 256 tokens: largest |mean|/std ~16 (the converter's log: 15.9),
    far below the hundreds that break post-RoPE 4-bit keys (Qwen2.5-Coder-1.5B: 479)."""
    assert main(["info", "--check-keys"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"keys: largest channel \|mean\|/std ([\d.]+): 4-bit keys work post-RoPE", out)
    assert m and 5.0 < float(m.group(1)) < 50.0, out


def test_info_of_a_converted_file_gives_its_outlook(smollm2_prerope, capsys):
    """A pre-RoPE file: its cache's bits, the window counted at 4k and 32k (by hand: + 16 x (4 + 64 + 1) / 4096 =
    0.27 and / 32768 = 0.034), and the KLD class those bits gave on the suite's models."""
    assert main(["info", str(smollm2_prerope)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"outlook: ([\d.]+) bits/value in the cache, exact window: first 4 \+ last 64 cells \(f16\): "
                  r"([\d.]+) bits/value at 4k tokens, ([\d.]+) at 32k; expected mean KLD against f16 at 4k: ", out)
    assert m, out
    bits, at4k, at32k = map(float, m.groups())
    assert abs(at4k - bits - 0.27) < 0.006 and abs(at32k - bits - 0.034) < 0.006


def test_kld_of_a_converted_file_run_with_other_types(smollm2_prerope, tmp_path, passage, capsys):
    """2-bit caches forced onto a file converted for other types: the diagnosis names the file's types and the
    command that runs them."""
    f = tmp_path / "p.txt"
    f.write_text(passage)
    assert main(["kld", "-m", str(smollm2_prerope), "-f", str(f), "--chunks", "1", "-c", "512",
                 "-ctk", "nuq2", "-ctv", "nuq2"]) == 0
    out = capsys.readouterr().out
    assert "diagnosis: KLD" in out and "this file was converted for -ctk " in out, out
    assert f"pykvq kld -m {smollm2_prerope}    # the file's own types" in out
