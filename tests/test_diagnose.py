"""pykvq.diagnose: which cause and which command a measured KLD against f16 leads to."""
from __future__ import annotations

from pykvq.diagnose import BROKEN, FAR, Run, advice


def _run(k="q4_0", v="q4_0", domain="post-RoPE", prepared=False, kld=5.66):
    return Run("qwen.gguf", k, v, domain, prepared, kld)


def test_fine_runs_get_no_advice():
    assert advice(_run(kld=0.0046)) is None and advice(_run(kld=FAR * 0.99)) is None


def test_post_rope_keys_of_an_unprepared_file_get_the_converter():
    tip = advice(_run())                       # Qwen2.5-Coder-1.5B, stock q4_0 (README: KLD 5.66)
    assert "breaks the model" in tip and "keys after RoPE" in tip
    assert "pykvq-convert qwen.gguf -o qwen-kvq.gguf" in tip and "pykvq kld -m qwen-kvq.gguf" in tip
    assert "breaks" not in advice(_run(kld=BROKEN * 0.5))     # far behind q8_0, not broken
    assert "x a stock q8_0" in advice(_run(kld=BROKEN * 0.5))


def test_a_prepared_file_read_post_rope_is_told_its_domain():
    tip = advice(_run(prepared=True, domain="post-RoPE"))
    assert "prepared for pre-RoPE keys" in tip and "--kv-domain pre" in tip and "pykvq-convert" not in tip


def test_other_causes():
    assert "the values" in advice(_run(k="f16", v="nuq2"))
    assert "--bits B" in advice(_run(k="q42_64", v="nuq2o", domain="pre-RoPE", prepared=True, kld=0.2))


def test_key_outliers_and_what_info_says():
    import numpy as np
    from types import SimpleNamespace

    from pykvq.diagnose import KEY_OUTLIER, file_advice, key_outliers
    mean = np.zeros((2, 4))
    mean[1, 3] = 300.0                                     # one channel: mean 300, std 1 (a Qwen2.5-like key bias)
    sq = mean**2 + 1.0
    stats = SimpleNamespace(layers=[SimpleNamespace(mean={"k": mean}, sq={"k": sq})])
    assert abs(key_outliers(stats) - 300.0) < 1e-9
    tip = file_advice("m.gguf", False, 300.0)
    assert "will likely break" in tip and "pykvq-convert m.gguf -o m-kvq.gguf" in tip
    assert "work post-RoPE" in file_advice("m.gguf", False, KEY_OUTLIER / 10)
    assert "--check-keys" in file_advice("m.gguf", False, None)
    assert "pre-RoPE key cache" in file_advice("m.gguf", True, None)


def test_a_converted_file_run_with_other_types_is_told_its_own():
    tip = advice(Run("smol-kvq.gguf", "nuq3", "nuq3", "pre-RoPE", True, 0.3, file_types=("q53_64", "q4_0"),
                     fallback_codebooks=60))
    assert "converted for -ctk q53_64 -ctv q4_0" in tip and "60 nuq caches fell back" in tip
    assert "pykvq kld -m smol-kvq.gguf    # the file's own types" in tip
    assert "--cache-type-k nuq3 --cache-type-v nuq3" in tip
    # the file's own types: the usual advice
    same = advice(Run("smol-kvq.gguf", "q53_64", "q4_0", "pre-RoPE", True, 0.3, file_types=("q53_64", "q4_0")))
    assert "converted for" not in same and "--bits B" in same


def test_outlook_counts_the_window_and_names_the_quality_class():
    from pykvq.diagnose import outlook
    # the 4.5-bit preset: 4.5 + 16 * (4 + 64 + 1) / 4096 = 4.7695 at 4k, + 16 * 69 / 32768 = 4.5337 at 32k (by hand)
    text = outlook(4.5, 4, 64)
    assert "4.77 bits/value at 4k" in text and "4.53 at 32k" in text and "about stock q8_0's" in text
    assert "first 4 + last 64 cells" in text
    # --bits 3.5: the types take 3.5 - 0.27 so that the file spends 3.5 at 4k
    assert "3.50 bits/value at 4k" in outlook(3.5 - 16 * 69 / 4096, 4, 64) and "2-4x" in outlook(3.23, 4, 64)
    assert "3-8x" in outlook(3.0, 0, 0) and "no exact window" in outlook(3.0, 0, 0)
    # --bits 2.5: 2.357 + 8.5 * 69 / 4096 = 2.50 at 4k (SmolLM2 18.7x, Qwen 8.3x)
    assert "8-19x" in outlook(2.5 - 8.5 * 69 / 4096, 4, 64, "q8_0") and "8-19x" in outlook(2.625, 4, 64)
    assert "not measured below 2.5 bits" in outlook(2.2, 0, 0)
    # --bits 3 --kv-heavy 0.01: 3.0 at 4k = types + 8.5 * (69 + 41) / 4096; at 32k 69 + 328 rows
    text = outlook(3.0 - 8.5 * 110 / 4096, 4, 64, "q8_0", 0.01)
    assert "+ 0.01 of the cells as heavy hitters" in text and "3.00 bits/value at 4k" in text
    assert f"{3.0 - 8.5 * 110 / 4096 + 8.5 * 397 / 32768:.2f} at 32k" in text
