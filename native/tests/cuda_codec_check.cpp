// Host build of native/ggml/cuda/kvq-codec.cuh (the block codecs every CUDA kernel of pykvq
// runs) checked against the C reference quantizers, which tests/test_bfp.py and
// test_nuq.py hold to the numpy ones bit for bit. Built and run by tests/test_cuda.py
// on any machine (no GPU needed):
//
//   kvq_quantize_block<T>   bytes equal to quantize_row_<type>_ref[_cb]
//   kvq_dequantize<T, N>    bits equal to dequantize_row_<type>[_cb], N = 2, 4, 8
// for random cache-like rows, edge cases (zeros, NaN, inf, ties, f16-range extremes, values
// beyond f16 / near FLT_MAX, subnormals; docs/FORMATS.md "Edge inputs": decoded rows are finite)
// and, for the nuq types, the fallback and random codebooks.
#include "../ggml/cuda/kvq-codec.cuh"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "abort_stub.h"

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static uint32_t urand() {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t) (rng_state >> 33);
}

static float frand() {
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) {
        s += (float) (urand() & 0xFFFFFF) / 16777216.0f - 0.5f;
    }
    return s;
}

static int failures = 0;
static int checks   = 0;

static void fail(const char * what, const char * type, int row, int i) {
    if (failures < 20) {
        fprintf(stderr, "FAIL %s %s row %d at %d\n", what, type, row, i);
    }
    ++failures;
}

// rows of n values: cache-like, plus one edge case per row
static std::vector<float> make_rows(int n, int nrows) {
    std::vector<float> x((size_t) n * nrows);
    for (int r = 0; r < nrows; ++r) {
        float * y = &x[(size_t) r * n];
        const float scale = ldexpf(1.0f, (int) (urand() % 20) - 12);
        for (int i = 0; i < n; ++i) {
            y[i] = frand() * scale * ((urand() % 50) == 0 ? 30.0f : 1.0f);
        }
        switch (r % 16) {
            case 0: memset(y, 0, sizeof(float) * n); break;
            case 1: y[3] = NAN; y[40 % n] = NAN; break;
            case 2: y[5] = INFINITY; break;
            case 3: y[9] = -INFINITY; y[50 % n] = INFINITY; break;
            case 4: for (int i = 0; i < n; ++i) y[i] = 1.5f; break;
            case 5: for (int i = 0; i < n; ++i) y[i] = (i % 3 - 1) * 0.125f; break;   // exact ties
            case 6: for (int i = 0; i < n; ++i) y[i] = ldexpf(frand(), -20); break;    // tiny (normal)
            case 7: for (int i = 0; i < n; ++i) y[i] = frand() * 60000.0f; break;      // near f16 max
            case 8: y[0] = -y[0] * 1000.0f; break;                                    // one big outlier
            case 9: for (int i = 0; i < n; ++i) y[i] = (float) ((int) (urand() % 15) - 7); break;
            // edge inputs (docs/FORMATS.md): beyond f16 range and near FLT_MAX, f32 subnormals,
            // a scale in f16's subnormal range, all NaN
            case 10: for (int i = 0; i < n; ++i) y[i] = frand() * 1e9f; y[1] = 3.4028235e38f; y[n - 1] = 70000.0f; break;
            case 11: y[0] = INFINITY; y[2] = -3.4e38f; y[33 % n] = 65519.0f; break;
            case 12: for (int i = 0; i < n; ++i) y[i] = frand() * 1e-40f; break;
            case 13: for (int i = 0; i < n; ++i) y[i] = frand() * 3e-6f; break;
            case 14: for (int i = 0; i < n; ++i) y[i] = NAN; break;
            default: break;
        }
    }
    return x;
}

template <ggml_type T>
static void check_type(const char * name, const int8_t * cb,
                       void (*ref_q)(const float *, void *, int64_t, const int8_t *),
                       void (*ref_dq)(const void *, float *, int64_t, const int8_t *)) {
    constexpr int qk = kvq_traits<T>::qk;
    constexpr int bs = kvq_traits<T>::bs;
    const int n     = 128;
    const int nrows = 96;
    const int nb    = n / qk;
    std::vector<float> x = make_rows(n, nrows);
    std::vector<uint8_t> qref((size_t) nb * bs), qgot((size_t) nb * bs);
    std::vector<float> dref(n), dgot(n);
    float c[16] = {0};
    for (int j = 0; j < kvq_traits<T>::ncodes; ++j) {
        c[j] = (float) cb[j];
    }
    for (int r = 0; r < nrows; ++r) {
        const float * xr = &x[(size_t) r * n];
        ref_q(xr, qref.data(), n, cb);
        for (int b = 0; b < nb; ++b) {
            kvq_quantize_block<T>(xr + b*qk, qgot.data() + b*bs, cb);
        }
        ++checks;
        if (memcmp(qref.data(), qgot.data(), qref.size()) != 0) {
            for (size_t i = 0; i < qref.size(); ++i) {
                if (qref[i] != qgot[i]) { fail("quantize", name, r, (int) i); break; }
            }
        }
        ref_dq(qref.data(), dref.data(), n, cb);
        for (int i = 0; i < n; ++i) {   // no quantized block decodes to inf / NaN
            if (!std::isfinite(dref[i])) { fail("finite", name, r, i); break; }
        }
        for (int N : {2, 4, 8}) {
            for (int i0 = 0; i0 < n; i0 += N) {
                switch (N) {
                    case 2: kvq_dequantize<T, 2>(qref.data(), i0, c, &dgot[i0]); break;
                    case 4: kvq_dequantize<T, 4>(qref.data(), i0, c, &dgot[i0]); break;
                    default: kvq_dequantize<T, 8>(qref.data(), i0, c, &dgot[i0]); break;
                }
            }
            ++checks;
            if (memcmp(dref.data(), dgot.data(), sizeof(float) * n) != 0) {
                for (int i = 0; i < n; ++i) {
                    if (memcmp(&dref[i], &dgot[i], 4) != 0) { fail("dequantize", name, r, i); break; }
                }
            }
        }
    }
}

// stock q4_0 / q5_0 with least-squares scales (a tagged SET_ROWS): the quantize bytes only (the kernels that read
// them are ggml-cuda's own)
template <ggml_type T>
static void check_lsq(const char * name, void (*ref_q)(const float *, void *, int64_t)) {
    constexpr int qk = kvq_traits<T>::qk;
    constexpr int bs = kvq_traits<T>::bs;
    const int n = 128, nrows = 96, nb = n / qk;
    std::vector<float> x = make_rows(n, nrows);
    std::vector<uint8_t> qref((size_t) nb * bs), qgot((size_t) nb * bs);
    for (int r = 0; r < nrows; ++r) {
        const float * xr = &x[(size_t) r * n];
        ref_q(xr, qref.data(), n);
        for (int b = 0; b < nb; ++b) {
            kvq_quantize_block<T>(xr + b*qk, qgot.data() + b*bs, nullptr);
        }
        ++checks;
        for (size_t i = 0; i < qref.size(); ++i) {
            if (qref[i] != qgot[i]) { fail("quantize", name, r, (int) i); break; }
        }
    }
}

// the bfp / q53 reference functions have the ggml trait signature; adapt them
#define BFP_ADAPT(name, block_t)                                                                              \
    static void q_##name(const float * x, void * y, int64_t k, const int8_t *) { quantize_row_##name##_ref(x, (block_t *) y, k); } \
    static void dq_##name(const void * x, float * y, int64_t k, const int8_t *) { dequantize_row_##name((const block_t *) x, y, k); }
BFP_ADAPT(bfp4_32, block_bfp4_32)
BFP_ADAPT(bfp4_64, block_bfp4_64)
BFP_ADAPT(bfp8_32, block_bfp8_32)
BFP_ADAPT(q53_64, block_q53_64)
BFP_ADAPT(q42_64, block_q42_64)
BFP_ADAPT(q32_64, block_q32_64)

static void random_codebook(int8_t * cb, int n) {
    for (;;) {
        bool used[255] = {false};
        int k = 0;
        while (k < n) {
            const int v = (int) (urand() % 255) - 127;
            if (!used[v + 127]) { used[v + 127] = true; ++k; }
        }
        k = 0;
        for (int v = 0; v < 255; ++v) {
            if (used[v]) cb[k++] = (int8_t) (v - 127);
        }
        return;
    }
}

template <ggml_type T>
static void check_nuq(const char * name,
                      void (*q)(const float *, void *, int64_t, const int8_t *),
                      void (*dq)(const void *, float *, int64_t, const int8_t *)) {
    constexpr int n = kvq_traits<T>::ncodes;
    check_type<T>(name, ggml_kvq_nuq_fallback(T), q, dq);
    for (int s = 0; s < 4; ++s) {
        int8_t cb[16];
        random_codebook(cb, n);
        check_type<T>(name, cb, q, dq);
    }
}

#if defined(KVQ_CODEC_LIB)
// Built with -DKVQ_CODEC_LIB -shared: the codec as a library, so tests/test_numerics.py can hold it
// to the numpy reference on the rows its property tests draw. cb: the codebook (nuq types).
template <ggml_type T>
static void lib_quantize(const float * x, int n, const int8_t * cb, uint8_t * out) {
    for (int b = 0; b < n / kvq_traits<T>::qk; ++b) {
        kvq_quantize_block<T>(x + b*kvq_traits<T>::qk, out + b*kvq_traits<T>::bs, cb);
    }
}

template <ggml_type T>
static void lib_dequantize(const uint8_t * q, int n, const int8_t * cb, float * out) {
    float c[16] = {0};
    for (int j = 0; j < kvq_traits<T>::ncodes; ++j) {
        c[j] = (float) cb[j];
    }
    for (int i0 = 0; i0 < n; i0 += 8) {
        kvq_dequantize<T, 8>(q, i0, c, out + i0);
    }
}

#define KVQ_LIB_TYPES(X) X(GGML_TYPE_BFP4_32) X(GGML_TYPE_BFP4_64) X(GGML_TYPE_BFP8_32) X(GGML_TYPE_NUQ4) \
                         X(GGML_TYPE_NUQ3) X(GGML_TYPE_NUQ2) X(GGML_TYPE_NUQ3O) X(GGML_TYPE_NUQ2O) \
                         X(GGML_TYPE_Q53_64) X(GGML_TYPE_Q42_64) X(GGML_TYPE_Q32_64) \
                         X(GGML_TYPE_NUQ3_64) X(GGML_TYPE_NUQ2_64)

// 0 on success, -1 for a type the codec does not have
extern "C" int kvq_codec_quantize(int type, const float * x, int n, const int8_t * cb, uint8_t * out) {
    switch (type) {
#define KVQ_LIB_Q(T) case T: lib_quantize<T>(x, n, cb, out); return 0;
        KVQ_LIB_TYPES(KVQ_LIB_Q)
        default: return -1;
    }
}

extern "C" int kvq_codec_dequantize(int type, const uint8_t * q, int n, const int8_t * cb, float * out) {
    switch (type) {
#define KVQ_LIB_DQ(T) case T: lib_dequantize<T>(q, n, cb, out); return 0;
        KVQ_LIB_TYPES(KVQ_LIB_DQ)
        default: return -1;
    }
}
#else
int main() {
    check_type<GGML_TYPE_BFP4_32>("bfp4_32", nullptr, q_bfp4_32, dq_bfp4_32);
    check_type<GGML_TYPE_BFP4_64>("bfp4_64", nullptr, q_bfp4_64, dq_bfp4_64);
    check_type<GGML_TYPE_BFP8_32>("bfp8_32", nullptr, q_bfp8_32, dq_bfp8_32);
    check_nuq<GGML_TYPE_NUQ4>("nuq4", quantize_row_nuq4_ref_cb, dequantize_row_nuq4_cb);
    check_nuq<GGML_TYPE_NUQ3>("nuq3", quantize_row_nuq3_ref_cb, dequantize_row_nuq3_cb);
    check_nuq<GGML_TYPE_NUQ2>("nuq2", quantize_row_nuq2_ref_cb, dequantize_row_nuq2_cb);
    check_nuq<GGML_TYPE_NUQ3O>("nuq3o", quantize_row_nuq3o_ref_cb, dequantize_row_nuq3o_cb);
    check_nuq<GGML_TYPE_NUQ2O>("nuq2o", quantize_row_nuq2o_ref_cb, dequantize_row_nuq2o_cb);
    check_nuq<GGML_TYPE_NUQ3_64>("nuq3_64", quantize_row_nuq3_64_ref_cb, dequantize_row_nuq3_64_cb);
    check_nuq<GGML_TYPE_NUQ2_64>("nuq2_64", quantize_row_nuq2_64_ref_cb, dequantize_row_nuq2_64_cb);
    check_type<GGML_TYPE_Q53_64>("q53_64", nullptr, q_q53_64, dq_q53_64);
    check_type<GGML_TYPE_Q42_64>("q42_64", nullptr, q_q42_64, dq_q42_64);
    check_type<GGML_TYPE_Q32_64>("q32_64", nullptr, q_q32_64, dq_q32_64);
    check_lsq<GGML_TYPE_Q4_0>("q4_0 least squares", quantize_row_q4_0_lsq);
    check_lsq<GGML_TYPE_Q5_0>("q5_0 least squares", quantize_row_q5_0_lsq);
    printf("checks %d failures %d\n", checks, failures);
    return failures != 0;
}
#endif
