"""Converter (convert/to_gguf.py): bookkeeping units, invariance on the real model, runtime keys, errors.

Invariance is checked on f32 weights: the Q4_1 file's matmuls quantize their
activations to q8_1, so any reordering of a sum (a permuted head, a rotated V)
flips a few activation roundings and cascades into a q8_0-cache-sized change
(KLD ~4e-3, the same as f32 vs f16 cache on that file). With f32 weights the
converted model must match to float rounding. On the Q4_1 file itself the
exact transform (power-of-two smoothing) is checked bit for bit.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convert import hadamard, ksort, rows, smooth
from convert.calib import hf_to_norm
from convert.geometry import Geometry, head_rows, pair_channels, pair_perm_to_channels
from convert.gguf_io import ConvertError, read_gguf, write_gguf
from convert.rope_layout import neox_to_norm
from pykvq import Model
from pykvq.metrics import log_softmax
from pykvq.keys import Keys, Tensors, Values

REPO = Path(__file__).resolve().parent.parent
CONVERT = REPO / "convert" / "to_gguf.py"
# max |logit difference| allowed between a converted f32 model and the original (logits reach ~35;
# measured: K-sort 1.5e-4, all transforms 1.8e-3)
LOGIT_TOL = 5e-3
FAST_CALIB = ["--calib-seqs", "2", "--calib-len", "256"]


def geo(head_dim=8, n_rot=8, n_head=4, n_head_kv=2, layout="norm", rope_freqs=None):
    return Geometry("llama", 1, n_head, n_head_kv, head_dim, n_rot, 10000.0, layout, rope_freqs)


# ---- bookkeeping units --------------------------------------------------------------------------
def test_neox_to_norm_interleaves_the_two_halves():
    assert neox_to_norm(geo()).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # partial rotary: channels past n_rot stay where they are
    assert neox_to_norm(geo(head_dim=8, n_rot=4)).tolist() == [0, 2, 1, 3, 4, 5, 6, 7]


def test_hf_order_maps_like_llama_cpp_permute():
    # llama.cpp's converter interleaves HF rows j and j + d/2; calibration uses the same order
    assert hf_to_norm(geo()).tolist() == neox_to_norm(geo()).tolist()


def test_pair_channels_per_layout():
    g = geo(head_dim=8, n_rot=4)
    assert pair_channels(g, "norm").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pair_channels(g, "neox").tolist() == [[0, 2], [1, 3], [4, 5], [6, 7]]


def test_ksort_moves_pairs_and_keeps_their_frequency():
    g = geo(head_dim=8, n_rot=8, rope_freqs=np.array([1.0, 2.0, 4.0, 8.0], np.float32))
    key = np.array([[3.0, 1.0, 2.0, 0.5], [1.0, 2.0, 3.0, 4.0]])
    perm = ksort.pair_order(key, g)
    assert perm.tolist() == [[3, 1, 2, 0], [0, 1, 2, 3]]
    assert pair_perm_to_channels(perm[0], g).tolist() == [6, 7, 2, 3, 4, 5, 0, 1]
    ff = ksort.freq_factors(perm, g)
    # what ggml's rope computes at position p, with the factor: base^(-2p/n) / ff[p]
    p = np.arange(4)
    got = np.power(g.freq_base, -2.0 * p / g.n_rot)[None, :] / ff
    want = np.power(g.freq_base, -2.0 * perm / g.n_rot) / g.rope_freqs[perm]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(ff[1], g.rope_freqs, rtol=1e-7)          # identity: the model's own factors


def test_ksort_keeps_rotary_and_plain_pairs_apart():
    g = geo(head_dim=8, n_rot=4)
    perm = ksort.pair_order(np.array([[5.0, 1.0, 0.1, 9.0], [1.0, 2.0, 9.0, 0.1]]), g)
    assert perm.tolist() == [[1, 0, 2, 3], [0, 1, 3, 2]]
    assert ksort.freq_factors(perm, g).shape == (2, 2)


def test_head_rows_applies_a_channel_permutation_per_head():
    assert head_rows(np.array([1, 0]), 2, 2).tolist() == [1, 0, 3, 2]
    assert head_rows(np.array([[1, 0], [0, 1]]), 2, 2).tolist() == [1, 0, 2, 3]


def test_smoothing_and_ksort_leave_post_rope_scores_unchanged(smollm2):
    """Pair scales and pair moves commute with RoPE: q·k is the same, on real layer-0 weights."""
    m = read_gguf(smollm2)
    from convert.geometry import geometry
    g = geometry(m)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 576)).astype(np.float32)
    wq, wk = rows.to_f32(m.tensors["blk.0.attn_q.weight"]), rows.to_f32(m.tensors["blk.0.attn_k.weight"])
    q = (x @ wq.T).reshape(16, g.n_head, g.head_dim)
    k = (x @ wk.T).reshape(16, g.n_head_kv, g.head_dim)
    pos = np.arange(16)
    ref = np.einsum("thd,shd->hts", smooth.rope_norm(q, pos, g),
                    np.repeat(smooth.rope_norm(k, pos, g), g.group, axis=1))
    s = smooth.scales(smooth.pair_mag(k).max(0), smooth.pair_mag(q).reshape(16, 3, 3, -1).max(axis=(0, 2)), 0.6)
    perm = ksort.pair_order(-s, g)
    cp = np.stack([pair_perm_to_channels(perm[h], g) for h in range(g.n_head_kv)])
    fq, fk = np.repeat(np.repeat(s, 2, 1), g.group, 0), np.repeat(1 / s, 2, 1)
    q2 = np.take_along_axis(q * fq, np.repeat(cp, g.group, 0)[None], 2)
    k2 = np.take_along_axis(k * fk, cp[None], 2)
    ff = ksort.freq_factors(perm, g)
    g2 = [Geometry(**{**g.__dict__, "rope_freqs": ff[h], "freq_base": g.freq_base}) for h in range(3)]
    # rope with the per-head factors (the patched kernel's rule)
    def rope_ff(x, heads):
        return np.concatenate([smooth.rope_norm(x[:, [hq]], pos, g2[hk]) for hq, hk in heads], axis=1)
    q2r = rope_ff(q2, [(h, h // g.group) for h in range(g.n_head)])
    k2r = rope_ff(k2, [(h, h) for h in range(g.n_head_kv)])
    got = np.einsum("thd,shd->hts", q2r, np.repeat(k2r, g.group, axis=1))
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    assert np.all(np.frexp(s)[0] == 0.5)                                  # powers of two


def test_hadamard_v_rotation_is_invisible_to_attention(smollm2):
    m = read_gguf(smollm2)
    wv, wo = rows.to_f32(m.tensors["blk.3.attn_v.weight"]), rows.to_f32(m.tensors["blk.3.attn_output.weight"])
    h = hadamard.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-12)
    wv2, _, wo2 = hadamard.rotate_v(wv, None, wo, 9, 3, 64)
    x = np.random.default_rng(1).standard_normal((5, 576)).astype(np.float32)
    v, v2 = x @ wv.T, x @ wv2.T                                           # [5, 3*64]
    o = np.repeat(v.reshape(5, 3, 64), 3, axis=1).reshape(5, -1)          # each q head reads its kv head
    o2 = np.repeat(v2.reshape(5, 3, 64), 3, axis=1).reshape(5, -1)
    np.testing.assert_allclose(o2 @ wo2.T, o @ wo.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"])
def test_power_of_two_row_scaling_is_exact_on_stored_types(smollm2, qtype):
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    from convert.gguf_io import Tensor
    w = rows.to_f32(read_gguf(smollm2).tensors["blk.0.attn_k.weight"])[:64]
    qt = QT[qtype]
    data = {"F32": w, "F16": w.astype(np.float16)}.get(qtype)
    t = Tensor("w", qt, data if data is not None else quants.quantize(w, qt))
    f = np.exp2(np.arange(64) % 7 - 3).astype(np.float32)
    got = rows.to_f32(rows.scale_rows(t, f))
    np.testing.assert_array_equal(got, rows.to_f32(t) * f[:, None])
    perm = np.arange(64)[::-1]
    np.testing.assert_array_equal(rows.to_f32(rows.permute_rows(t, perm)), rows.to_f32(t)[perm])


def test_row_scale_must_be_a_power_of_two(smollm2):
    t = read_gguf(smollm2).tensors["blk.0.attn_k.weight"]
    with pytest.raises(ConvertError, match="powers of two"):
        rows.scale_rows(t, np.full(t.n_rows, 1.5, np.float32))


# ---- the real model -----------------------------------------------------------------------------
def run_convert(*args, check=True):
    res = subprocess.run([sys.executable, str(CONVERT), *map(str, args), "--no-progress"],
                         capture_output=True, text=True, timeout=900)
    if check and res.returncode != 0:
        pytest.fail(f"convert failed ({res.returncode}):\n{res.stdout}\n{res.stderr[-3000:]}")
    return res


@pytest.fixture(scope="session")
def eval_tokens(smollm2, passage):
    with Model(smollm2, n_ctx=512) as m:
        return m.tokenize(passage)[:256]


def f32_logits(path, tokens):
    with Model(path, n_ctx=512, cache_type_k="f32", cache_type_v="f32", flash_attn=False) as m:
        return m.eval_logits(tokens)


@pytest.fixture(scope="session")
def ref_logits(smollm2_f32, eval_tokens):
    return f32_logits(smollm2_f32, eval_tokens)


def assert_same_model(got, ref, tol=LOGIT_TOL):
    diff = np.abs(got - ref).max()
    assert diff < tol, f"max |logit diff| {diff:.2e} >= {tol}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


TRANSFORMS = {
    "ksort": ["--ksort", "--ksort-key", "weight"],
    "smooth": ["--smooth-qk", *FAST_CALIB],
    "rotate-v": ["--rotate-v", "hadamard"],
    "all": ["--ksort", "--smooth-qk", "--rotate-v", "hadamard", *FAST_CALIB],
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_gguf_input_invariance(name, smollm2_f32, smollm2_hf, ref_logits, eval_tokens, tmp_path):
    out = tmp_path / f"{name}.gguf"
    run_convert(smollm2_f32, "-o", out, "--outtype", "f32", "--hf-dir", smollm2_hf, *TRANSFORMS[name])
    assert_same_model(f32_logits(out, eval_tokens), ref_logits)


def test_hf_input_invariance(smollm2_hf, ref_logits, eval_tokens, tmp_path):
    """HF checkpoint -> the pinned upstream converter (f32) -> all transforms -> f32 weights."""
    out = tmp_path / "hf-all.gguf"
    res = run_convert(smollm2_hf, "-o", out, "--outtype", "f32", *TRANSFORMS["all"])
    assert "prepared for -ctk bfp4_32 -ctv bfp4_32" in res.stdout
    assert_same_model(f32_logits(out, eval_tokens), ref_logits)


def test_greedy_continuation_is_unchanged(smollm2_f32, smollm2_hf, tmp_path):
    out = tmp_path / "all.gguf"
    run_convert(smollm2_f32, "-o", out, "--outtype", "f32", "--hf-dir", smollm2_hf, *TRANSFORMS["all"])
    prompt = "The three largest cities of France are"
    outs = []
    for p in (smollm2_f32, out):
        with Model(p, n_ctx=256, cache_type_k="f32", cache_type_v="f32", flash_attn=False) as m:
            outs.append(m.generate(prompt, max_tokens=24, raw=True))
    assert outs[0] == outs[1] and len(outs[0]) > 20


def test_quantized_input_smoothing_is_bit_exact(smollm2, smollm2_hf, eval_tokens, tmp_path):
    out = tmp_path / "smooth.gguf"
    before = hashlib.sha256(smollm2.read_bytes()).hexdigest()
    run_convert(smollm2, "-o", out, "--hf-dir", smollm2_hf, *TRANSFORMS["smooth"])
    assert hashlib.sha256(smollm2.read_bytes()).hexdigest() == before          # input untouched
    np.testing.assert_array_equal(f32_logits(out, eval_tokens), f32_logits(smollm2, eval_tokens))


def mean_kld(ref, got) -> float:
    """Mean KL divergence of got's next-token distributions from ref's (logits [tokens, vocab])."""
    la, lb = log_softmax(ref.astype(np.float64)), log_softmax(got.astype(np.float64))
    return float((np.exp(la) * (la - lb)).sum(-1).mean())


def test_quantized_input_all_transforms_stay_within_activation_noise(smollm2, smollm2_converted, eval_tokens):
    ref, got = f32_logits(smollm2, eval_tokens), f32_logits(smollm2_converted, eval_tokens)
    kld = mean_kld(ref, got)
    assert kld < 0.01, kld                           # measured ~4e-3: the q8_1 activation rounding floor
    assert (ref.argmax(-1) == got.argmax(-1)).mean() > 0.9


def test_converted_file_keys_and_runtime_defaults(smollm2_converted):
    r = read_gguf(smollm2_converted)
    assert r.meta(Keys.Baked.KSORT) is True and r.meta(Keys.Baked.ROTATE_V) == Values.ROTATE_V_HADAMARD
    assert r.meta(Keys.Cache.TYPE_K) == "bfp4_32" and len(r.meta(Keys.Baked.SMOOTH_ALPHA)) == 30
    assert r.tensors[Tensors.ROPE_FREQS.format(bid=0)].data.shape == (3, 32)
    assert r.tensors["blk.0.attn_v.weight"].qtype.name == "Q8_0"
    assert r.tensors["blk.0.attn_k.weight"].qtype.name == "Q4_1"                  # moved rows, not requantized
    with Model(smollm2_converted, n_ctx=256) as m:                             # no types given: the file's
        assert (m.cache_type_k, m.cache_type_v) == ("bfp4_32", "bfp4_32")
        assert m.cache_type_source["K"] == f"GGUF {Keys.Cache.TYPE_K}"
        assert m.attn_rotation == {"K": False, "V": False}                     # baked: no online rotation
        assert "K-sort" in m.transforms() and "V/O hadamard" in m.transforms()
    with Model(smollm2_converted, n_ctx=256, cache_type_k="q8_0", cache_type_v="q4_0", flash_attn=True,
               attn_rot_k="on") as m:                                         # the caller wins
        assert (m.cache_type_k, m.cache_type_v) == ("q8_0", "q4_0") and m.attn_rotation["K"]


def test_tools_take_the_cache_type_from_the_file_and_say_so(smollm2_converted):
    from conftest import run_tool
    res = run_tool("llama-completion", "-m", smollm2_converted, "-p", "The capital of France is", "-n", "8",
                   "-fa", "on", "-no-cnv", "--temp", "0", "-c", "256", "-lv", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"cache type K = bfp4_32 (from the GGUF's {Keys.Cache.TYPE_K})" in res.stderr
    assert "online K rotation off: the GGUF's keys are K-sorted" in res.stderr
    res = run_tool("llama-completion", "-m", smollm2_converted, "-p", "Paris", "-n", "2", "-fa", "on",
                   "-no-cnv", "-c", "256", "-ctk", "q8_0", "-ctv", "q8_0", "-lv", "4")
    assert "cache type K = q8_0 (set by the caller)" in res.stderr


def shifted_logits(path, tokens):
    """Decode half a prompt, move it 64 positions on (K-shift re-ropes the cache in place), decode
    the rest there: logits of the last token."""
    with Model(path, n_ctx=512, cache_type_k="f32", cache_type_v="f32", flash_attn=False) as m:
        m.decode(tokens[:76], 0)
        m.seq_add(1, -1, 64)
        return m.decode(tokens[76:150], 140)


def test_kshift_uses_the_per_head_frequencies(smollm2_f32, eval_tokens, tmp_path):
    """K-shift of a K-sorted cache must rotate each pair at its own frequency: same logits as the
    original model shifted the same way (a wrong frequency would move them by whole logits)."""
    out = tmp_path / "ksort.gguf"
    run_convert(smollm2_f32, "-o", out, *TRANSFORMS["ksort"])
    assert_same_model(shifted_logits(out, eval_tokens), shifted_logits(smollm2_f32, eval_tokens))


def test_a_runtime_that_does_not_know_a_tensor_refuses_the_file(smollm2, tmp_path):
    """Stock llama.cpp does not know blk.N.kvq_rope_freqs and refuses a K-sorted file ("wrong number
    of tensors"). Shown with the patched loader and a tensor name it does not know either (an unknown
    blk.N.kvq_* tensor is named by pykvq's check: tests/test_hostile_files.py)."""
    m = read_gguf(smollm2)
    from convert.gguf_io import Tensor
    from gguf import GGMLQuantizationType as QT
    m.tensors["blk.0.attn_unknown"] = Tensor("blk.0.attn_unknown", QT.F32, np.ones((3, 32), np.float32))
    bad = tmp_path / "extra.gguf"
    write_gguf(m, bad)
    from pykvq import ModelLoadError
    with pytest.raises(ModelLoadError, match="wrong number of tensors"):
        Model(bad, n_ctx=256)


# ---- errors -------------------------------------------------------------------------------------
def test_output_must_not_be_the_input(smollm2):
    before = smollm2.stat().st_mtime_ns
    res = run_convert(smollm2, "-o", smollm2, "--ksort", check=False)
    assert res.returncode == 2 and "overwrite the input" in res.stderr
    assert smollm2.stat().st_mtime_ns == before


def test_unsupported_architecture_is_refused(smollm2, tmp_path):
    m = read_gguf(smollm2)
    from gguf import GGUFValueType as VT
    m.set("general.architecture", "gemma", VT.STRING)
    src = tmp_path / "gemma.gguf"
    write_gguf(m, src)
    out = tmp_path / "out.gguf"
    res = run_convert(src, "-o", out, "--ksort", check=False)
    assert res.returncode == 2 and "architecture 'gemma' is not supported" in res.stderr
    assert not out.exists()


def test_corrupt_and_missing_inputs(smollm2, tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(smollm2.read_bytes()[:5_000_000])
    out = tmp_path / "out.gguf"
    res = run_convert(bad, "-o", out, "--ksort", check=False)
    assert res.returncode == 2 and "not a readable GGUF" in res.stderr
    res = run_convert(tmp_path / "nope.gguf", "-o", out, check=False)
    assert res.returncode == 2 and "input not found" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))        # nothing half-written


def test_fast_reader_equals_gguf_py(smollm2, smollm2_prerope, tmp_path):
    """read_gguf's own header reader against gguf-py's GGUFReader on the model and a converted file: the same
    fields (values, value and element types, order) and tensors (names, types, shapes, bytes); on a file it does not
    read (a truncated one, big-endian) it gives way, so gguf-py words the error as before."""
    import gguf
    from convert import gguf_io
    for path in (smollm2, smollm2_prerope):
        fields, tensors = gguf_io._read_fast(Path(path))
        r = gguf.GGUFReader(path, "r")
        ref = {f.name: f for f in r.fields.values() if not f.name.startswith("GGUF.")}
        assert list(fields) == list(ref)
        for k, f in ref.items():
            vt = f.types[0]
            assert (fields[k].vtype, fields[k].sub_type) == (vt, f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
            assert type(fields[k].value) is type(f.contents()) and fields[k].value == f.contents(), k
        assert list(tensors) == [t.name for t in r.tensors]
        for t in r.tensors:
            got = tensors[t.name]
            assert got.qtype == t.tensor_type and got.data.shape == t.data.shape and got.data.dtype == t.data.dtype
            assert np.array_equal(got.data, t.data)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[:5_000_000])
    assert gguf_io._read_fast(cut) is None
    be = tmp_path / "be.gguf"
    b = bytearray(smollm2.read_bytes()[:4096])
    b[4:8] = (3).to_bytes(4, "big")
    be.write_bytes(bytes(b))
    assert gguf_io._read_fast(be) is None
    with pytest.raises(ConvertError, match="not a readable GGUF"):
        read_gguf(cut)


def test_bad_cache_type_and_already_converted(smollm2, smollm2_converted, tmp_path):
    out = tmp_path / "out.gguf"
    res = run_convert(smollm2, "-o", out, "--ksort", "--cache-type-k", "q3_x", check=False)
    assert res.returncode == 2 and "unknown KV-cache type 'q3_x'" in res.stderr
    res = run_convert(smollm2_converted, "-o", out, "--ksort", check=False)
    assert res.returncode == 2 and "already converted" in res.stderr
    res = run_convert(smollm2, "-o", out, "--prerope-k", "--kv-window", "-1", check=False)
    assert res.returncode == 2 and "--kv-sinks and --kv-window must be >= 0, got 4 and -1" in res.stderr
    assert not out.exists()


def test_help_explains_each_transform():
    res = subprocess.run([sys.executable, str(CONVERT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for flag in ("--ksort", "--smooth-qk", "--rotate-v", "--calib", "--outtype", "requantizes W_v and W_o"):
        assert flag in res.stdout


def test_converter_runs_as_installed_module_and_command(tmp_path):
    """The suite runs `python -m convert.to_gguf`; pip installs the `convert` package and pykvq-convert.
    Both work from a directory outside the checkout."""
    cmd = Path(sys.executable).parent / "pykvq-convert"
    for argv in ([sys.executable, "-m", "convert.to_gguf", "--help"], [str(cmd), "--help"]):
        res = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "--prerope-k" in res.stdout


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_0"])
def test_stock_round_trips_match_ggml_reference(smollm2, name):
    """pykvq.ref.stock (used to fake-quantize K and Q in calibration), bit for bit against gguf-py's port of
    ggml's quantize_row_<type>_ref, on real K-projection rows."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    from pykvq.ref import roundtrip
    w = rows.to_f32(read_gguf(smollm2).tensors["blk.0.attn_k.weight"])
    ref = quants.dequantize(quants.quantize(w, QT[name.upper()]), QT[name.upper()])
    np.testing.assert_array_equal(roundtrip(w, name), ref)


def _cache_kld(path, tokens, k, v):
    """KLD of a k/v cache against an f16 cache on the same file (flash attention, as llama-perplexity)."""
    out = {}
    for kt, vt in (("f16", "f16"), (k, v)):
        with Model(path, n_ctx=512, cache_type_k=kt, cache_type_v=vt, flash_attn=True) as m:
            out[kt, vt] = m.eval_logits(tokens)
    return mean_kld(out["f16", "f16"], out[k, v])


def test_dequantize_writes_the_same_values_in_f32_and_exposes_the_cache_error(smollm2, eval_tokens, tmp_path):
    """--dequantize: every tensor f32 with the values gguf-py decodes from the input, nothing else changed; a
    q8_0 cache's KLD against f16 on that file is the cache's own, far below the quantized file's, whose q8_1
    activations turn any last-bit change into ~4e-3 (measured on these 256 tokens: Q4_1 3.9e-3, f32 1.4e-4)."""
    out = tmp_path / "f32w.gguf"
    res = run_convert(smollm2, "-o", out, "--dequantize")
    assert "dequantized" in res.stderr and "--dequantize" in res.stderr
    src, got = read_gguf(smollm2), read_gguf(out)
    assert list(got.tensors) == list(src.tensors)
    from gguf import quants
    for name, t in src.tensors.items():
        g = got.tensors[name]
        assert g.qtype.name == "F32", name
        want = t.data if t.qtype.name == "F32" else quants.dequantize(np.asarray(t.data), t.qtype)
        assert np.array_equal(g.data, np.asarray(want, np.float32).reshape(g.data.shape)), name
    quantized, exact = _cache_kld(smollm2, eval_tokens, "q8_0", "q8_0"), _cache_kld(out, eval_tokens, "q8_0", "q8_0")
    assert exact < 0.2 * quantized, (exact, quantized)
    print(f"q8_0 cache KLD: quantized file {quantized:.2e}, dequantized {exact:.2e}")
    # an HF checkpoint has its own way (--outtype f32)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    res = run_convert(hf, "-o", tmp_path / "x.gguf", "--dequantize", check=False)
    assert res.returncode == 2 and "--dequantize takes a GGUF input" in res.stderr, res.stderr


def test_dequantize_keeps_integer_tensors(smollm2):
    """The runtime reads a nuq codebook as I8: --dequantize leaves integer tensors as they are, and decodes every
    block type, IQ* included (their names start with an I too)."""
    from convert.gguf_io import Tensor
    from convert.to_gguf import _dequantize_weights, _weights_all_f32
    from gguf import GGMLQuantizationType as QT, quants
    m = read_gguf(smollm2)
    cb = np.arange(-8, 8, dtype=np.int8) * 15
    m.tensors["blk.0.kvq_codebook_v"] = Tensor("blk.0.kvq_codebook_v", QT.I8, cb)
    iq = np.zeros((2, 18), np.uint8)                          # two IQ4_NL blocks of 32: f16 scale, 16 nibble bytes
    iq[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    iq[:, 2:] = np.arange(16, dtype=np.uint8) * 17
    m.tensors["blk.0.iq_test.weight"] = Tensor("blk.0.iq_test.weight", QT.IQ4_NL, iq)
    assert not _weights_all_f32(m)
    assert _dequantize_weights(m) > 0
    assert m.tensors["blk.0.kvq_codebook_v"].qtype == QT.I8 and np.array_equal(m.tensors["blk.0.kvq_codebook_v"].data, cb)
    got = m.tensors["blk.0.iq_test.weight"]
    assert got.qtype == QT.F32 and np.array_equal(got.data, quants.dequantize(iq, QT.IQ4_NL))
    assert _weights_all_f32(m)
