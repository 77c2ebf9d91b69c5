// The element-wise CUDA kernels of native/ggml/cuda/kvq-rows.cuh (SET_ROWS / CPY quantize, the
// dequantize used by CPY and the prefill path), their very source, run on the host under
// cuda_emu/common.cuh and compared byte for byte / bit for bit with the C reference codecs:
// broadcast row indices (I64 and I32), strided sources and destinations, rows left alone.
// Built and run by tests/test_cuda.py.
#include "common.cuh"
#include "kvq-rows.cuh"

#include <cmath>
#include <cstdarg>
#include <cstring>
#include <random>

#include "abort_stub.h"

static std::mt19937 rng(99);
static int failures = 0, checks = 0;

static float gauss() {
    static std::normal_distribution<float> n(0.0f, 1.0f);
    return n(rng);
}

template <ggml_type T> static void ref_quantize(const float * x, uint8_t * y, int n, const int8_t * cb);
template <ggml_type T> static void ref_dequantize(const uint8_t * x, float * y, int n, const int8_t * cb);
#define REF(TYPE, name, block_t)                                                                                           \
    template <> void ref_quantize<TYPE>(const float * x, uint8_t * y, int n, const int8_t *)   { quantize_row_##name##_ref(x, (block_t *) y, n); } \
    template <> void ref_dequantize<TYPE>(const uint8_t * x, float * y, int n, const int8_t *) { dequantize_row_##name((const block_t *) x, y, n); }
REF(GGML_TYPE_BFP4_32, bfp4_32, block_bfp4_32)
REF(GGML_TYPE_BFP4_64, bfp4_64, block_bfp4_64)
REF(GGML_TYPE_BFP8_32, bfp8_32, block_bfp8_32)
REF(GGML_TYPE_Q53_64, q53_64, block_q53_64)
REF(GGML_TYPE_Q42_64, q42_64, block_q42_64)
REF(GGML_TYPE_Q32_64, q32_64, block_q32_64)
// stock q4_0 / q5_0 as a tagged SET_ROWS writes them (least-squares scales); the dequantize kernel does not take them
template <> void ref_quantize<GGML_TYPE_Q4_0>(const float * x, uint8_t * y, int n, const int8_t *) { quantize_row_q4_0_lsq(x, y, n); }
template <> void ref_quantize<GGML_TYPE_Q5_0>(const float * x, uint8_t * y, int n, const int8_t *) { quantize_row_q5_0_lsq(x, y, n); }
#define REF_NUQ(TYPE, name)                                                                                                \
    template <> void ref_quantize<TYPE>(const float * x, uint8_t * y, int n, const int8_t * cb)   { quantize_row_##name##_ref_cb(x, y, n, cb); } \
    template <> void ref_dequantize<TYPE>(const uint8_t * x, float * y, int n, const int8_t * cb) { dequantize_row_##name##_cb(x, y, n, cb); }
REF_NUQ(GGML_TYPE_NUQ4, nuq4)
REF_NUQ(GGML_TYPE_NUQ3, nuq3)
REF_NUQ(GGML_TYPE_NUQ2, nuq2)
REF_NUQ(GGML_TYPE_NUQ3O, nuq3o)
REF_NUQ(GGML_TYPE_NUQ2O, nuq2o)
REF_NUQ(GGML_TYPE_NUQ3_64, nuq3_64)
REF_NUQ(GGML_TYPE_NUQ2_64, nuq2_64)

static void launch_1d(int64_t total, const std::function<void()> & k) {
    emu::launch({ (unsigned) ((total + 127)/128), 1, 1 }, { 128, 1, 1 }, k);
}

template <ggml_type T, typename idx_t>
static void check_set_rows(const char * name, int ne11, int ne12) {
    constexpr int qk = kvq_traits<T>::qk, bs = kvq_traits<T>::bs;
    const int ne00 = 128, ne01 = 5, ne02 = 6, ne03 = 2, n_dst = 9;
    kvq_cb cb = {};
    if (kvq_is_nuq<T>()) {
        const int n = kvq_traits<T>::ncodes;
        for (int i = 0; i < n; ++i) cb.c[i] = (int8_t) (-120 + i*(240/(n - 1)) + (i % 3));
    }
    // src0 f32 with a padded row stride; dst [n_dst rows, ne02, ne03] with padded strides
    const int64_t nb01 = (ne00 + 8)*4, nb02 = nb01*ne01, nb03 = nb02*ne02;
    std::vector<float> src((size_t) nb03*ne03/4);
    for (float & v : src) v = gauss()*4.0f;
    if constexpr (kvq_is_lsq<T>()) {   // the search's edges: NaN and inf, a block of zeros, a tie of |max| (the first wins)
        float * r0 = src.data();
        r0[3] = NAN;
        r0[7] = INFINITY;
        for (int j = 32; j < 64; ++j) r0[j] = 0.0f;
        float * r1 = (float *) ((char *) src.data() + nb01);
        r1[2] = 9.0f;
        r1[9] = -9.0f;
        r1[40] = -1e-30f;
    }
    const int64_t row = (int64_t) ne00/qk*bs, nb1 = row + 3, nb2 = nb1*n_dst, nb3 = nb2*ne02;
    std::vector<uint8_t> dst((size_t) nb3*ne03, 0xAB), want = dst;
    // indices [ne01, ne11, ne12]: distinct destination rows per (i11, i12)
    std::vector<idx_t> idx((size_t) ne01*ne11*ne12);
    for (int c = 0; c < ne11*ne12; ++c) {
        std::vector<int> rows(n_dst);
        for (int i = 0; i < n_dst; ++i) rows[i] = i;
        std::shuffle(rows.begin(), rows.end(), rng);
        for (int i = 0; i < ne01; ++i) idx[(size_t) c*ne01 + i] = (idx_t) rows[i];
    }
    for (int i03 = 0; i03 < ne03; ++i03)
    for (int i02 = 0; i02 < ne02; ++i02)
    for (int i01 = 0; i01 < ne01; ++i01) {
        const int64_t r = idx[((size_t) (i03 % ne12)*ne11 + (i02 % ne11))*ne01 + i01];
        ref_quantize<T>((const float *) ((const char *) src.data() + i01*nb01 + i02*nb02 + i03*nb03),
                        want.data() + r*nb1 + i02*nb2 + i03*nb3, ne00, cb.c);
    }
    const int64_t nblk = ne00/qk, total = nblk*ne01*ne02*ne03;
    launch_1d(total, [&] {
        kvq_quantize_rows<T, idx_t>((const char *) src.data(), (const char *) idx.data(), (char *) dst.data(), cb,
            nblk, ne01, ne02, total, nb01, nb02, nb03, ne11, ne12,
            sizeof(idx_t), (int64_t) sizeof(idx_t)*ne01, (int64_t) sizeof(idx_t)*ne01*ne11, nb1, nb2, nb3);
    });
    ++checks;
    if (dst != want) { ++failures; printf("FAIL set_rows %s ne11=%d ne12=%d\n", name, ne11, ne12); }
    if constexpr (kvq_is_lsq<T>()) {   // the warp-per-block kernel CUDA launches for these types: the same bytes
        std::vector<uint8_t> dst_w(dst.size(), 0xAB);
        emu::launch({ (unsigned) ((total + KVQ_LSQ_WARPS - 1)/KVQ_LSQ_WARPS), 1, 1 }, { WARP_SIZE, KVQ_LSQ_WARPS, 1 }, [&] {
            kvq_quantize_rows_lsq<T, idx_t>((const char *) src.data(), (const char *) idx.data(), (char *) dst_w.data(),
                nblk, ne01, ne02, total, nb01, nb02, nb03, ne11, ne12,
                sizeof(idx_t), (int64_t) sizeof(idx_t)*ne01, (int64_t) sizeof(idx_t)*ne01*ne11, nb1, nb2, nb3);
        });
        ++checks;
        if (dst_w != want) { ++failures; printf("FAIL set_rows (a warp per block) %s ne11=%d ne12=%d\n", name, ne11, ne12); }
    }
    if constexpr (T == GGML_TYPE_Q4_0 || T == GGML_TYPE_Q5_0) {
        return;
    }

    // dequantize the written tensor (strided rows) to f32 and f16, as CPY does
    std::vector<float> got((size_t) ne00*n_dst*ne02*ne03), ref(ne00);
    std::vector<half> goth(got.size());
    const int64_t nchunk = ne00/8, dtotal = nchunk*n_dst*ne02*ne03;
    launch_1d(dtotal, [&] {
        kvq_dequant<T, float>((const char *) dst.data(), got.data(), cb, nchunk, n_dst, ne02, dtotal, nb1, nb2, nb3,
                              ne00*4, (int64_t) ne00*4*n_dst, (int64_t) ne00*4*n_dst*ne02);
    });
    launch_1d(dtotal, [&] {
        kvq_dequant<T, half>((const char *) dst.data(), goth.data(), cb, nchunk, n_dst, ne02, dtotal, nb1, nb2, nb3,
                             ne00*2, (int64_t) ne00*2*n_dst, (int64_t) ne00*2*n_dst*ne02);
    });
    bool ok = true;
    for (int i3 = 0; i3 < ne03; ++i3)
    for (int i2 = 0; i2 < ne02; ++i2)
    for (int i1 = 0; i1 < n_dst; ++i1) {
        const uint8_t * q = want.data() + i1*nb1 + i2*nb2 + i3*nb3;
        if (q[0] == 0xAB && q[1] == 0xAB && q[2] == 0xAB) continue;   // a row SET_ROWS left alone
        ref_dequantize<T>(q, ref.data(), ne00, cb.c);
        const size_t o = (((size_t) i3*ne02 + i2)*n_dst + i1)*ne00;
        for (int i = 0; i < ne00; ++i) {
            ok &= memcmp(&ref[i], &got[o + i], 4) == 0;
            ok &= ggml_kvq_fp32_to_fp16(ref[i]) == goth[o + i].bits;
        }
    }
    ++checks;
    if (!ok) { ++failures; printf("FAIL dequant %s\n", name); }
}

template <ggml_type T>
static void check_type(const char * name) {
    check_set_rows<T, int64_t>(name, 1, 1);
    check_set_rows<T, int64_t>(name, 3, 2);   // indices broadcast over i02 % 3 and i03 % 2
    check_set_rows<T, int32_t>(name, 2, 1);
}

int main() {
    check_type<GGML_TYPE_BFP4_32>("bfp4_32");
    check_type<GGML_TYPE_BFP4_64>("bfp4_64");
    check_type<GGML_TYPE_BFP8_32>("bfp8_32");
    check_type<GGML_TYPE_NUQ4>("nuq4");
    check_type<GGML_TYPE_NUQ3>("nuq3");
    check_type<GGML_TYPE_NUQ2>("nuq2");
    check_type<GGML_TYPE_NUQ3O>("nuq3o");
    check_type<GGML_TYPE_NUQ2O>("nuq2o");
    check_type<GGML_TYPE_NUQ3_64>("nuq3_64");
    check_type<GGML_TYPE_NUQ2_64>("nuq2_64");
    check_type<GGML_TYPE_Q53_64>("q53_64");
    check_type<GGML_TYPE_Q42_64>("q42_64");
    check_type<GGML_TYPE_Q32_64>("q32_64");
    check_type<GGML_TYPE_Q4_0>("q4_0 least squares");
    check_type<GGML_TYPE_Q5_0>("q5_0 least squares");
    printf("checks %d failures %d\n", checks, failures);
    return failures != 0;
}
