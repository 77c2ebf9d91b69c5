"""The exact window of a pre-RoPE key cache (kv_window / kv_sinks, native/llama/llama-kvq-window.cpp): cells read
from their unquantized rows while the window holds them, checked against an f16 cache bit for bit, across state
restores, and for what it buys in quality."""
from __future__ import annotations

import numpy as np
import pytest

from pykvq import Model
from pykvq import log as kvq_log
from pykvq.errors import DecodeError, SettingError

from conftest import run_tool
from ggml_graph import Graph
from pykvq.ref import prerope
from test_fattn import attention_ref, cache_like, fa_node, quantize, rel_err
from test_prerope import _kld, rope_inputs


def run_window_fa(kt, vt, *, N, rot, mode=prerope.NEOX, D=64, n_kv=300, H=6, Hkv=2, S=2, seed=0, per_query=False):
    """A pre-RoPE FLASH_ATTN_EXT node whose cells partly read window rows: per stream a random third of the cells
    maps to rows of one shared f16 tensor (in any order), the rest reads the quantized cache. The reference decodes
    those cells from the f16-rounded rows, the others from the dequantized cache. per_query: planes 2 and 3 give each
    row's last reading query position and the queries' positions (a window of 40 positions behind each query, some
    rows read by every query as sinks are); the reference then attends per query."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((S, H, N, D)).astype(np.float32)
    mean = (rng.standard_normal((Hkv, D)) * 20).astype(np.float32)
    scale = np.exp(rng.standard_normal((Hkv, D)) * 0.5).astype(np.float32)
    C, Vx = cache_like(rng, S, Hkv, n_kv, D), cache_like(rng, S, Hkv, n_kv, D)   # [S, Hkv, n_kv, D]
    kb, Cd = quantize(kt, C, None)
    vb, Vd = quantize(vt, Vx, None)
    pos, w, mask = rope_inputs(rng, n_kv, S, N, Hkv, D, False, None)
    n_rows = S * n_kv // 3 + 5
    row = np.full((S, n_kv), -1, np.int32)
    rows = np.zeros((n_rows, 2 * Hkv * D), np.float16)
    picks = rng.permutation(n_rows)
    Ce, Ve = Cd.copy(), Vd.copy()        # every cell as a query reading its row sees it
    k = 0
    for s in range(S):
        for j in rng.choice(n_kv, n_kv // 3, replace=False):
            row[s, j] = picks[k]
            rows[picks[k], :Hkv * D] = C[s, :, j].reshape(-1)
            rows[picks[k], Hkv * D:] = Vx[s, :, j].reshape(-1)
            Ce[s, :, j] = C[s, :, j].astype(np.float16)
            Ve[s, :, j] = Vx[s, :, j].astype(np.float16)
            k += 1
    planes = [pos, row]
    if per_query:
        # the queries sit among the cells' positions; a row is read up to 40 positions after its cell, a few always
        qpos = np.zeros((S, n_kv), np.int32)
        qpos[:, :N] = np.sort(rng.choice(np.arange(pos.min(), pos.max() + 1), (S, N)), axis=1)
        last = np.where(rng.random((S, n_kv)) < 0.1, np.iinfo(np.int32).max, pos + 39).astype(np.int32)
        planes += [last, qpos]
        reads = (row[:, None, :] >= 0) & (qpos[:, :N, None] <= last[:, None, :])   # [S, N, n_kv]
    else:
        Cd, Vd = Ce, Ve
    g = Graph(256 << 20)
    try:
        fa = fa_node(g, Q, kt, kb, vt, vb, Hkv, mask, 1.0 / np.sqrt(D))
        g.L.ggml_kvq_fa_set_prerope(fa, g.tensor("i32", n_kv, S, len(planes), data=np.stack(planes)),
                                    g.tensor("f32", D, Hkv, data=mean), g.tensor("f32", D, Hkv, data=scale),
                                    g.tensor("f32", D // 2, Hkv, data=w), D, mode, 1.0, rot)
        g.L.ggml_kvq_fa_set_window(fa, g.tensor("f16", 2 * Hkv * D, n_rows, data=rows))
        g.compute(fa, n_threads=2)
        out = g.f32(fa).reshape(S, N, H, D)
    finally:
        g.close()
    def post(Cs):
        return np.stack([prerope.decode(Cs[s].transpose(1, 0, 2), mean, scale, pos[s], w.astype(np.float64), mode,
                                        D, 1.0, rot, 0).transpose(1, 0, 2) for s in range(S)])
    if not per_query:
        return out, attention_ref(Q.transpose(0, 2, 1, 3), post(Cd), Vd, mask, 1.0 / np.sqrt(D))
    Kq, Ke = post(Cd), post(Ce)
    ref = np.zeros((S, N, H, D))
    for s in range(S):
        for i in range(N):
            sel = reads[s, i][None, :, None]
            K1 = np.where(sel, Ke[s], Kq[s])[None]
            V1 = np.where(sel, Ve[s], Vd[s])[None]
            ref[s, i] = attention_ref(Q[s:s + 1, :, i:i + 1].transpose(0, 2, 1, 3), K1, V1, mask[s:s + 1, i:i + 1],
                                      1.0 / np.sqrt(D))[0, 0]
    return out, ref


@pytest.mark.parametrize("kt,vt", [("q4_0", "q4_0"), ("nuq4", "q8_0")])
@pytest.mark.parametrize("N,rot", [(1, 64), (3, 0), (40, 64)])
def test_kernel_reads_window_rows(kt, vt, N, rot):
    """The CPU kernel against the numpy reference, two streams, window rows shared and out of order: decode (one and
    three queries) and the gemm path (40). A cell read from the quantized cache instead of its row, or the wrong row,
    moves the output far beyond the bound (q4_0's error is ~1e-1 of the values)."""
    out, ref = run_window_fa(kt, vt, N=N, rot=rot)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("kt,vt", [("q4_0", "q4_0"), ("nuq4", "q8_0")])
@pytest.mark.parametrize("N,rot", [(1, 64), (5, 0), (40, 64)])
def test_kernel_reads_window_rows_per_query(kt, vt, N, rot):
    """Planes 2 and 3 (a prefill batch): each query reads a row only up to the row's last reader, the quantized cell
    after it, in the same tile; against the numpy reference attending query by query. Reading every row for every
    query (the two-plane rule) misses the bound by orders of magnitude."""
    out, ref = run_window_fa(kt, vt, N=N, rot=rot, per_query=True)
    assert rel_err(out, ref) < 1e-4


@pytest.fixture(scope="module")
def smol_pre(smollm2_prerope):
    return smollm2_prerope


def _logits(path, toks, kt, vt, **kw):
    # rotation on in both runs: a window row holds K exactly as the quantized cache's input (turned by the online
    # Hadamard), so an f16 cache compares bit for bit only when it is turned the same way
    with Model(path, n_ctx=512, cache_type_k=kt, cache_type_v=vt, flash_attn=True, attn_rot_k="on", attn_rot_v="on",
               **kw) as m:
        return m.eval_logits(toks)


@pytest.mark.parametrize("n_ubatch", [512, 16])
def test_window_over_every_cell_is_an_f16_cache(smol_pre, passage, n_ubatch):
    """A window as long as the text keeps every cell's row: q4_0 K and V then attend exactly as an f16 pre-RoPE cache
    (same kernel, same values), bit for bit, in one batch and in ubatches of 16; without the window they do not."""
    with Model(smol_pre, n_ctx=512) as m:
        toks = m.tokenize(passage)[:300]
    f16 = _logits(smol_pre, toks, "f16", "f16", k_domain="pre", n_ubatch=n_ubatch)
    win = _logits(smol_pre, toks, "q4_0", "q4_0", kv_window=512, n_ubatch=n_ubatch)
    assert np.array_equal(win, f16)
    # sinks only: the first positions exact, the rest quantized (the control: what the window replaces)
    q4 = _logits(smol_pre, toks, "q4_0", "q4_0", kv_sinks=4, kv_window=0, n_ubatch=n_ubatch)
    assert _kld(f16, q4) > 1e-3


def test_heavy_hitters_over_every_cell_are_a_window_over_every_cell(smol_pre, passage):
    """kv_heavy = 1: every cell past the sinks takes a heavy slot when the next ubatch chooses it, so in ubatches of
    16 (each inside the 64-position window) q4_0 K and V attend as a window over every cell, bit for bit (f16 rows:
    the copy from a stage row into a heavy slot is exact); a few heavy slots do not."""
    with Model(smol_pre, n_ctx=512) as m:
        toks = m.tokenize(passage)[:300]
    kw = dict(kv_window_type="f16", n_ubatch=16)
    every = _logits(smol_pre, toks, "q4_0", "q4_0", kv_window=512, **kw)
    assert np.array_equal(_logits(smol_pre, toks, "q4_0", "q4_0", kv_window=64, kv_heavy=1.0, **kw), every)
    few = _logits(smol_pre, toks, "q4_0", "q4_0", kv_window=64, kv_heavy=0.02, **kw)
    assert _kld(every, few) > 1e-4


def test_heavy_hitters_lower_the_error(smol_pre, f16_model, wikitext):
    """q4_0 keys (pre-RoPE, window 64 + 4 sinks), V f16, 1024 tokens of WikiText-2 in ubatches of 512: 3% of the cells
    kept exact by their score against the file's mean query (blk.N.kvq_q_mean) lower the KLD against an f16 cache.
    Measured (2026-12-02): 0.00777 without, 0.00678 with 1%, 0.00650 with 3% (-16%). Logged, and kv_heavy reads back
    the slots per sequence."""
    kld = {}
    for h in (0.0, 0.03):
        kvq_log.clear()
        with Model(smol_pre, n_ctx=1024, cache_type_k="q4_0", cache_type_v="f16", flash_attn=True, kv_heavy=h) as m:
            kld[h] = m.kl_divergence(wikitext, baseline=f16_model, n_ctx=1024, n_chunks=1, progress=False).mean_kld
            assert m.setting("kv_heavy") == ("31" if h else "0")
            text = "".join(kvq_log.recent())
    assert "and 31 heavy hitters per sequence (the keys scoring highest against the file's mean query)" in text
    assert kld[0.03] < 0.9 * kld[0.0], kld


def test_heavy_hitters_need_the_files_mean_query(smol_pre, tmp_path):
    """A pre-RoPE file without blk.N.kvq_q_mean (converted before it existed) keeps its window, and says why it keeps
    no heavy hitters; a fraction outside [0, 1] is refused."""
    from gguf_variants import without_tensors
    old = without_tensors(smol_pre, tmp_path / "old.gguf", "kvq_q_mean")
    kvq_log.clear()
    with Model(old, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, kv_heavy=0.01) as m:
        assert (m.setting("kv_heavy"), m.setting("kv_window")) == ("0", "64")
    assert "heavy hitters off: the file has no blk.N.kvq_q_mean" in "".join(kvq_log.recent())
    for bad in (1.5, -0.1, "some"):
        with pytest.raises(SettingError, match=rf"kv_heavy = '{bad}': expected a fraction of the context in \[0, 1\]"):
            Model(smol_pre, n_ctx=512, flash_attn=True, kv_heavy=bad)


def test_heavy_hitters_from_the_file(smol_pre, tmp_path):
    """pykvq.cache.kv_heavy (what --kv-heavy F writes) is the runtime's default, said in the log and in
    the transforms; kv_heavy=0 turns it off; a value outside [0, 1] refuses the file, naming the key."""
    from gguf import GGUFValueType as VT
    from gguf_variants import with_key
    from pykvq.errors import ModelLoadError
    from pykvq.keys import Keys
    f = with_key(smol_pre, tmp_path / "heavy.gguf", Keys.Cache.KV_HEAVY, 0.01, VT.FLOAT32)
    kvq_log.clear()
    with Model(f, n_ctx=1024, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True) as m:
        assert m.setting("kv_heavy") == "11"                # ceil(0.01 * 1024)
        assert "last 64 cells, 11 heavy hitters)" in m.transforms()
    assert "heavy hitters = 0.01 of each sequence's cells (from the GGUF's pykvq.cache.kv_heavy" in "".join(kvq_log.recent())
    with Model(f, n_ctx=1024, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, kv_heavy=0) as m:
        assert m.setting("kv_heavy") == "0"
    bad = with_key(smol_pre, tmp_path / "bad.gguf", Keys.Cache.KV_HEAVY, 2.0, VT.FLOAT32)
    with pytest.raises(ModelLoadError, match=r"pykvq.cache.kv_heavy = 2: expected a fraction of the context in \[0, 1\]"):
        Model(bad, n_ctx=512, flash_attn=True)


def test_unified_cache_keeps_a_window_per_sequence(smol_pre, passage, wikitext):
    """Two sequences in one unified stream, 150 tokens each: each keeps its own sinks and ring, so a 160-cell window
    holds all of both and attends as an f16 pre-RoPE cache, bit for bit (one ring shared by both would hold 160 of
    the 300 cells written)."""
    out = {}
    for name, kt, kw in (("f16", "f16", dict(k_domain="pre")), ("win", "q4_0", dict(kv_window=160, kv_sinks=4))):
        with Model(smol_pre, n_ctx=512, cache_type_k=kt, cache_type_v=kt, flash_attn=True, attn_rot_k="on",
                   attn_rot_v="on", n_seq_max=2, kv_unified=True, n_ubatch=32, **kw) as m:
            a, b = m.tokenize(passage)[:150], m.tokenize(wikitext[20000:24000])[:150]
            m.decode(a[:-1], 0, seq=0)
            m.decode(b[:-1], 0, seq=1)
            out[name] = (m.decode(a[-1:], 149, seq=0), m.decode(b[-1:], 149, seq=1))
    assert np.array_equal(out["win"][0], out["f16"][0]) and np.array_equal(out["win"][1], out["f16"][1])


def test_state_carries_the_window(smol_pre, passage, wikitext):
    """A state carries the exact rows of its cells: restored into a fresh context with the same window, or into one
    whose window holds another text's rows at the same cells (stale rows, were they read), the next token decodes bit
    for bit as in the context that saved it. A reader without a window skips the rows (a state it saves has none); a
    state without rows restores quantized cells (only the new token is exact), which differs."""
    kw = dict(n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, n_ubatch=32)
    win, off = dict(kv_window=64, kv_sinks=4), dict(kv_window=0, kv_sinks=0)
    out = {}
    with Model(smol_pre, **kw, **off) as m:
        toks = m.tokenize(passage)[:200]
        other = m.tokenize(wikitext[20000:24000])[:199]
        m.decode(toks[:-1], 0)
        plain = m.get_state()
        out["none"] = m.decode(toks[-1:], len(toks) - 1)
    with Model(smol_pre, **kw, **win) as m:
        m.decode(toks[:-1], 0)
        state = m.get_state()
        out["saver"] = m.decode(toks[-1:], len(toks) - 1)
    assert len(state) > len(plain)
    resaved = {}
    for name, extra, first, data in (("fresh", win, None, state), ("used", win, other, state),
                                     ("no window", off, None, state), ("old state", win, None, plain)):
        with Model(smol_pre, **kw, **extra) as m:
            if first:
                m.decode(first, 0)
            m.set_state(data)
            resaved[name] = m.get_state()
            out[name] = m.decode(toks[-1:], len(toks) - 1)
    assert np.array_equal(out["fresh"], out["saver"]) and np.array_equal(out["used"], out["saver"])
    assert resaved["fresh"] == state
    # the reader without a window skips the rows (its own state has none); its cells hold what the window context
    # wrote, so it is not the plain run either (the window changed the hidden states the later layers stored)
    assert len(resaved["no window"]) == len(plain) and np.isfinite(out["no window"]).all()
    assert _kld(out["saver"][None], out["old state"][None]) > 1e-6


def test_sequence_state_keeps_the_other_sequences_window(smol_pre, passage, wikitext):
    """Two sequences in one unified stream: saving sequence 1, clearing it and restoring it leaves both decoding bit
    for bit as without (sequence 0's rows untouched, sequence 1's back from the state)."""
    kw = dict(n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, n_ubatch=32, n_seq_max=2,
              kv_unified=True, kv_window=48, kv_sinks=4)
    out = {}
    for name in ("kept", "restored"):
        with Model(smol_pre, **kw) as m:
            a, b = m.tokenize(passage)[:150], m.tokenize(wikitext[20000:24000])[:150]
            m.decode(a[:-1], 0, seq=0)
            m.decode(b[:-1], 0, seq=1)
            if name == "restored":
                s1 = m.get_seq_state(1)
                m.seq_rm(-1, -1, seq=1)
                m.set_seq_state(s1, seq=1)
            out[name] = m.decode(a[-1:], 149, seq=0), m.decode(b[-1:], 149, seq=1)
    assert all(np.array_equal(x, y) for x, y in zip(out["kept"], out["restored"]))


@pytest.mark.parametrize("n_ubatch", [512, 32])
def test_window_and_sinks_lower_the_error(smol_pre, f16_model, wikitext, n_ubatch):
    """4-bit keys and values (pre-RoPE) on WikiText-2, KLD against an f16 cache, each 512-token chunk in one ubatch
    and in 16: every query reads its own last 64 positions exactly either way (before the window was per query, one
    ubatch of 512 read only its last 64 tokens' rows). Measured (4 x 512 tokens), ub 512: no window 0.0221, 4 sinks
    and 64 positions 0.0063; ub 32: 0.0241 / 0.0061. The control is the same file without the window in the same run."""
    kld = {}
    for name, kw in (("none", dict(kv_sinks=0, kv_window=0)), ("win", dict(kv_sinks=4, kv_window=64))):
        with Model(smol_pre, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, n_ubatch=n_ubatch,
                   **kw) as m:
            kld[name] = m.kl_divergence(wikitext, baseline=f16_model, n_chunks=4, progress=False).mean_kld
    assert kld["win"] < 0.5 * kld["none"], kld


def test_window_is_logged_and_off_where_keys_are_post_rope(smollm2, smol_pre):
    kvq_log.clear()
    with Model(smol_pre, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, kv_window=32, kv_sinks=4) as m:
        text = "".join(kvq_log.recent())
        assert (m.setting("kv_sinks"), m.setting("kv_window")) == ("4", "32")
    assert "exact window in 30 of 30 layers: the first 4 positions and the last 32 up to each query kept in f16" in text, text[-2000:]
    kvq_log.clear()
    with Model(smollm2, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, kv_window=32) as m:
        text = "".join(kvq_log.recent())
        assert m.setting("kv_window") == "0"
    assert "exact window off: it keeps pre-RoPE keys" in text, text[-2000:]


@pytest.mark.parametrize("name,value", [("kv_window", -1), ("kv_sinks", "four"), ("kv_window", "1e3")])
def test_bad_window_settings_are_refused(smol_pre, name, value):
    with pytest.raises(SettingError, match=rf"{name} = '{value}': expected a number of"):
        Model(smol_pre, n_ctx=512, flash_attn=True, **{name: value})


def test_tools_take_the_window_flags(smol_pre):
    res = run_tool("llama-completion", "-m", smol_pre, "-p", "The capital of France is", "-n", "4", "--temp", "0",
                   "-no-cnv", "-fa", "on", "-ctk", "q4_0", "-ctv", "q4_0", "--kv-window", "16", "--kv-sinks", "2", "-lv", "4", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "exact window in 30 of 30 layers: the first 2 positions and the last 16 up to each query kept in f16" in res.stderr


def test_suite_settings_name_the_window():
    """The suite's :sinks-S / :win-W suffixes: parsed, labelled back, passed to Model (a quality evaluation in
    any ubatch: each query reads its own window), the window's f16 rows counted in bits/value at the context used;
    refused without a pre-RoPE file."""
    from pykvq.errors import PykvqError
    from pykvq.suite.settings import parse_setting
    s = parse_setting("q4_0@prerope:sinks-4:win-64")
    assert (s.sinks, s.window) == (4, 64) and parse_setting(s.label) == s
    assert s.model_kwargs() == dict(cache_type_k="q4_0", cache_type_v="q4_0", attn_rot_k="auto", attn_rot_v="auto",
                                    kv_sinks=4, kv_window=64)
    assert "n_ubatch" not in s.model_kwargs(evaluation=True)
    assert s.window_bits(4096) == pytest.approx(16 * 69 / 4096)
    assert parse_setting("q4_0@prerope:sinks-4").window_bits(4096) == pytest.approx(16 * 5 / 4096)
    assert parse_setting("q4_0@prerope").window_bits(4096) == 0.0
    # its inverse: the longest window within a share of bits (by hand: 0.125 x 4096 / 16 = 32 rows = 4 + 27 + 1)
    from pykvq.cache_info import longest_window, window_bits
    assert longest_window(0.125, 4, 4096) == 27 and window_bits(4, 27, 4096) == pytest.approx(0.125)
    assert longest_window(0.125, 4, 8192) == 59 and longest_window(0.125, 4, 512) is None
    # q8_0 rows: 8.5 bits a value (34 bytes a block of 32), 8.5 * 60 / 4096 = 0.1245 (by hand)
    assert longest_window(0.125, 4, 4096, "q8_0") == 55 and window_bits(4, 55, 4096, "q8_0") == pytest.approx(8.5 * 60 / 4096)
    with pytest.raises(PykvqError, match="keep pre-RoPE keys exact"):
        parse_setting("q4_0:win-64")


def test_a_converted_file_turns_the_window_on(smol_pre):
    """--prerope-k writes pykvq.cache.kv_sinks = 4 / kv_window = 64 (the converter's defaults), so a context that sets
    nothing keeps them, logged with where they came from; 0 turns them off; a window past the cache keeps every cell."""
    from pykvq.keys import Keys
    kvq_log.clear()
    with Model(smol_pre, n_ctx=512, flash_attn=True) as m:
        text = "".join(kvq_log.recent())
        assert (m.meta(Keys.Cache.KV_SINKS), m.meta(Keys.Cache.KV_WINDOW)) == ("4", "64")
        assert (m.setting("kv_sinks"), m.setting("kv_window")) == ("4", "64")
        assert "keys cached pre-RoPE (f16: first 4 positions, last 64 cells)" in m.transforms()
    assert "exact window = 64 (from the GGUF's pykvq.cache.kv_window; --kv-window 0 turns it off)" in text, text[-2000:]
    with Model(smol_pre, n_ctx=512, flash_attn=True, kv_window=0) as m:
        assert (m.setting("kv_sinks"), m.setting("kv_window")) == ("4", "0")
    with Model(smol_pre, n_ctx=256, flash_attn=True, kv_window=100000) as m:
        assert m.setting("kv_window") == "256"


def test_damaged_window_section_is_refused(smol_pre, passage):
    """The state's window section (the last bytes of a one-stream state: n_rows, their cells, n_layer, per layer the
    row bytes and the rows) damaged: a row size other than one cell's f16 K + V (also for a reader without a window,
    which would skip the rows), or a cut inside it, is an error and leaves nothing half-restored: the context decodes
    on as an empty one."""
    kw = dict(n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, n_ubatch=32, kv_sinks=4,
              kv_window=64)
    with Model(smol_pre, **kw) as m:
        toks = m.tokenize(passage)[:200]
        m.decode(toks[:-1], 0)
        state = bytearray(m.get_state())
        fresh = None
        n, rb = 4 + 64, 2 * (192 + 192)                 # rows (sinks + window), bytes of one row (SmolLM2: 3 x 64)
        at = len(state) - n * rb - 4                    # the last layer's row-size word
        assert int.from_bytes(state[at:at + 4], "little") == rb
        bad = bytearray(state)
        bad[at:at + 4] = (0xFFFFFFF0).to_bytes(4, "little")
        for damaged in (bytes(bad), bytes(state[:-100])):
            with pytest.raises(DecodeError):
                m.set_state(damaged)
            assert m.used_cells() == 0
            fresh = m.decode(toks[:1], 0)
            m.seq_rm()
    with Model(smol_pre, **kw) as m2:
        assert np.array_equal(m2.decode(toks[:1], 0), fresh)
    with Model(smol_pre, **{**kw, "kv_window": 0, "kv_sinks": 0}) as m3:   # a reader that would skip the rows
        m3.set_state(bytes(state))
        with pytest.raises(DecodeError):
            m3.set_state(bytes(bad))


def test_window_rows_in_q8_0(smol_pre, passage):
    """kv_window_type q8_0 (the converter's default since 2026-11-30): a window over every cell then attends exactly
    as a q8_0 pre-RoPE cache, bit for bit (the rows hold what that cache would, read by the same float kernel), at 34
    bytes a block of 32 instead of f16's 64; logged and read back as a setting; any other type refused."""
    with Model(smol_pre, n_ctx=512) as m:
        toks = m.tokenize(passage)[:300]
    q8_cache = _logits(smol_pre, toks, "q8_0", "q8_0", k_domain="pre", kv_sinks=0, kv_window=0)
    kvq_log.clear()
    with Model(smol_pre, n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, attn_rot_k="on",
               attn_rot_v="on", kv_window=512, kv_window_type="q8_0") as m:
        q8 = m.eval_logits(toks)
        text = "".join(kvq_log.recent())
        assert m.setting("kv_window_type") == "q8_0"
        assert "keys cached pre-RoPE (q8_0: first 4 positions, last 512 cells)" in m.transforms()
    assert "the last 512 up to each query kept in q8_0" in text, text[-2000:]
    assert np.array_equal(q8, q8_cache)
    f16 = _logits(smol_pre, toks, "q4_0", "q4_0", kv_window=512, kv_window_type="f16")
    assert not np.array_equal(q8, f16)
    with pytest.raises(SettingError, match="kv_window_type = 'q4_0': expected f16 or q8_0"):
        Model(smol_pre, n_ctx=512, flash_attn=True, kv_window_type="q4_0")


def test_state_moves_between_window_row_types(smol_pre, passage):
    """A state saved with q8_0 rows restores into a context keeping f16 rows and back (the rows converted): decoding
    on gives what the saving context gives, within the rows' 8-bit rounding."""
    kw = dict(n_ctx=512, cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True, n_ubatch=32, kv_sinks=4,
              kv_window=64)
    out, states = {}, {}
    with Model(smol_pre, n_ctx=512) as m:
        toks = m.tokenize(passage)[:200]
    for t in ("q8_0", "f16"):
        with Model(smol_pre, **kw, kv_window_type=t) as m:
            m.decode(toks[:-1], 0)
            states[t] = m.get_state()
            out[t] = m.decode(toks[-1:], len(toks) - 1)
    assert len(states["q8_0"]) < len(states["f16"])
    for saved, reader in (("q8_0", "f16"), ("f16", "q8_0")):
        with Model(smol_pre, **kw, kv_window_type=reader) as m:
            m.set_state(states[saved])
            got = m.decode(toks[-1:], len(toks) - 1)
        # measured 0.0013 (q8_0 -> f16): the token decoded after the restore is the one row held differently, and
        # on this Q4_1 model any change of the cache costs a KLD of its own (a q8_0 cache's: 0.0036)
        assert _kld(out[saved][None], got[None]) < 0.01, (saved, reader, _kld(out[saved][None], got[None]))
        assert got.argmax() == out[saved].argmax()


def test_converter_writes_q8_0_window_rows(smollm2, tmp_path):
    """--prerope-k writes pykvq.cache.kv_window_type = q8_0 unless told f16; the runtime takes it from the file."""
    from pykvq.keys import Keys
    from test_convert import run_convert
    out = tmp_path / "q8win.gguf"
    run_convert(smollm2, "-o", out, "--prerope-k")
    kvq_log.clear()
    with Model(out, n_ctx=512, flash_attn=True) as m:
        assert m.meta(Keys.Cache.KV_WINDOW_TYPE) == "q8_0" and m.setting("kv_window_type") == "q8_0"
    assert "exact window rows in q8_0 (from the GGUF's pykvq.cache.kv_window_type)" in "".join(kvq_log.recent())
