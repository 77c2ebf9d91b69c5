// CPU flash attention: decoding a tile's cache rows to f32 (fattn.h).
#include "fattn.h"

namespace kvq_fa {
namespace {

void fa_f16_to_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x, y, n);
}

void fa_f32_copy(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
}

// q8_0 / q4_0 rows with this target's SIMD (ggml-base's to_float is scalar and
// built for the baseline ISA)

#if defined(__AVX2__) && defined(__F16C__)
// 8 int8 -> 8 floats times d
inline void fa_store8(float * y, __m128i q8, __m256 d) {
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d));
}
#endif

void fa_q8_0_to_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    const block_q8_0 * b = (const block_q8_0 *) x;
    for (int64_t i = 0; i < n/QK8_0; ++i, y += QK8_0) {
#if defined(__AVX512F__) && defined(__F16C__)
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
        for (int g = 0; g < 2; ++g) {
            const __m128i q = _mm_loadu_si128((const __m128i *) (b[i].qs + 16*g));
            _mm512_storeu_ps(y + 16*g, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
        }
#elif defined(__AVX2__) && defined(__F16C__)
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        for (int g = 0; g < 4; ++g) {
            fa_store8(y + 8*g, _mm_loadl_epi64((const __m128i *) (b[i].qs + 8*g)), d);
        }
#else
        const float d = GGML_CPU_FP16_TO_FP32(b[i].d);
        for (int j = 0; j < 32; ++j) {
            y[j] = d*(float) b[i].qs[j];
        }
#endif
    }
}

void fa_q4_0_to_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    const block_q4_0 * b = (const block_q4_0 *) x;
    for (int64_t i = 0; i < n/QK4_0; ++i, y += QK4_0) {
#if defined(__AVX512F__) && defined(__F16C__)
        // 16 values a register: half the conversions of the AVX2 form, the same products
        const __m512  d  = _mm512_set1_ps(_cvtsh_ss(b[i].d));
        const __m128i m4 = _mm_set1_epi8(0x0F), c8 = _mm_set1_epi8(8);
        const __m128i q  = _mm_loadu_si128((const __m128i *) b[i].qs);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), c8);                     // values 0..15
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), c8);  // values 16..31
        _mm512_storeu_ps(y,      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d));
#elif defined(__AVX2__) && defined(__F16C__)
        const __m256  d  = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        const __m128i m4 = _mm_set1_epi8(0x0F), c8 = _mm_set1_epi8(8);
        const __m128i q  = _mm_loadu_si128((const __m128i *) b[i].qs);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), c8);                     // values 0..15
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), c8);  // values 16..31
        fa_store8(y +  0, lo, d);
        fa_store8(y +  8, _mm_unpackhi_epi64(lo, lo), d);
        fa_store8(y + 16, hi, d);
        fa_store8(y + 24, _mm_unpackhi_epi64(hi, hi), d);
#else
        const float d = GGML_CPU_FP16_TO_FP32(b[i].d);
        for (int j = 0; j < 16; ++j) {
            y[j]      = d*(float) ((int) (b[i].qs[j] & 0x0F) - 8);
            y[j + 16] = d*(float) ((int) (b[i].qs[j] >>   4) - 8);
        }
#endif
    }
}

}  // namespace

ggml_to_float_t fa_to_float(ggml_type type, bool is_k) {
    switch (type) {
        case GGML_TYPE_F32:  return fa_f32_copy;
        case GGML_TYPE_F16:  return fa_f16_to_f32;
        case GGML_TYPE_Q8_0: return fa_q8_0_to_f32;
        case GGML_TYPE_Q4_0: return fa_q4_0_to_f32;
        default: break;
    }
    if (ggml_to_float_t f = is_k ? ggml_kvq_cpu_to_float_k(type) : ggml_kvq_cpu_to_float(type)) {
        return f;
    }
    return ggml_get_type_traits(type)->to_float;
}

void fa_round_q(ggml_type k_type, float * x, int64_t n, void * tmp) {
    const ggml_type vt = ggml_get_type_traits_cpu(k_type)->vec_dot_type;
    if (vt == GGML_TYPE_F32) {
        return;
    }
    ggml_get_type_traits_cpu(vt)->from_float(x, tmp, n);
    fa_to_float(vt, false)(tmp, x, n);
}

}  // namespace kvq_fa
