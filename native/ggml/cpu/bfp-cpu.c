// CPU kernels for the block floating point cache types.
//
// K·Q runs on integers: K blocks (bfp4_32 / bfp4_64 / bfp8_32) against Q
// quantized to bfp8_32, one int32 dot product and one float scale per block
// (the scale is the product of two powers of two, i.e. an exponent add).
// Every variant below is compiled when the target allows it and is exported
// through ggml_kvq_cpu_impl_*() so the tests check each against the reference.
#include "ggml-kvq-cpu.h"
#include "kvq-simd.h"

#include <math.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define BFP_VEC_DOT_ARGS int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                         const void * GGML_RESTRICT vy, size_t by, int nrc
#define BFP_UNUSED_ARGS (void) bs; (void) bx; (void) by; (void) nrc

// from_float: the reference rule (a cache write quantizes one token's row, so
// this is off the hot path; keeping it the reference makes it exact by construction)
void quantize_row_bfp4_32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_bfp4_32_ref(x, (block_bfp4_32 *) y, k);
}
void quantize_row_bfp4_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_bfp4_64_ref(x, (block_bfp4_64 *) y, k);
}
void quantize_row_bfp8_32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_bfp8_32_ref(x, (block_bfp8_32 *) y, k);
}

#define E8(e) ggml_kvq_e8m0_to_fp32(e)

//
// generic (scalar)
//

// GCC 12's loop vectorizer with AVX512-VNNI turns the bfp4_64 loop into a dot
// product that drops the -8 offset (found by native/tests/bfp_check.c); the
// scalar code is the reference for the SIMD paths, so keep it scalar.
#if defined(__GNUC__) && !defined(__clang__)
#define BFP_SCALAR __attribute__((optimize("no-tree-loop-vectorize")))
#else
#define BFP_SCALAR
#endif

BFP_SCALAR static void vec_dot_bfp4_32_bfp8_32_generic(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp4_32 * x = vx;
    const block_bfp8_32 * y = vy;
    float sumf = 0.0f;
    for (int i = 0; i < n / QK_BFP32; ++i) {
        int isum = 0;
        for (int j = 0; j < QK_BFP32/2; ++j) {
            isum += ((x[i].qs[j] & 0x0F) - 8) * y[i].qs[j];
            isum += ((x[i].qs[j] >>   4) - 8) * y[i].qs[j + QK_BFP32/2];
        }
        sumf += (float) isum * (E8(x[i].e) * E8(y[i].e));
    }
    *s = sumf;
}

BFP_SCALAR static void vec_dot_bfp4_64_bfp8_32_generic(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp4_64 * x = vx;
    const block_bfp8_32 * y = vy;
    float sumf = 0.0f;
    for (int i = 0; i < n / QK_BFP64; ++i) {
        int lo = 0, hi = 0;
        for (int j = 0; j < QK_BFP64/2; ++j) {
            lo += ((x[i].qs[j] & 0x0F) - 8) * y[2*i + 0].qs[j];
            hi += ((x[i].qs[j] >>   4) - 8) * y[2*i + 1].qs[j];
        }
        sumf += (float) lo * (E8(x[i].e) * E8(y[2*i + 0].e)) + (float) hi * (E8(x[i].e) * E8(y[2*i + 1].e));
    }
    *s = sumf;
}

BFP_SCALAR static void vec_dot_bfp8_32_bfp8_32_generic(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp8_32 * x = vx;
    const block_bfp8_32 * y = vy;
    float sumf = 0.0f;
    for (int i = 0; i < n / QK_BFP32; ++i) {
        int isum = 0;
        for (int j = 0; j < QK_BFP32; ++j) {
            isum += x[i].qs[j] * y[i].qs[j];
        }
        sumf += (float) isum * (E8(x[i].e) * E8(y[i].e));
    }
    *s = sumf;
}

static void dequantize_row_bfp4_32_generic(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    dequantize_row_bfp4_32(x, y, k);
}
static void dequantize_row_bfp4_64_generic(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    dequantize_row_bfp4_64(x, y, k);
}
static void dequantize_row_bfp8_32_generic(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    dequantize_row_bfp8_32(x, y, k);
}

//
// AVX2: sign trick (|x| * sign(y, x)) so maddubs can multiply signed by signed
//

#if defined(__AVX2__)
static inline __m256i bfp_nibbles_avx2(const __m128i b) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    return _mm256_sub_epi8(_mm256_insertf128_si256(_mm256_castsi128_si256(lo), hi, 1), _mm256_set1_epi8(8));
}

// bfp4_64: 32 bytes -> elements 0..31 (low nibbles) and 32..63 (high nibbles)
static inline void bfp_nibbles64_avx2(const uint8_t * qs, __m256i * lo, __m256i * hi) {
    const __m256i b  = _mm256_loadu_si256((const __m256i *) qs);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i o8 = _mm256_set1_epi8(8);
    *lo = _mm256_sub_epi8(_mm256_and_si256(b, m4), o8);
    *hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), o8);
}

static void vec_dot_bfp4_32_bfp8_32_avx2(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp4_32 * x = vx;
    const block_bfp8_32 * y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_BFP32; ++i) {
        const __m256i qx = bfp_nibbles_avx2(_mm_loadu_si128((const __m128i *) x[i].qs));
        const __m256i qy = _mm256_loadu_si256((const __m256i *) y[i].qs);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(E8(x[i].e) * E8(y[i].e)), kvq_dot32_avx2(qx, qy), acc);
    }
    *s = kvq_hsum_avx2(acc);
}

static void vec_dot_bfp4_64_bfp8_32_avx2(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp4_64 * x = vx;
    const block_bfp8_32 * y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_BFP64; ++i) {
        __m256i lo, hi;
        bfp_nibbles64_avx2(x[i].qs, &lo, &hi);
        const float dx = E8(x[i].e);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dx * E8(y[2*i + 0].e)),
                              kvq_dot32_avx2(lo, _mm256_loadu_si256((const __m256i *) y[2*i + 0].qs)), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dx * E8(y[2*i + 1].e)),
                              kvq_dot32_avx2(hi, _mm256_loadu_si256((const __m256i *) y[2*i + 1].qs)), acc);
    }
    *s = kvq_hsum_avx2(acc);
}

static void vec_dot_bfp8_32_bfp8_32_avx2(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp8_32 * x = vx;
    const block_bfp8_32 * y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_BFP32; ++i) {
        const __m256i qx = _mm256_loadu_si256((const __m256i *) x[i].qs);
        const __m256i qy = _mm256_loadu_si256((const __m256i *) y[i].qs);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(E8(x[i].e) * E8(y[i].e)), kvq_dot32_avx2(qx, qy), acc);
    }
    *s = kvq_hsum_avx2(acc);
}

// The dequantizers' loops, shared by AVX2 and AVX-512; only the 32-value store differs
// (the store is a constant argument of an inlined function: no indirect call remains).
typedef void (*bfp_store32_x86_t)(float * y, __m256i q, float d);

static inline void bfp4_32_to_float_x86(const block_bfp4_32 * x, float * y, int64_t k, bfp_store32_x86_t store) {
    for (int64_t i = 0; i < k / QK_BFP32; ++i) {
        store(y + i*QK_BFP32, bfp_nibbles_avx2(_mm_loadu_si128((const __m128i *) x[i].qs)), E8(x[i].e));
    }
}

static inline void bfp4_64_to_float_x86(const block_bfp4_64 * x, float * y, int64_t k, bfp_store32_x86_t store) {
    for (int64_t i = 0; i < k / QK_BFP64; ++i) {
        __m256i lo, hi;
        bfp_nibbles64_avx2(x[i].qs, &lo, &hi);
        store(y + i*QK_BFP64,      lo, E8(x[i].e));
        store(y + i*QK_BFP64 + 32, hi, E8(x[i].e));
    }
}

static inline void bfp8_32_to_float_x86(const block_bfp8_32 * x, float * y, int64_t k, bfp_store32_x86_t store) {
    for (int64_t i = 0; i < k / QK_BFP32; ++i) {
        store(y + i*QK_BFP32, _mm256_loadu_si256((const __m256i *) x[i].qs), E8(x[i].e));
    }
}

static void dequantize_row_bfp4_32_avx2(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    bfp4_32_to_float_x86(x, y, k, kvq_store32_avx2);
}
static void dequantize_row_bfp4_64_avx2(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    bfp4_64_to_float_x86(x, y, k, kvq_store32_avx2);
}
static void dequantize_row_bfp8_32_avx2(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    bfp8_32_to_float_x86(x, y, k, kvq_store32_avx2);
}
#endif // __AVX2__

//
// AVX-512 (BW + VL, VNNI when present): two 32-blocks per 512-bit register;
// int32 lanes 0-7 belong to the first block, 8-15 to the second.
//

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__)
#define BFP_HAVE_AVX512 1

static inline __m512 bfp_scales2(const float d0, const float d1) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
}

// The three dot products differ only in how x's 32-value blocks load as int8 lanes and where their scales live:
// bfp_dot_pairs_avx512 takes two blocks a step (against two bfp8_32 blocks of y), each type gives its loaders.
typedef __m512i (*bfp_x2_avx512_t)(const void * vx, int j);   // x's 32-value blocks j, j + 1 as 64 int8 lanes
typedef float   (*bfp_xe_t)(const void * vx, int j);          // the scale of x's 32-value block j

static inline float bfp_dot_pairs_avx512(const void * vx, const block_bfp8_32 * y, const int nb,
                                         const bfp_x2_avx512_t x2, const bfp_xe_t xe) {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j + 1 < nb; j += 2) {
        const __m512i qy = kvq_join256(_mm256_loadu_si256((const __m256i *) y[j + 0].qs),
                                       _mm256_loadu_si256((const __m256i *) y[j + 1].qs));
        const __m512  d  = bfp_scales2(xe(vx, j) * E8(y[j].e), xe(vx, j + 1) * E8(y[j + 1].e));
        acc = _mm512_fmadd_ps(d, kvq_dot64_avx512(x2(vx, j), qy), acc);
    }
    return _mm512_reduce_add_ps(acc);   // an odd last block is the caller's
}

static inline __m512i bfp4_32_x2_avx512(const void * vx, int j) {
    const block_bfp4_32 * x = (const block_bfp4_32 *) vx + j;
    return kvq_join256(bfp_nibbles_avx2(_mm_loadu_si128((const __m128i *) x[0].qs)),
                       bfp_nibbles_avx2(_mm_loadu_si128((const __m128i *) x[1].qs)));
}
static inline __m512i bfp4_64_x2_avx512(const void * vx, int j) {   // j even: one bfp4_64 block
    __m256i lo, hi;
    bfp_nibbles64_avx2(((const block_bfp4_64 *) vx)[j/2].qs, &lo, &hi);
    return kvq_join256(lo, hi);
}
static inline __m512i bfp8_32_x2_avx512(const void * vx, int j) {
    const block_bfp8_32 * x = (const block_bfp8_32 *) vx + j;
    return kvq_join256(_mm256_loadu_si256((const __m256i *) x[0].qs), _mm256_loadu_si256((const __m256i *) x[1].qs));
}
static inline float bfp4_32_e(const void * vx, int j) { return E8(((const block_bfp4_32 *) vx)[j].e); }
static inline float bfp4_64_e(const void * vx, int j) { return E8(((const block_bfp4_64 *) vx)[j/2].e); }
static inline float bfp8_32_e(const void * vx, int j) { return E8(((const block_bfp8_32 *) vx)[j].e); }

// a 32-value type: pairs of blocks, then an odd last one by the AVX2 kernel
#define BFP_VEC_DOT_AVX512_32(T)                                                                          \
static void vec_dot_##T##_bfp8_32_avx512(BFP_VEC_DOT_ARGS) {                                               \
    BFP_UNUSED_ARGS;                                                                                       \
    const int nb = n / QK_BFP32;                                                                           \
    float sumf = bfp_dot_pairs_avx512(vx, (const block_bfp8_32 *) vy, nb, T##_x2_avx512, T##_e);           \
    if (nb & 1) {                                                                                          \
        float t;                                                                                           \
        vec_dot_##T##_bfp8_32_avx2(QK_BFP32, &t, 0, (const block_##T *) vx + nb - 1, 0,                    \
                                   (const block_bfp8_32 *) vy + nb - 1, 0, 1);                             \
        sumf += t;                                                                                         \
    }                                                                                                      \
    *s = sumf;                                                                                             \
}
BFP_VEC_DOT_AVX512_32(bfp4_32)
BFP_VEC_DOT_AVX512_32(bfp8_32)

static void vec_dot_bfp4_64_bfp8_32_avx512(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    *s = bfp_dot_pairs_avx512(vx, (const block_bfp8_32 *) vy, n / QK_BFP32, bfp4_64_x2_avx512, bfp4_64_e);
}

static void dequantize_row_bfp4_32_avx512(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    bfp4_32_to_float_x86(x, y, k, kvq_store32_avx512);
}
static void dequantize_row_bfp4_64_avx512(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    bfp4_64_to_float_x86(x, y, k, kvq_store32_avx512);
}
static void dequantize_row_bfp8_32_avx512(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    bfp8_32_to_float_x86(x, y, k, kvq_store32_avx512);
}
#endif // AVX-512

//
// NEON (sdot when the target has it)
//

#if defined(__ARM_NEON) && defined(__aarch64__)

static inline void bfp_nibbles_neon(const uint8_t * qs, int8x16_t * lo, int8x16_t * hi) {
    const uint8x16_t b = vld1q_u8(qs);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), vdupq_n_s8(8));
    *hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), vdupq_n_s8(8));
}

static void vec_dot_bfp4_32_bfp8_32_neon(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp4_32 * x = vx;
    const block_bfp8_32 * y = vy;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int i = 0; i < n / QK_BFP32; ++i) {
        int8x16_t lo, hi;
        bfp_nibbles_neon(x[i].qs, &lo, &hi);
        int32x4_t p = kvq_dot16_neon(vdupq_n_s32(0), lo, vld1q_s8(y[i].qs));
        p = kvq_dot16_neon(p, hi, vld1q_s8(y[i].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), E8(x[i].e) * E8(y[i].e));
    }
    *s = vaddvq_f32(acc);
}

static void vec_dot_bfp4_64_bfp8_32_neon(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp4_64 * x = vx;
    const block_bfp8_32 * y = vy;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int i = 0; i < n / QK_BFP64; ++i) {
        int8x16_t lo0, hi0, lo1, hi1;
        bfp_nibbles_neon(x[i].qs,      &lo0, &hi0);
        bfp_nibbles_neon(x[i].qs + 16, &lo1, &hi1);
        int32x4_t a = kvq_dot16_neon(vdupq_n_s32(0), lo0, vld1q_s8(y[2*i].qs));
        a = kvq_dot16_neon(a, lo1, vld1q_s8(y[2*i].qs + 16));
        int32x4_t b = kvq_dot16_neon(vdupq_n_s32(0), hi0, vld1q_s8(y[2*i + 1].qs));
        b = kvq_dot16_neon(b, hi1, vld1q_s8(y[2*i + 1].qs + 16));
        const float dx = E8(x[i].e);
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(a), dx * E8(y[2*i].e));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(b), dx * E8(y[2*i + 1].e));
    }
    *s = vaddvq_f32(acc);
}

static void vec_dot_bfp8_32_bfp8_32_neon(BFP_VEC_DOT_ARGS) {
    BFP_UNUSED_ARGS;
    const block_bfp8_32 * x = vx;
    const block_bfp8_32 * y = vy;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int i = 0; i < n / QK_BFP32; ++i) {
        int32x4_t p = kvq_dot16_neon(vdupq_n_s32(0), vld1q_s8(x[i].qs), vld1q_s8(y[i].qs));
        p = kvq_dot16_neon(p, vld1q_s8(x[i].qs + 16), vld1q_s8(y[i].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), E8(x[i].e) * E8(y[i].e));
    }
    *s = vaddvq_f32(acc);
}


static void dequantize_row_bfp4_32_neon(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_bfp4_32 * x = vx;
    for (int64_t i = 0; i < k / QK_BFP32; ++i, y += QK_BFP32) {
        int8x16_t lo, hi;
        bfp_nibbles_neon(x[i].qs, &lo, &hi);
        kvq_store16_neon(y,      lo, E8(x[i].e));
        kvq_store16_neon(y + 16, hi, E8(x[i].e));
    }
}

static void dequantize_row_bfp4_64_neon(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_bfp4_64 * x = vx;
    for (int64_t i = 0; i < k / QK_BFP64; ++i, y += QK_BFP64) {
        int8x16_t lo0, hi0, lo1, hi1;
        bfp_nibbles_neon(x[i].qs,      &lo0, &hi0);
        bfp_nibbles_neon(x[i].qs + 16, &lo1, &hi1);
        const float d = E8(x[i].e);
        kvq_store16_neon(y,      lo0, d);
        kvq_store16_neon(y + 16, lo1, d);
        kvq_store16_neon(y + 32, hi0, d);
        kvq_store16_neon(y + 48, hi1, d);
    }
}

static void dequantize_row_bfp8_32_neon(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_bfp8_32 * x = vx;
    for (int64_t i = 0; i < k / QK_BFP32; ++i, y += QK_BFP32) {
        kvq_store16_neon(y,      vld1q_s8(x[i].qs),      E8(x[i].e));
        kvq_store16_neon(y + 16, vld1q_s8(x[i].qs + 16), E8(x[i].e));
    }
}
#endif // NEON

//
// variant table: generic first, the best compiled variant last
//

struct bfp_impl {
    const char *    name;
    ggml_vec_dot_t  vec_dot[3];   // bfp4_32, bfp4_64, bfp8_32
    ggml_to_float_t to_float[3];
};

#define BFP_IMPL(name, sfx) { name, \
    { vec_dot_bfp4_32_bfp8_32_##sfx, vec_dot_bfp4_64_bfp8_32_##sfx, vec_dot_bfp8_32_bfp8_32_##sfx }, \
    { dequantize_row_bfp4_32_##sfx,  dequantize_row_bfp4_64_##sfx,  dequantize_row_bfp8_32_##sfx } }

static const struct bfp_impl bfp_impls[] = {
    BFP_IMPL("generic", generic),
#if defined(__AVX2__)
    BFP_IMPL("avx2", avx2),
#endif
#if defined(BFP_HAVE_AVX512)
#if defined(__AVX512VNNI__)
    BFP_IMPL("avx512vnni", avx512),
#else
    BFP_IMPL("avx512", avx512),
#endif
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#if defined(__ARM_FEATURE_DOTPROD)
    BFP_IMPL("neon-dotprod", neon),
#else
    BFP_IMPL("neon", neon),
#endif
#endif
};

#define BFP_N_IMPLS ((int) (sizeof(bfp_impls) / sizeof(bfp_impls[0])))
#define BFP_BEST (&bfp_impls[BFP_N_IMPLS - 1])

static int bfp_slot(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_BFP4_32: return 0;
        case GGML_TYPE_BFP4_64: return 1;
        case GGML_TYPE_BFP8_32: return 2;
        default:                return -1;
    }
}

void ggml_vec_dot_bfp4_32_bfp8_32(BFP_VEC_DOT_ARGS) { BFP_BEST->vec_dot[0](n, s, bs, vx, bx, vy, by, nrc); }
void ggml_vec_dot_bfp4_64_bfp8_32(BFP_VEC_DOT_ARGS) { BFP_BEST->vec_dot[1](n, s, bs, vx, bx, vy, by, nrc); }
void ggml_vec_dot_bfp8_32_bfp8_32(BFP_VEC_DOT_ARGS) { BFP_BEST->vec_dot[2](n, s, bs, vx, bx, vy, by, nrc); }

// the bfp family's variant table, for native/ggml/cpu/kvq-dispatch.c (the same variants, in the same order, as
// cpu/nuq-cpu.c's)

int ggml_kvq_bfp_cpu_n_impls(void) {
    return BFP_N_IMPLS;
}

const char * ggml_kvq_bfp_cpu_impl_name(int i) {
    return i >= 0 && i < BFP_N_IMPLS ? bfp_impls[i].name : NULL;
}

ggml_vec_dot_t ggml_kvq_bfp_cpu_impl_vec_dot(int i, enum ggml_type type) {
    const int slot = bfp_slot(type);
    return i >= 0 && i < BFP_N_IMPLS && slot >= 0 ? bfp_impls[i].vec_dot[slot] : NULL;
}

ggml_to_float_t ggml_kvq_bfp_cpu_impl_to_float(int i, enum ggml_type type) {
    const int slot = bfp_slot(type);
    return i >= 0 && i < BFP_N_IMPLS && slot >= 0 ? bfp_impls[i].to_float[slot] : NULL;
}

ggml_from_float_t ggml_kvq_bfp_cpu_impl_from_float(int i, enum ggml_type type) {
    static const ggml_from_float_t bfp_from_float[3] = { quantize_row_bfp4_32, quantize_row_bfp4_64, quantize_row_bfp8_32 };
    const int slot = bfp_slot(type);
    return i >= 0 && i < BFP_N_IMPLS && slot >= 0 ? bfp_from_float[slot] : NULL;  // one quantizer: the reference
}
