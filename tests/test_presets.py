"""The converter's presets (issue 58): no flag that chooses the preparation writes the recommended 4.5-bit file,
--bits 3.5 one type pair with the window that fits at --ctx cells (up to ~8k), any other --bits B a budget file with its window
counted at --ctx cells; choosing flags and --bits together are refused (--dequantize composes with --bits),
and --help shows the presets before the study transforms."""
from __future__ import annotations

import pytest

from convert import to_gguf
from convert.gguf_io import ConvertError


def _resolve(*argv):
    parser = to_gguf.build_parser()
    args = parser.parse_args(["in.gguf", "-o", "out.gguf", *argv])
    return to_gguf.apply_preset(args, parser), args


def test_no_flag_is_the_recommended_45_bit_file():
    flags, a = _resolve()
    assert flags == "--prerope-k --cache-type-k q53_64 --cache-type-v q4_0"
    assert (a.prerope_k, a.cache_type_k, a.cache_type_v, a.kv_bits) == (True, "q53_64", "q4_0", None)
    # options that do not choose the preparation keep the preset
    flags, a = _resolve("--calib-seqs", "2", "--kv-window", "128", "--no-progress")
    assert flags and a.cache_type_k == "q53_64" and a.kv_window == 128
    assert _resolve("--bits", "4.5")[0] == flags


def test_bits_below_is_a_budget_counted_at_ctx():
    flags, a = _resolve("--bits", "3")
    assert flags == "--prerope-k --kv-bits 3 --kv-bits-ctx 4096"
    assert (a.prerope_k, a.kv_bits, a.kv_bits_ctx, a.cache_type_k) == (True, 3.0, 4096, None)
    _, a = _resolve("--bits", "3", "--ctx", "16384")
    assert (a.kv_bits, a.kv_bits_ctx) == (3.0, 16384)


def test_bits_35_is_one_pair_with_the_window_that_fits():
    """q42_64 / nuq3_64 (3.375 bits) for every layer; the window's q8_0 rows, 8.5 (sinks + window + 1) / ctx bits,
    take the rest: 60 rows at 4096 cells, so 4 sinks + 55; 120 at 8192 (f16 rows, 16 (sinks + window + 1) / ctx:
    4 + 27 and 4 + 59)."""
    flags, a = _resolve("--bits", "3.5")
    assert flags == "--prerope-k --cache-type-k q42_64 --cache-type-v nuq3_64 --kv-window 55"
    assert (a.prerope_k, a.cache_type_k, a.cache_type_v, a.kv_window, a.kv_bits) == (True, "q42_64", "nuq3_64", 55, None)
    assert a.kv_window_type == "q8_0"
    assert _resolve("--bits", "3.5", "--ctx", "8192")[1].kv_window == 115
    _, a = _resolve("--bits", "3.5", "--kv-window-type", "f16")
    assert (a.kv_window, a.kv_window_type) == (27, "f16")
    assert _resolve("--bits", "3.5", "--ctx", "8192", "--kv-window-type", "f16")[1].kv_window == 59
    # q8_0 rows up to 16384 cells (4 + 235; 4 + 236 measured: the pair won there), f16 rows up to 8192 (the budget won at 16384)
    assert _resolve("--bits", "3.5", "--ctx", "16384")[1].kv_window == 235
    # past those, where no window fits (a short --ctx), or with the user's window: the budget counts the window instead
    for argv in (("--ctx", "32768"), ("--ctx", "256"), ("--kv-window", "16"), ("--kv-window", "auto"),
                 ("--ctx", "16384", "--kv-window-type", "f16")):
        flags, a = _resolve("--bits", "3.5", *argv)
        assert flags.startswith("--prerope-k --kv-bits 3.5") and a.cache_type_k is None, argv


def test_chosen_flags_are_left_alone_and_do_not_mix_with_bits():
    for argv in (["--prerope-k"], ["--cache-type-k", "nuq4"], ["--kv-bits", "3.6"], ["--ksort"], ["--dequantize"]):
        flags, a = _resolve(*argv)
        assert flags is None and a.cache_type_v is None
    with pytest.raises(ConvertError, match="--bits sets .* drop --cache-type-k"):
        _resolve("--bits", "3.5", "--cache-type-k", "q4_0")
    with pytest.raises(ConvertError, match="--ctx must be > 0"):
        _resolve("--bits", "3.5", "--ctx", "0")


def test_bits_with_dequantize_is_the_presets_file_with_f32_weights():
    """--dequantize alone writes the input's weights in f32 and nothing else; beside --bits it keeps the preset (the
    file whose cache error is measured without the quantized matmuls' floor, as users run its twin)."""
    flags, a = _resolve("--bits", "3", "--dequantize")
    assert flags == "--prerope-k --kv-bits 3 --kv-bits-ctx 4096" and a.dequantize and a.kv_bits == 3.0
    with pytest.raises(ConvertError, match="drop --cache-type-v or --bits"):
        _resolve("--bits", "3", "--dequantize", "--cache-type-v", "q4_0")


def test_help_shows_presets_first():
    text = to_gguf.build_parser().format_help()
    pre, cache, study = (text.index(h) for h in ("presets", "the cache the file prepares for", "study transforms"))
    assert pre < cache < study
    assert text.index("--ksort ") > study and text.index("--bits B") < cache


def test_cpu_types_take_the_trellis_types(smollm2, tmp_path):
    """--cpu-types: below 3 bits/value in the cache the default V candidates take tcq2_64 / tcq3_64 in place of
    nuq2_64 / nuq3_64 (the ladder measured on 2026-12-01: `--bits 3 --cpu-types` on SmolLM2 wrote the same bytes as the
    explicit ladder) and tcq25_64 between them, the pre-RoPE K candidates q4t2_64 / t32_64 in place of q42_64 / q32_64 at any budget, and the
    3.5-bit preset's pair is q4t2_64 / tcq3_64; it is refused where it would change nothing."""
    from convert import layer_types
    assert layer_types.value_ladder(2.8, cpu_types=True) == ("tcq2_64", "tcq25_64", "nuq2o", "tcq3_64", "nuq3", "nuq3o",
                                                             "nuq4", "q8_0")
    assert layer_types.value_ladder(2.8) == ("nuq2_64",) + layer_types.VALUE_LADDER
    assert layer_types.value_ladder(3.2, cpu_types=True) == layer_types.VALUE_LADDER
    assert layer_types.prerope_k_ladder(2.8, cpu_types=True) == ("nuq2o", "t32_64", "nuq3", "q4t2_64", "nuq3o", "nuq4",
                                                                 "q53_64", "q8_0")
    assert layer_types.prerope_k_ladder(3.2, cpu_types=True) == ("nuq2o", "nuq3", "q4t2_64", "nuq3o", "nuq4", "q53_64",
                                                                 "q8_0")
    parser = to_gguf.build_parser()
    args = parser.parse_args([str(smollm2), "-o", str(tmp_path / "out.gguf"), "--cpu-types", "--bits", "3.5"])
    assert "--cache-type-k q4t2_64 --cache-type-v tcq3_64 --kv-window 115" in to_gguf.apply_preset(args, parser)
    assert args.cpu_types_pair      # the window that fits beside their 3.25 bits (the scale codes), where q42 / nuq3 get 55
    for argv in ([], ["--prerope-k", "--kv-bits", "3", "--layer-types", "nuq2o,nuq4"]):
        args = parser.parse_args([str(smollm2), "-o", str(tmp_path / "out.gguf"), "--cpu-types", *argv])
        to_gguf.apply_preset(args, parser)
        with pytest.raises(ConvertError, match="--cpu-types changes the default types"):
            to_gguf.convert(args)
    assert not (tmp_path / "out.gguf").exists()


def test_values_are_priced_in_the_domain_the_runtime_turns_them_in():
    """The converter prices V in the domain the runtime turns it in: a 128-wide Hadamard once a 128-block V type is a
    candidate (llama_kvq_v_rot_size), else 64-wide."""
    import numpy as np
    from convert import cache_domain
    from convert.hadamard import hadamard
    e = np.random.default_rng(0).standard_normal((5, 2, 128)).astype(np.float32)
    for n in (64, 128):
        d = cache_domain.Domain(rot_v=True, rot_v_size=n)
        h = hadamard(n).astype(np.float32)
        want = (e.reshape(5, 2, -1, n) @ h).reshape(e.shape)
        np.testing.assert_allclose(cache_domain.value_error_to_model(e, None, d), want, rtol=1e-5, atol=1e-6)


def test_heavy_hitters_only_when_asked_and_priced_like_the_window():
    """No preset keeps heavy hitters (they lost on Qwen2.5-Coder-1.5B at 3 bits); --kv-heavy F writes them, paid from
    a budget as the window is: ceil(0.01 * 4096) = 41 more q8_0 rows (auto: none until judged); --kv-heavy needs a
    window."""
    from convert.pipeline import Options
    for argv, want in ((["--bits", "3"], 0.0), (["--bits", "2.5"], 0.0), (["--bits", "3.5"], 0.0),
                       (["--bits", "4"], 0.0), ([], 0.0), (["--bits", "3", "--kv-heavy", "0.01"], 0.01),
                       (["--bits", "4.5", "--kv-heavy", "0.03"], 0.03), (["--bits", "3", "--kv-heavy", "auto"], 0.0)):
        _, a = _resolve(*argv)
        assert to_gguf._heavy(a, a.kv_window) == want, argv
    assert Options(prerope_k=True, kv_bits=3.0, kv_bits_ctx=4096, kv_heavy=0.01).cache_bits() == \
        pytest.approx(3.0 - 8.5 * (69 + 41) / 4096)
    _, a = _resolve("--prerope-k", "--kv-window", "0", "--kv-sinks", "0", "--kv-heavy", "0.01")
    with pytest.raises(ConvertError, match="--kv-heavy keeps heavy hitters beside the exact window"):
        to_gguf._heavy(a, a.kv_window)
    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit):
            _resolve("--kv-heavy", bad)
