// SIMD helpers the bfp and nuq kernels share (native/ggml/cpu/bfp-cpu.c, native/ggml/cpu/nuq-cpu.c): int8 dot products, horizontal
// sums, scaled int8 -> float stores. Each under the guard of the variant that uses it.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if defined(__AVX2__)
// sum of x*y per 4-byte group (sign trick: |x| times y with x's sign), as float
static inline __m256 kvq_dot32_avx2(const __m256i x, const __m256i y) {
    const __m256i ax = _mm256_sign_epi8(x, x);
    const __m256i sy = _mm256_sign_epi8(y, x);
    const __m256i p  = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p);
}
static inline float kvq_hsum_avx2(const __m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
static inline void kvq_store32_avx2(float * y, const __m256i q, const float d) {
    const __m256  vd = _mm256_set1_ps(d);
    const __m128i l  = _mm256_castsi256_si128(q);
    const __m128i h  = _mm256_extracti128_si256(q, 1);
    _mm256_storeu_ps(y +  0, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l))));
    _mm256_storeu_ps(y +  8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8)))));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h))));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h, 8)))));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__)
static inline __m512 kvq_dot64_avx512(const __m512i x, const __m512i y) {
    const __m512i   ax  = _mm512_abs_epi8(x);
    const __mmask64 neg = _mm512_movepi8_mask(x);
    const __m512i   sy  = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
#if defined(__AVX512VNNI__)
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sy);
#else
    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(ax, sy), _mm512_set1_epi16(1));
#endif
    return _mm512_cvtepi32_ps(p);
}
static inline __m512i kvq_join256(const __m256i a, const __m256i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
static inline void kvq_store32_avx512(float * y, const __m256i q, const float d) {
    const __m512 vd = _mm512_set1_ps(d);
    _mm512_storeu_ps(y +  0, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
}
#endif

#if defined(__ARM_NEON) && defined(__aarch64__)
static inline int32x4_t kvq_dot16_neon(int32x4_t acc, const int8x16_t x, const int8x16_t y) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, x, y);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(x),  vget_low_s8(y));
    const int16x8_t hi = vmull_s8(vget_high_s8(x), vget_high_s8(y));
    return vpadalq_s16(vpadalq_s16(acc, lo), hi);
#endif
}
static inline void kvq_store16_neon(float * y, const int8x16_t q, const float d) {
    const int16x8_t l = vmovl_s8(vget_low_s8(q));
    const int16x8_t h = vmovl_s8(vget_high_s8(q));
    vst1q_f32(y +  0, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(l))),  d));
    vst1q_f32(y +  4, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(l))), d));
    vst1q_f32(y +  8, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))),  d));
    vst1q_f32(y + 12, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(h))), d));
}
#endif
