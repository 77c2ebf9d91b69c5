// CPU kernels for q53_64, q42_64 and q32_64 (native/ggml/q53.c has the references): quantize (the reference's rows with the SIMD
// scale search of cpu/lsq-cpu.c) and K·Q against Q in q8_0. A block of 64 spans two q8_0 blocks; each
// half gives one int32 dot product and one float scale, d5·d8 and d3·d8. The unpack to int8 runs in registers on AVX2
// and on aarch64 NEON, scalar elsewhere.
#include "ggml-kvq-cpu.h"

#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define Q53_NEON 1
#endif

// ggml's block_q8_0 (ggml-common.h), restated so this file builds standalone in the tests
typedef struct {
    uint16_t d;
    int8_t   qs[32];
} q53_q8_0;
GGML_KVQ_STATIC_ASSERT(sizeof(q53_q8_0) == 34, "block_q8_0 size");

void quantize_row_q53_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_kvq_quantize_row_q53_64_with(x, (block_q53_64 *) y, k, ggml_kvq_cpu_lsq_block);   // the reference's bits
}

// the family's shared halves (native/ggml/q53.c): 32 values of 2 bits (qs: byte j, bits 2k..2k+1 = value j + 8k;
// q42_64, q32_64) or of 3 bits (those low bits, the high bit as bit i of the 32-bit word qh; q53_64, q32_64), as
// int8 with the offset removed (q2 - 2, q3 - 4)
static inline void q53_half2(const uint8_t * qs, int8_t * v) {
    for (int j = 0; j < 32; ++j) {
        v[j] = (int8_t) (((qs[j % 8] >> (2*(j / 8))) & 3) - 2);
    }
}

static inline void q53_half3(const uint8_t * qs, const uint8_t * qh, int8_t * v) {
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int j = 0; j < 32; ++j) {
        v[j] = (int8_t) ((((qs[j % 8] >> (2*(j / 8))) & 3) | (((h >> j) & 1) << 2)) - 4);
    }
}

// the 32 values of each half as int8, offsets removed (q5 - 16, q3 - 4)
static inline void q53_unpack(const block_q53_64 * b, int8_t * v5, int8_t * v3) {
    uint32_t qh5;
    memcpy(&qh5, b->qh5, 4);
    for (int j = 0; j < 16; ++j) {
        v5[j]      = (int8_t) (((b->qs5[j] & 15) | (((qh5 >> j) & 1) << 4)) - 16);
        v5[j + 16] = (int8_t) (((b->qs5[j] >> 4) | (((qh5 >> (j + 16)) & 1) << 4)) - 16);
    }
    q53_half3(b->qs3, b->qh3, v3);
}

#if defined(__AVX2__)
// 32 bits of w as 32 bytes, 0xFF where the bit is set (lane j: bit j)
static inline __m256i q53_bits_to_bytes(uint32_t w) {
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int) w), which);   // lane j: byte j/8 of w
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}

// the 32 2-bit fields of a half (value 8k + j: bits 2k..2k+1 of byte j) as 32 bytes 0..3
static inline __m256i q53_pairs_avx2(const uint8_t * qs) {
    uint64_t w;
    memcpy(&w, qs, 8);
    const uint64_t m2 = 0x0303030303030303ULL;
    return _mm256_set_epi64x((long long) ((w >> 6) & m2), (long long) ((w >> 4) & m2),
                             (long long) ((w >> 2) & m2), (long long) (w & m2));
}

// q53_half2 / q53_half3 in registers
static inline __m256i q53_half2_avx2(const uint8_t * qs) {
    return _mm256_sub_epi8(q53_pairs_avx2(qs), _mm256_set1_epi8(2));
}

static inline __m256i q53_half3_avx2(const uint8_t * qs, const uint8_t * qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_sub_epi8(_mm256_or_si256(q53_pairs_avx2(qs), _mm256_and_si256(q53_bits_to_bytes(h), _mm256_set1_epi8(4))),
                           _mm256_set1_epi8(4));
}

// the two halves as 32 int8 each, offsets removed (q5 - 16 in [-16, 15], q3 - 4 in [-4, 3]): q53_unpack in registers
static inline void q53_unpack_avx2(const block_q53_64 * b, __m256i * v5, __m256i * v3) {
    uint32_t qh5;
    memcpy(&qh5, b->qh5, 4);
    const __m128i nib = _mm_loadu_si128((const __m128i *) b->qs5);
    const __m256i lo4 = _mm256_set1_epi8(15);
    const __m256i q5 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), lo4);    // values 0..15 | 16..31
    *v5 = _mm256_sub_epi8(_mm256_or_si256(q5, _mm256_and_si256(q53_bits_to_bytes(qh5), _mm256_set1_epi8(16))),
                          _mm256_set1_epi8(16));
    *v3 = q53_half3_avx2(b->qs3, b->qh3);
}

// 32 int8 lanes times d into 32 floats
static inline void q53_store_scaled(__m256i v, float d, float * o) {
    const __m256 vd = _mm256_set1_ps(d);
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    _mm256_storeu_ps(o +  0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vd));
    _mm256_storeu_ps(o +  8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vd));
    _mm256_storeu_ps(o + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vd));
    _mm256_storeu_ps(o + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vd));
}
#endif

#if defined(Q53_NEON)
// 32 bits of w as 2 x 16 bytes, 0xFF where the bit is set (byte j: bit j)
static inline void q53_bits_to_bytes_neon(uint32_t w, uint8x16_t * lo, uint8x16_t * hi) {
    static const uint8_t bits[16] = { 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128 };
    const uint8x16_t bit = vld1q_u8(bits);
    *lo = vtstq_u8(vcombine_u8(vdup_n_u8((uint8_t) w), vdup_n_u8((uint8_t) (w >> 8))), bit);
    *hi = vtstq_u8(vcombine_u8(vdup_n_u8((uint8_t) (w >> 16)), vdup_n_u8((uint8_t) (w >> 24))), bit);
}

// the 32 low bits of a half of 2-bit fields (value 8k + j: bits 2k..2k+1 of byte j) as 2 x 16 bytes 0..3
static inline void q53_pairs_neon(const uint8_t * qs, uint8x16_t * lo, uint8x16_t * hi) {
    const uint8x8_t b = vld1_u8(qs), m = vdup_n_u8(3);
    *lo = vcombine_u8(vand_u8(b, m), vand_u8(vshr_n_u8(b, 2), m));
    *hi = vcombine_u8(vand_u8(vshr_n_u8(b, 4), m), vshr_n_u8(b, 6));
}

// q53_half2 / q53_half3 in registers: v[0..1] values 0..15, 16..31
static inline void q53_half2_neon(const uint8_t * qs, int8x16_t * v) {
    uint8x16_t l0, l1;
    q53_pairs_neon(qs, &l0, &l1);
    v[0] = vsubq_s8(vreinterpretq_s8_u8(l0), vdupq_n_s8(2));
    v[1] = vsubq_s8(vreinterpretq_s8_u8(l1), vdupq_n_s8(2));
}

static inline void q53_half3_neon(const uint8_t * qs, const uint8_t * qh, int8x16_t * v) {
    uint32_t h;
    memcpy(&h, qh, 4);
    uint8x16_t h0, h1, l0, l1;
    q53_bits_to_bytes_neon(h, &h0, &h1);
    q53_pairs_neon(qs, &l0, &l1);
    const uint8x16_t m4 = vdupq_n_u8(4);
    v[0] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l0, vandq_u8(h0, m4))), vdupq_n_s8(4));
    v[1] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l1, vandq_u8(h1, m4))), vdupq_n_s8(4));
}

// q53_unpack in registers: v5[0..1] values 0..31 (q5 - 16), v3[0..1] values 32..63 (q3 - 4)
static inline void q53_unpack_neon(const block_q53_64 * b, int8x16_t * v5, int8x16_t * v3) {
    uint32_t qh5;
    memcpy(&qh5, b->qh5, 4);
    const uint8x16_t nib = vld1q_u8(b->qs5);
    uint8x16_t h0, h1;
    q53_bits_to_bytes_neon(qh5, &h0, &h1);
    const uint8x16_t m16 = vdupq_n_u8(16);
    v5[0] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(nib, vdupq_n_u8(15)), vandq_u8(h0, m16))), vdupq_n_s8(16));
    v5[1] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(nib, 4), vandq_u8(h1, m16))), vdupq_n_s8(16));
    q53_half3_neon(b->qs3, b->qh3, v3);
}

// q42_unpack in registers: v4[0..1] (q4 - 8), v2[0..1] (q2 - 2)
static inline void q42_unpack_neon(const block_q42_64 * b, int8x16_t * v4, int8x16_t * v2) {
    const uint8x16_t nib = vld1q_u8(b->qs4);
    v4[0] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(nib, vdupq_n_u8(15))), vdupq_n_s8(8));
    v4[1] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(nib, 4)), vdupq_n_s8(8));
    q53_half2_neon(b->qs2, v2);
}

// q32_unpack in registers: v3[0..1] (q3 - 4, q53_64's 3-bit half), v2[0..1] (q2 - 2, q42_64's 2-bit half)
static inline void q32_unpack_neon(const block_q32_64 * b, int8x16_t * v3, int8x16_t * v2) {
    q53_half3_neon(b->qs3, b->qh3, v3);
    q53_half2_neon(b->qs2, v2);
}

// 16 int8 lanes times d into 16 floats (each an exact conversion and one product: the reference's bits)
static inline void q53_store_scaled_neon(int8x16_t v, float d, float * o) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    vst1q_f32(o +  0, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), d));
    vst1q_f32(o +  4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), d));
    vst1q_f32(o +  8, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), d));
    vst1q_f32(o + 12, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), d));
}

// a block's four int8x16 registers (hi half, then lo half) to floats
static inline void q53_store_block_neon(const int8x16_t * hi, const int8x16_t * lo, float d_hi, float d_lo, float * o) {
    q53_store_scaled_neon(hi[0], d_hi, o);
    q53_store_scaled_neon(hi[1], d_hi, o + 16);
    q53_store_scaled_neon(lo[0], d_lo, o + 32);
    q53_store_scaled_neon(lo[1], d_lo, o + 48);
}

static inline void q53_store_int8_neon(const int8x16_t * v, int8_t * o) {
    vst1q_s8(o, v[0]);
    vst1q_s8(o + 16, v[1]);
}
#endif

// flash attention's K tiles: the reference's values (the same float products (q - half)*d), unpacked in registers
void dequantize_row_q53_64_cpu(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_q53_64 * x = (const block_q53_64 *) vx;
    for (int64_t i = 0; i < k / QK_Q53; ++i) {
        const float d5 = ggml_kvq_f16_bytes(x[i].d5), d3 = ggml_kvq_f16_bytes(x[i].d3);
        float * o = y + i*QK_Q53;
#if defined(__AVX2__)
        __m256i v5, v3;
        q53_unpack_avx2(x + i, &v5, &v3);
        q53_store_scaled(v5, d5, o);
        q53_store_scaled(v3, d3, o + 32);
#elif defined(Q53_NEON)
        int8x16_t v5[2], v3[2];
        q53_unpack_neon(x + i, v5, v3);
        q53_store_block_neon(v5, v3, d5, d3, o);
#else
        int8_t v[64];
        q53_unpack(x + i, v, v + 32);
        for (int j = 0; j < 64; ++j) {
            o[j] = (float) v[j]*(j < 32 ? d5 : d3);
        }
#endif
    }
}

static inline int q53_dot32(const int8_t * a, const int8_t * b) {
#if defined(__AVX2__)
    // |a| <= 16, so the pairwise int16 sums of maddubs(|a|, sign(b, a)) cannot saturate
    const __m256i va = _mm256_loadu_si256((const __m256i *) a), vb = _mm256_loadu_si256((const __m256i *) b);
    const __m256i p  = _mm256_maddubs_epi16(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vb, va));
    const __m256i s  = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
    return _mm_cvtsi128_si32(r);
#elif defined(Q53_NEON)
    const int8x16_t a0 = vld1q_s8(a), a1 = vld1q_s8(a + 16), b0 = vld1q_s8(b), b1 = vld1q_s8(b + 16);
#if defined(__ARM_FEATURE_DOTPROD)
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, b0), a1, b1));
#else
    // |a*b| <= 16*128: each int16 product exact, pairwise-widened to int32
    int32x4_t acc = vpaddlq_s16(vmull_s8(vget_low_s8(a0), vget_low_s8(b0)));
    acc = vpadalq_s16(acc, vmull_high_s8(a0, b0));
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a1), vget_low_s8(b1)));
    acc = vpadalq_s16(acc, vmull_high_s8(a1, b1));
    return vaddvq_s32(acc);
#endif
#else
    int s = 0;
    for (int j = 0; j < 32; ++j) {
        s += a[j]*b[j];
    }
    return s;
#endif
}

// one block's K·Q: each half's int32 dot with its q8_0 block, times the two scales (every type of the family)
static inline float q53_block_dot(const int8_t * v_hi, const int8_t * v_lo, float d_hi, float d_lo, const q53_q8_0 * y) {
    return d_hi*ggml_kvq_fp16_to_fp32(y[0].d)*(float) q53_dot32(v_hi, y[0].qs)
         + d_lo*ggml_kvq_fp16_to_fp32(y[1].d)*(float) q53_dot32(v_lo, y[1].qs);
}

// q53_unpack with whichever unpack this build has (K·Q's int8 operands)
static inline void q53_unpack_int8(const block_q53_64 * b, int8_t * v5, int8_t * v3) {
#if defined(__AVX2__)
    __m256i r5, r3;
    q53_unpack_avx2(b, &r5, &r3);
    _mm256_storeu_si256((__m256i *) v5, r5);
    _mm256_storeu_si256((__m256i *) v3, r3);
#elif defined(Q53_NEON)
    int8x16_t r5[2], r3[2];
    q53_unpack_neon(b, r5, r3);
    q53_store_int8_neon(r5, v5);
    q53_store_int8_neon(r3, v3);
#else
    q53_unpack(b, v5, v3);
#endif
}

void ggml_vec_dot_q53_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                              const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    const block_q53_64 * x = (const block_q53_64 *) vx;
    const q53_q8_0 * y = (const q53_q8_0 *) vy;
    float sum = 0.0f;
    for (int i = 0; i < n / QK_Q53; ++i) {
        int8_t v5[32], v3[32];
        q53_unpack_int8(x + i, v5, v3);
        sum += q53_block_dot(v5, v3, ggml_kvq_f16_bytes(x[i].d5), ggml_kvq_f16_bytes(x[i].d3), y + 2*i);
    }
    *s = sum;
}

// q42_64: the reference's rows with the SIMD scale search; to_float and K·Q as q53_64's
void quantize_row_q42_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_kvq_quantize_row_q42_64_with(x, (block_q42_64 *) y, k, ggml_kvq_cpu_lsq_block);
}

// the 32 values of each half as int8, offsets removed (q4 - 8, q2 - 2)
static inline void q42_unpack(const block_q42_64 * b, int8_t * v4, int8_t * v2) {
    for (int j = 0; j < 16; ++j) {
        v4[j]      = (int8_t) ((b->qs4[j] & 15) - 8);
        v4[j + 16] = (int8_t) ((b->qs4[j] >> 4) - 8);
    }
    q53_half2(b->qs2, v2);
}

#if defined(__AVX2__)
// q42_unpack in registers: the nibbles as q53_64's, the 2-bit values as q53_64's low 3-bit pairs
static inline void q42_unpack_avx2(const block_q42_64 * b, __m256i * v4, __m256i * v2) {
    const __m128i nib = _mm_loadu_si128((const __m128i *) b->qs4);
    const __m256i q4 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(15));
    *v4 = _mm256_sub_epi8(q4, _mm256_set1_epi8(8));
    *v2 = q53_half2_avx2(b->qs2);
}
#endif

void dequantize_row_q42_64_cpu(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_q42_64 * x = (const block_q42_64 *) vx;
    for (int64_t i = 0; i < k / QK_Q42; ++i) {
        const float d4 = ggml_kvq_f16_bytes(x[i].d4), d2 = ggml_kvq_f16_bytes(x[i].d2);
        float * o = y + i*QK_Q42;
#if defined(__AVX2__)
        __m256i v4, v2;
        q42_unpack_avx2(x + i, &v4, &v2);
        q53_store_scaled(v4, d4, o);
        q53_store_scaled(v2, d2, o + 32);
#elif defined(Q53_NEON)
        int8x16_t v4[2], v2[2];
        q42_unpack_neon(x + i, v4, v2);
        q53_store_block_neon(v4, v2, d4, d2, o);
#else
        int8_t v[64];
        q42_unpack(x + i, v, v + 32);
        for (int j = 0; j < 32; ++j) {
            o[j]      = (float) v[j]*d4;
            o[j + 32] = (float) v[j + 32]*d2;
        }
#endif
    }
}

// q42_unpack with whichever unpack this build has
static inline void q42_unpack_int8(const block_q42_64 * b, int8_t * v4, int8_t * v2) {
#if defined(__AVX2__)
    __m256i r4, r2;
    q42_unpack_avx2(b, &r4, &r2);
    _mm256_storeu_si256((__m256i *) v4, r4);
    _mm256_storeu_si256((__m256i *) v2, r2);
#elif defined(Q53_NEON)
    int8x16_t r4[2], r2[2];
    q42_unpack_neon(b, r4, r2);
    q53_store_int8_neon(r4, v4);
    q53_store_int8_neon(r2, v2);
#else
    q42_unpack(b, v4, v2);
#endif
}

void ggml_vec_dot_q42_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                              const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    const block_q42_64 * x = (const block_q42_64 *) vx;
    const q53_q8_0 * y = (const q53_q8_0 *) vy;
    float sum = 0.0f;
    for (int i = 0; i < n / QK_Q42; ++i) {
        int8_t v4[32], v2[32];
        q42_unpack_int8(x + i, v4, v2);
        sum += q53_block_dot(v4, v2, ggml_kvq_f16_bytes(x[i].d4), ggml_kvq_f16_bytes(x[i].d2), y + 2*i);
    }
    *s = sum;
}

// q32_64: the reference's rows with the SIMD scale search; to_float and K·Q as q53_64's
void quantize_row_q32_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_kvq_quantize_row_q32_64_with(x, (block_q32_64 *) y, k, ggml_kvq_cpu_lsq_block);
}

// the 32 values of each half as int8, offsets removed (q3 - 4, q2 - 2)
static inline void q32_unpack(const block_q32_64 * b, int8_t * v3, int8_t * v2) {
    q53_half3(b->qs3, b->qh3, v3);
    q53_half2(b->qs2, v2);
}

#if defined(__AVX2__)
// q32_unpack in registers: the 3-bit half as q53_64's, the 2-bit half as q42_64's
static inline void q32_unpack_avx2(const block_q32_64 * b, __m256i * v3, __m256i * v2) {
    *v3 = q53_half3_avx2(b->qs3, b->qh3);
    *v2 = q53_half2_avx2(b->qs2);
}
#endif

void dequantize_row_q32_64_cpu(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_q32_64 * x = (const block_q32_64 *) vx;
    for (int64_t i = 0; i < k / QK_Q32; ++i) {
        const float d3 = ggml_kvq_f16_bytes(x[i].d3), d2 = ggml_kvq_f16_bytes(x[i].d2);
        float * o = y + i*QK_Q32;
#if defined(__AVX2__)
        __m256i v3, v2;
        q32_unpack_avx2(x + i, &v3, &v2);
        q53_store_scaled(v3, d3, o);
        q53_store_scaled(v2, d2, o + 32);
#elif defined(Q53_NEON)
        int8x16_t v3[2], v2[2];
        q32_unpack_neon(x + i, v3, v2);
        q53_store_block_neon(v3, v2, d3, d2, o);
#else
        int8_t v[64];
        q32_unpack(x + i, v, v + 32);
        for (int j = 0; j < 32; ++j) {
            o[j]      = (float) v[j]*d3;
            o[j + 32] = (float) v[j + 32]*d2;
        }
#endif
    }
}

// q32_unpack with whichever unpack this build has
static inline void q32_unpack_int8(const block_q32_64 * b, int8_t * v3, int8_t * v2) {
#if defined(__AVX2__)
    __m256i r3, r2;
    q32_unpack_avx2(b, &r3, &r2);
    _mm256_storeu_si256((__m256i *) v3, r3);
    _mm256_storeu_si256((__m256i *) v2, r2);
#elif defined(Q53_NEON)
    int8x16_t r3[2], r2[2];
    q32_unpack_neon(b, r3, r2);
    q53_store_int8_neon(r3, v3);
    q53_store_int8_neon(r2, v2);
#else
    q32_unpack(b, v3, v2);
#endif
}

void ggml_vec_dot_q32_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                              const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    const block_q32_64 * x = (const block_q32_64 *) vx;
    const q53_q8_0 * y = (const q53_q8_0 *) vy;
    float sum = 0.0f;
    for (int i = 0; i < n / QK_Q32; ++i) {
        int8_t v3[32], v2[32];
        q32_unpack_int8(x + i, v3, v2);
        sum += q53_block_dot(v3, v2, ggml_kvq_f16_bytes(x[i].d3), ggml_kvq_f16_bytes(x[i].d2), y + 2*i);
    }
    *s = sum;
}
