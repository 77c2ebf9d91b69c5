"""Edge inputs of every pykvq codec (docs/FORMATS.md, "Edge inputs"), as property tests.

For arbitrary float32 rows (huge, beyond f16, near FLT_MAX, tiny, f32 subnormals, zeros, NaN,
+-inf, mixed magnitudes in one block) and, for the nuq types, arbitrary valid codebooks:
  - the numpy reference, the C reference, every CPU kernel variant compiled into the library
    (generic, AVX2, AVX-512...) and the CUDA codec header built for the host write the same
    bytes and decode the same bits;
  - nothing decodes to inf or NaN, and the stored f16 fields pass ggml's row validation;
  - K·Q (vec_dot) of every CPU variant is finite and matches the exact sum where that is finite;
  - a NaN is read as 0 and +-inf as +-FLT_MAX (the bytes are those of that row);
  - blocks are independent (a row's bytes are its blocks' bytes);
  - the round-trip error is within the format's bound where the input is in range.
NEON runs the drawn rows in batches under qemu (nuq_check.c's dump mode); the x86 variants this
CPU lacks run fixed rows of the same edge classes in native/tests/*_check.c (tests/test_bfp.py,
test_nuq.py). The default run draws a bounded set of fresh random examples each run (hypothesis prints the
seed and a reproduce blob of a failure, and keeps failures in $PYKVQ_CACHE/hypothesis, replayed first by the
next run); PYKVQ_SOAK=1 (make soak) draws many more."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pykvq import cache_types
from pykvq._lib import ffi, lib
from pykvq.ref import bfp, nuq, q53

from test_cuda import GGML, NATIVE
from test_nuq import q8_0_bytes, vec_dot_ref

def _database():
    from hypothesis.database import DirectoryBasedExampleDatabase
    from pykvq.paths import cache_dir
    return DirectoryBasedExampleDatabase(str(cache_dir() / "hypothesis"))


FAST = settings(max_examples=60, derandomize=False, database=_database(), deadline=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
SOAK = settings(FAST, max_examples=3000)

BFP = list(bfp.FORMATS)
NUQ = list(nuq.FORMATS)
FLT_MAX = np.float32(np.finfo(np.float32).max)
F16_MAX = 65504.0

# ---- the rows ------------------------------------------------------------------------------

SPECIAL = [0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, -70000.0, 8.3e6, 8.4e6, 1e9, -1e20, 3.4028235e38,
           -3.4028235e38, 3.3e38, np.inf, -np.inf, np.nan, 2.0 ** -149, -2.0 ** -149, 2.0 ** -126, 1e-40,
           2.0 ** -25, 127 * 2.0 ** -25, 6e-8, 6.1e-5, 1e-36]


def _scaled(e: int):
    """Values of magnitude about 2^e (float32; overflow gives inf, underflow subnormals or 0)."""
    def f(v):
        with np.errstate(over="ignore", under="ignore"):
            return float(np.ldexp(np.float32(v), e))
    return st.floats(-1.0, 1.0, width=32).map(f)


def _block():
    """64 values: one magnitude class 2^e per block with up to 6 specials or arbitrary float32
    at drawn positions; or all arbitrary; or all zero."""
    wild = st.one_of(st.sampled_from(SPECIAL), st.floats(width=32))

    def values(e):
        def put(args):
            base, subs = args
            for i, v in subs:
                base[i] = v
            return base
        return st.tuples(st.lists(_scaled(e), min_size=64, max_size=64),
                         st.lists(st.tuples(st.integers(0, 63), wild), max_size=6)).map(put)
    return st.one_of(st.integers(-155, 130).flatmap(values), st.integers(-155, 130).flatmap(values),
                     st.lists(wild, min_size=64, max_size=64), st.just([0.0] * 64))


# rows of 1 to 3 blocks of 64 (every block size divides 64)
ROWS = st.lists(_block(), min_size=1, max_size=3).map(lambda bs: np.array(sum(bs, []), np.float32))


def _codebook(n: int):
    return st.lists(st.integers(-127, 127), min_size=n, max_size=n, unique=True).map(
        lambda v: np.array(sorted(v), np.int8))


def CODEBOOKS(name: str):
    """The fallback (None) or any valid codebook of the type."""
    return st.one_of(st.none(), _codebook(nuq.FORMATS[name].n_codes))


# ---- the implementations -------------------------------------------------------------------

def _impls():
    L = lib()
    return [(i, ffi.string(L.ggml_kvq_cpu_impl_name(i)).decode()) for i in range(L.ggml_kvq_cpu_n_impls())]


def _fp(x: np.ndarray):
    return ffi.cast("float *", ffi.from_buffer(x))


def _cb16(cb):
    return ffi.NULL if cb is None else ffi.new("int8_t[16]", [int(v) for v in cb] + [0] * (16 - len(cb)))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def cuda_codec(tmp_path_factory):
    """native/ggml/cuda/kvq-codec.cuh built for the host as a library (cuda_codec_check.cpp, KVQ_CODEC_LIB)."""
    so = tmp_path_factory.mktemp("codec") / "libkvqcodec.so"
    subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-shared", "-fPIC",
                    "-DKVQ_CODEC_LIB", f"-I{NATIVE / 'include'}", f"-I{GGML / 'include'}",
                    str(NATIVE / "tests" / "cuda_codec_check.cpp"), "-o", str(so)], check=True, capture_output=True)
    cffi = type(ffi)()
    cffi.cdef("int kvq_codec_quantize(int type, const float * x, int n, const int8_t * cb, uint8_t * out);"
              "int kvq_codec_dequantize(int type, const uint8_t * q, int n, const int8_t * cb, float * out);")
    return cffi, cffi.dlopen(str(so))


def _cuda(codec, name: str, x: np.ndarray, buf: bytes, cb):
    cffi, cl = codec
    t = cache_types.resolve(name)
    cbp = cffi.NULL if cb is None else cffi.new("int8_t[16]", [int(v) for v in cb] + [0] * (16 - len(cb)))
    out = cffi.new("uint8_t[]", len(buf))
    assert cl.kvq_codec_quantize(t, cffi.cast("float *", cffi.from_buffer(x)), x.size, cbp, out) == 0
    y = np.empty(x.size, np.float32)
    assert cl.kvq_codec_dequantize(t, buf, x.size, cbp, cffi.cast("float *", cffi.from_buffer(y))) == 0
    return bytes(cffi.buffer(out)), y


# ---- bfp -----------------------------------------------------------------------------------

def check_bfp(name: str, x: np.ndarray, codec) -> None:
    L = lib()
    f = bfp.FORMATS[name]
    t = cache_types.resolve(name)
    want = bfp.quantize_row(x, name)
    y = bfp.dequantize_row(want, name)

    # every implementation: the same bytes, the same bits
    out = ffi.new("uint8_t[]", len(want))
    getattr(L, f"quantize_row_{name}_ref")(_fp(x), out, x.size)
    assert bytes(ffi.buffer(out)) == want, "C reference"
    L.ggml_get_type_traits_cpu(t).from_float(_fp(x), out, x.size)
    assert bytes(ffi.buffer(out)) == want, "CPU from_float"
    got = np.empty(x.size, np.float32)
    getattr(L, f"dequantize_row_{name}")(want, _fp(got), x.size)
    np.testing.assert_array_equal(bits(got), bits(y), err_msg="C dequantize")
    for i, impl in _impls():
        L.ggml_kvq_cpu_impl_to_float(i, t)(want, _fp(got), x.size)
        np.testing.assert_array_equal(bits(got), bits(y), err_msg=impl)
    if cache_types.KVQ_TYPES[name].cuda:   # a CPU-only row of the type table has no CUDA codec
        cq, cy = _cuda(codec, name, x, want, None)
        assert cq == want, "CUDA codec quantize"
        np.testing.assert_array_equal(bits(cy), bits(y), err_msg="CUDA codec dequantize")

    # defined behaviour
    assert np.isfinite(y).all()
    assert bfp.quantize_row(np.where(np.isnan(x), np.float32(0), x), name) == want           # NaN is 0
    assert bfp.quantize_row(np.clip(np.nan_to_num(x, nan=0.0), -FLT_MAX, FLT_MAX), name) == want  # inf is FLT_MAX
    nb = x.size // f.block
    assert b"".join(bfp.quantize_row(x[i*f.block:(i+1)*f.block], name) for i in range(nb)) == want

    # K·Q (Q in bfp8_32) of every variant: finite and equal to the exact sum where that is below 1e37
    # (K near FLT_MAX times Q ~ 1 overflows float in any implementation); tolerance as in test_bfp,
    # plus the f32 subnormal grid for blocks whose scale product falls below 2^-126
    q = np.random.default_rng(x.size).standard_normal(x.size).astype(np.float32)
    qb = bfp.quantize_row(q, "bfp8_32")
    exact = bfp.vec_dot(want, name, q)
    mag = float(np.abs(y.astype(np.float64) * bfp.dequantize_row(qb, "bfp8_32")).sum())
    if mag < 1e37:
        s = ffi.new("float *")
        for i, impl in _impls():
            L.ggml_kvq_cpu_impl_vec_dot(i, t)(x.size, s, 0, want, 0, qb, 0, 1)
            assert np.isfinite(s[0]) and abs(s[0] - exact) <= 1e-6 * mag + x.size * 2.0 ** -149, (impl, s[0], exact)

    # error: half a step 2^(s-1) per value where the block is in range; saturated blocks keep the sign
    e, _ = bfp.unpack(want, name)
    xb, yb = x.reshape(nb, f.block), y.reshape(nb, f.block)
    top = float(np.ldexp(f.mmax, f.smax))
    for i in range(nb):
        xi = np.where(np.isnan(xb[i]), 0, xb[i]).astype(np.float64)
        step = float(np.ldexp(1.0, int(e[i]) - 127)) if e[i] else 2.0 ** -127
        if np.abs(xi).max() < (f.mmax + 0.5) * np.ldexp(1.0, f.smax):
            assert np.abs(xi - yb[i]).max() <= step / 2, (name, i)
        else:
            assert e[i] == 127 + f.smax and np.abs(yb[i]).max() == top
            assert (np.sign(yb[i]) * np.sign(xi) >= 0).all()


@pytest.mark.parametrize("name", BFP)
@FAST
@given(x=ROWS)
def test_bfp_edge_inputs(name, x, cuda_codec):
    check_bfp(name, x, cuda_codec)


@pytest.mark.soak
@pytest.mark.parametrize("name", BFP)
@SOAK
@given(x=ROWS)
def test_bfp_edge_inputs_soak(name, x, cuda_codec):
    check_bfp(name, x, cuda_codec)


# ---- nuq -----------------------------------------------------------------------------------

def worst_gap(c: np.ndarray) -> float:
    """Largest distance from a v in [-127, 127] to its nearest entry of c."""
    c = c.astype(np.float64)
    return float(max(c[0] + 127, 127 - c[-1], (np.diff(c) / 2).max()))


def check_nuq(name: str, x: np.ndarray, cb, codec) -> None:
    L = lib()
    f = nuq.FORMATS[name]
    t = cache_types.resolve(name)
    c = nuq.fallback(name) if cb is None else cb
    want = nuq.quantize_bytes(x, name, cb)
    y = nuq.dequantize_bytes(want, name, cb)

    out = ffi.new("uint8_t[]", len(want))
    cbp = ffi.NULL if cb is None else ffi.new("int8_t[]", [int(v) for v in cb])
    getattr(L, f"quantize_row_{name}_ref_cb")(_fp(x), out, x.size, cbp)
    assert bytes(ffi.buffer(out)) == want, "C reference"
    got = np.empty(x.size, np.float32)
    getattr(L, f"dequantize_row_{name}_cb")(want, _fp(got), x.size, cbp)
    np.testing.assert_array_equal(bits(got), bits(y), err_msg="C dequantize")
    keep = (_cb16(cb), _cb16(cb))
    L.ggml_kvq_cpu_bind_codebooks(*keep)      # as ggml_kvq_cpu_bind does for a node
    try:
        for i, impl in _impls() + [(-1, "traits")]:
            ff = L.ggml_get_type_traits_cpu(t).from_float if i < 0 else L.ggml_kvq_cpu_impl_from_float(i, t)
            ff(_fp(x), out, x.size)
            assert bytes(ffi.buffer(out)) == want, impl
            if i >= 0:
                L.ggml_kvq_cpu_impl_to_float(i, t)(want, _fp(got), x.size)
                np.testing.assert_array_equal(bits(got), bits(y), err_msg=impl)
    finally:
        L.ggml_kvq_cpu_bind_codebooks(ffi.NULL, ffi.NULL)
    cq, cy = _cuda(codec, name, x, want, c)
    assert cq == want, "CUDA codec quantize"
    np.testing.assert_array_equal(bits(cy), bits(y), err_msg="CUDA codec dequantize")

    # K·Q (Q in q8_0) of every variant: finite, within 1e-5 of the sum of |terms| (as test_nuq)
    qb = q8_0_bytes(np.random.default_rng(x.size).standard_normal(x.size).astype(np.float32))
    exact, mag = vec_dot_ref(want, name, qb, cb)
    s = ffi.new("float *")
    L.ggml_kvq_cpu_bind_codebooks(*keep)
    try:
        for i, impl in _impls():
            L.ggml_kvq_cpu_impl_vec_dot(i, t)(x.size, s, 0, want, 0, qb, 0, 1)
            assert np.isfinite(s[0]) and abs(s[0] - exact) <= 1e-5 * (mag or 1.0), (impl, s[0], exact)
    finally:
        L.ggml_kvq_cpu_bind_codebooks(ffi.NULL, ffi.NULL)

    # defined behaviour
    assert np.isfinite(y).all()
    assert L.ggml_validate_row_data(t, want, len(want))
    assert nuq.quantize_bytes(np.where(np.isnan(x), np.float32(0), x), name, cb) == want          # NaN is 0
    # inf is FLT_MAX; except that the outlier types pick an inf over an earlier +-FLT_MAX (inf is larger)
    if not f.outliers or not (np.abs(x[np.isfinite(x)]) == FLT_MAX).any():
        assert nuq.quantize_bytes(np.clip(np.nan_to_num(x, nan=0.0), -FLT_MAX, FLT_MAX), name, cb) == want
    nb = x.size // f.block
    assert b"".join(nuq.quantize_bytes(x[i*f.block:(i+1)*f.block], name, cb) for i in range(nb)) == want

    # error where the block is in range: |x - d16 c| <= d w + 127 |d - d16| (+ float rounding of x/d);
    # the outlier as f16 (half an ulp, 2^-25 below f16's normal range); beyond range: saturated, same sign
    b = nuq.unpack(want, name)
    w = worst_gap(c)
    xb = np.where(np.isnan(x), 0, x).astype(np.float64).reshape(nb, f.block)
    yb = y.astype(np.float64).reshape(nb, f.block)
    for i in range(nb):
        dense = np.ones(f.block, bool)
        if f.outliers:
            oi = int(b.oi[i])
            dense[oi] = False
            xo = xb[i, oi]
            if abs(xo) <= F16_MAX:
                assert abs(xo - yb[i, oi]) <= max(abs(xo) * 2.0 ** -11, 2.0 ** -25), (name, i)
            else:
                assert yb[i, oi] == np.sign(xo) * F16_MAX
        amax = np.abs(xb[i, dense]).max()
        d = amax / 127
        d16 = float(b.d[i])
        if d <= F16_MAX:
            bound = d * w + 127 * abs(d - d16) + amax * 2.0 ** -20
            assert np.abs(xb[i, dense] - yb[i, dense]).max() <= bound, (name, i, d, d16)
        else:
            assert d16 == F16_MAX and np.abs(yb[i, dense]).max() <= F16_MAX * 127


@pytest.mark.parametrize("name", NUQ)
@FAST
@given(data=st.data())
def test_nuq_edge_inputs(name, data, cuda_codec):
    check_nuq(name, data.draw(ROWS, "x"), data.draw(CODEBOOKS(name), "cb"), cuda_codec)


@pytest.mark.soak
@pytest.mark.parametrize("name", NUQ)
@SOAK
@given(data=st.data())
def test_nuq_edge_inputs_soak(name, data, cuda_codec):
    check_nuq(name, data.draw(ROWS, "x"), data.draw(CODEBOOKS(name), "cb"), cuda_codec)


# ---- the variants this CPU does not run: NEON (aarch64 under qemu) -----------------------------

NEON = {"arm64-neon": ["-march=armv8-a"], "arm64-dotprod": ["-march=armv8.2-a+dotprod"]}


# ---- q53_64 ----------------------------------------------------------------------------------

_HALVES = {"q53_64": (q53.quantize_blocks, q53.dequantize_blocks, q53.pack, q53.unpack),
           "q42_64": (q53.q42_quantize_blocks, q53.q42_dequantize_blocks, q53.q42_pack, q53.q42_unpack),
           "q32_64": (q53.q32_quantize_blocks, q53.q32_dequantize_blocks, q53.q32_pack, q53.q32_unpack)}


def check_q53(name: str, x: np.ndarray, codec) -> None:
    """q53_64 / q42_64 / q32_64 (keys in halves of 5 + 3 / 4 + 2 / 3 + 2 bits): numpy, the C reference, the CPU kernels
    and the CUDA codec (the types that have one) agree bit for bit; NaN reads as 0 and +-inf as +-FLT_MAX; blocks are independent; nothing decodes to inf
    or NaN; K·Q is within 1e-5 of the exact sum of the decoded values times Q in q8_0 where that sum is below 1e37."""
    quantize_blocks, dequantize_blocks, pack, unpack = _HALVES[name]
    L = lib()
    t = cache_types.resolve(name)
    want = pack(*quantize_blocks(x))
    y = dequantize_blocks(*unpack(want)).reshape(-1)
    tr = L.ggml_get_type_traits(t)
    out = ffi.new("uint8_t[]", len(want))
    tr.from_float_ref(_fp(x), out, x.size)
    assert bytes(ffi.buffer(out)) == want, "C reference"
    L.ggml_get_type_traits_cpu(t).from_float(_fp(x), out, x.size)
    assert bytes(ffi.buffer(out)) == want, "CPU from_float"
    got = np.empty(x.size, np.float32)
    tr.to_float(want, _fp(got), x.size)
    np.testing.assert_array_equal(bits(got), bits(y), err_msg="C dequantize")
    L.ggml_kvq_cpu_to_float_k(t)(want, _fp(got), x.size)
    np.testing.assert_array_equal(bits(got), bits(y), err_msg="CPU K-tile dequantize")
    if cache_types.KVQ_TYPES[name].cuda:
        cq, cy = _cuda(codec, name, x, want, None)
        assert cq == want, "CUDA codec quantize"
        np.testing.assert_array_equal(bits(cy), bits(y), err_msg="CUDA codec dequantize")
    assert np.isfinite(y).all()
    clean = np.clip(np.nan_to_num(x, nan=0.0, posinf=FLT_MAX, neginf=-FLT_MAX), -FLT_MAX, FLT_MAX)
    assert pack(*quantize_blocks(clean.astype(np.float32))) == want
    assert b"".join(pack(*quantize_blocks(x[i:i + 64])) for i in range(0, x.size, 64)) == want
    q = np.random.default_rng(x.size).standard_normal(x.size).astype(np.float32)
    qb = ffi.new("uint8_t[]", x.size // 32 * 34)
    L.quantize_row_q8_0_ref(_fp(q), qb, x.size)
    qr = np.frombuffer(bytes(ffi.buffer(qb)), np.uint8).reshape(-1, 34)
    qv = (qr[:, 2:].copy().view(np.int8).astype(np.float64) *
          qr[:, :2].copy().view(np.float16).astype(np.float64)).reshape(-1)
    terms = y.astype(np.float64) * qv
    mag = float(np.abs(terms).sum())
    if mag < 1e37:
        s = ffi.new("float *")
        L.ggml_get_type_traits_cpu(t).vec_dot(x.size, s, 0, want, 0, qb, 0, 1)
        assert np.isfinite(s[0]) and abs(s[0] - terms.sum()) <= 1e-5 * mag + x.size * 2.0 ** -149, (s[0], terms.sum())


@pytest.mark.parametrize("name", list(_HALVES))
@FAST
@given(x=ROWS)
def test_q53_edge_inputs(name, x, cuda_codec):
    check_q53(name, x, cuda_codec)


@pytest.mark.parametrize("name", list(_HALVES))
@pytest.mark.soak
@SOAK
@given(x=ROWS)
def test_q53_edge_inputs_soak(name, x, cuda_codec):
    check_q53(name, x, cuda_codec)


@pytest.fixture(scope="module", params=list(NEON))
def neon_check(request, tmp_path_factory):
    """native/tests/nuq_check.c cross-compiled for aarch64: its dump mode runs every variant."""
    import shutil
    from native_build import REPO, SOURCES, skip_or_fail
    if not shutil.which("aarch64-linux-gnu-gcc") or not shutil.which("qemu-aarch64"):
        skip_or_fail("neon", "aarch64-linux-gnu-gcc / qemu-aarch64 not installed (apt: gcc-aarch64-linux-gnu qemu-user)")
    exe = tmp_path_factory.mktemp("neon") / "nuq_check"
    src = REPO / "native"
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-std=c11", *NEON[request.param], f"-I{src / 'include'}",
                    f"-I{GGML / 'include'}", str(src / "tests" / "nuq_check.c"), *(str(src / x) for x in SOURCES),
                    "-lm", "-o", str(exe)], check=True, capture_output=True)
    return request.param, exe


def _size(name: str) -> tuple[int, int]:
    f = bfp.FORMATS.get(name) or nuq.FORMATS[name]
    return f.block, f.type_size


@settings(FAST, max_examples=6)
@given(data=st.data())
def test_neon_edge_inputs(neon_check, data, tmp_path_factory):
    """A batch of drawn rows through every variant of the aarch64 build (generic and NEON) under
    qemu: the bytes and bits of numpy, and nothing decodes to inf or NaN."""
    check_neon(neon_check, data, tmp_path_factory)


@pytest.mark.soak
@settings(FAST, max_examples=300)
@given(data=st.data())
def test_neon_edge_inputs_soak(neon_check, data, tmp_path_factory):
    check_neon(neon_check, data, tmp_path_factory)


def check_neon(neon_check, data, tmp_path_factory) -> None:
    build, exe = neon_check
    recs = []
    for name in BFP + NUQ:
        x = data.draw(ROWS, f"x {name}")
        cb = data.draw(CODEBOOKS(name), f"cb {name}") if name in nuq.FORMATS else None
        recs.append((name, x, cb))
    d = tmp_path_factory.mktemp("rows")
    with open(d / "in", "wb") as fh:
        for name, x, cb in recs:
            c = np.zeros(16, np.int8) if cb is None else np.concatenate([cb, np.zeros(16 - len(cb), np.int8)])
            fh.write(np.array([cache_types.resolve(name), x.size, cb is not None], np.int32).tobytes())
            fh.write(c.tobytes() + x.tobytes())
    res = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(exe), str(d / "in"), str(d / "out")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = (d / "out").read_bytes()
    n_impls, o = int(np.frombuffer(out[:4], np.int32)[0]), 4
    assert n_impls >= 2, f"{build}: no NEON variant compiled"
    for name, x, cb in recs:
        if name in nuq.FORMATS:
            want, y = nuq.quantize_bytes(x, name, cb), None
            y = nuq.dequantize_bytes(want, name, cb)
        else:
            want = bfp.quantize_row(x, name)
            y = bfp.dequantize_row(want, name)
        qk, bs = _size(name)
        nq = x.size // qk * bs
        for i in range(n_impls):
            assert out[o:o + nq] == want, (build, name, i)
            got = np.frombuffer(out[o + nq:o + nq + 4 * x.size], np.float32)
            np.testing.assert_array_equal(bits(got), bits(y), err_msg=f"{build} {name} variant {i}")
            o += nq + 4 * x.size
        assert np.isfinite(y).all()
    assert o == len(out)


# ---- hand-checked values of the rule (the table in docs/FORMATS.md) ------------------------

def test_edge_inputs_by_hand():
    blk = lambda *v, n=64: np.array(list(v) + [0.0] * (n - len(v)), np.float32)
    # bfp: inf saturates to M * 2^SMAX (bfp8: 127 * 2^121, bfp4: 7 * 2^125), finite
    for name, top in (("bfp8_32", 127 * 2.0 ** 121), ("bfp4_32", 7 * 2.0 ** 125)):
        y = bfp.dequantize_row(bfp.quantize_row(blk(np.inf, -np.inf, 1.0, n=32), name), name)
        assert y[0] == top and y[1] == -top and y[2] == 0
        # FLT_MAX used to round up to 2^128 (inf); now the largest finite value of the format
        y = bfp.dequantize_row(bfp.quantize_row(blk(3.4028235e38, n=32), name), name)
        assert y[0] == top
    # bfp: NaN -> 0, all-zero -> 0, f32 subnormals kept to 2^-128
    y = bfp.dequantize_row(bfp.quantize_row(blk(np.nan, 1e-40, 3e-39, n=32), "bfp8_32"), "bfp8_32")
    assert y[0] == 0 and abs(y[1] - 1e-40) <= 2.0 ** -128 and abs(y[2] - 3e-39) <= 2.0 ** -128
    # nuq: d clamps to 65504 (was inf as f16); inf is FLT_MAX; NaN is 0
    b = nuq.quantize_blocks(blk(1e7, -np.inf, 5.0, np.nan, n=32), "nuq4")
    assert float(b.d[0]) == F16_MAX
    y = nuq.dequantize_blocks(b)
    assert y[0] == 123 * F16_MAX and y[1] == -123 * F16_MAX
    assert y[3] == y[4]                     # NaN decodes like the zeros after it (the entry nearest 0)
    # nuq: the outlier's f16 saturates; an all-NaN block keeps 0 as its outlier
    b = nuq.quantize_blocks(blk(-1e6, 3.0), "nuq3o")
    assert b.oi[0] == 0 and float(b.ov[0]) == -F16_MAX
    b = nuq.quantize_blocks(np.full(64, np.nan, np.float32), "nuq2o")
    assert float(b.ov[0]) == 0 and float(b.d[0]) == 0 and (nuq.dequantize_blocks(b) == 0).all()
    # nuq: a scale below f16's range (d <= 2^-25) stores 0 and every index as for x = 0
    b = nuq.quantize_blocks(blk(3e-6, -2e-6, n=32), "nuq2")
    assert float(b.d[0]) == 0 and (b.idx == b.idx[0, -1]).all()


def test_stock_types_for_comparison():
    """What stock ggml's reference quantizers do with the same inputs (docs/FORMATS.md): q8_0 and
    q4_0 store an f16 scale that becomes inf, so the whole block decodes to inf / NaN."""
    L = lib()

    def roundtrip(name, x):
        tr = L.ggml_get_type_traits(cache_types.resolve(name))
        out = ffi.new("uint8_t[]", 34)
        tr.from_float_ref(_fp(x), out, 32)
        y = np.empty(32, np.float32)
        tr.to_float(out, _fp(y), 32)
        return y

    row = lambda *v: np.array(list(v) + [0.0] * (32 - len(v)), np.float32)
    for name, big in (("q8_0", 8.4e6), ("q4_0", 5.3e5)):
        assert not np.isfinite(roundtrip(name, row(big, 1.0))).any()
        assert not np.isfinite(roundtrip(name, row(np.inf, 1.0))).any()
    assert np.isfinite(roundtrip("q8_0", row(8.3e6, 1.0))).all() and np.isfinite(roundtrip("q4_0", row(5.2e5))).all()
    assert np.isnan(roundtrip("q8_0", np.array([1.0] * 31 + [np.nan], np.float32))).all()
    # the pykvq types on the same rows: finite
    for x in (row(8.4e6, 1.0), row(np.inf, 1.0), np.array([1.0] * 31 + [np.nan], np.float32)):
        assert np.isfinite(nuq.roundtrip(x, "nuq4")).all()
        assert np.isfinite(bfp.dequantize_row(bfp.quantize_row(x, "bfp4_32"), "bfp4_32")).all()
