// CPU kernels for q53_64 (native/q53.c has the reference): quantize (the reference itself: a cache
// row is written once per token) and K·Q against Q in q8_0. A block of 64 spans two q8_0 blocks; each
// half gives one int32 dot product and one float scale, d5·d8 and d3·d8.
#include "ggml-kvq-cpu.h"

#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// ggml's block_q8_0 (ggml-common.h), restated so this file builds standalone in the tests
typedef struct {
    uint16_t d;
    int8_t   qs[32];
} q53_q8_0;
GGML_KVQ_STATIC_ASSERT(sizeof(q53_q8_0) == 34, "block_q8_0 size");

void quantize_row_q53_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_q53_64_ref(x, (block_q53_64 *) y, k);
}

// the 32 values of each half as int8, offsets removed (q5 - 16, q3 - 4)
static inline void q53_unpack(const block_q53_64 * b, int8_t * v5, int8_t * v3) {
    uint32_t qh5, qh3;
    memcpy(&qh5, b->qh5, 4);
    memcpy(&qh3, b->qh3, 4);
    for (int j = 0; j < 16; ++j) {
        v5[j]      = (int8_t) (((b->qs5[j] & 15) | (((qh5 >> j) & 1) << 4)) - 16);
        v5[j + 16] = (int8_t) (((b->qs5[j] >> 4) | (((qh5 >> (j + 16)) & 1) << 4)) - 16);
    }
    for (int j = 0; j < 32; ++j) {
        v3[j] = (int8_t) ((((b->qs3[j % 8] >> (2*(j / 8))) & 3) | (((qh3 >> j) & 1) << 2)) - 4);
    }
}

// flash attention's K tiles: the reference's values (the same float products), unpacked once, converted 8 at a time
void dequantize_row_q53_64_cpu(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    const block_q53_64 * x = (const block_q53_64 *) vx;
    for (int64_t i = 0; i < k / QK_Q53; ++i) {
        int8_t v[64];
        q53_unpack(x + i, v, v + 32);
        const float d5 = ggml_kvq_f16_bytes(x[i].d5), d3 = ggml_kvq_f16_bytes(x[i].d3);
        float * o = y + i*QK_Q53;
#if defined(__AVX2__)
        for (int j = 0; j < 64; j += 8) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (v + j))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(q, _mm256_set1_ps(j < 32 ? d5 : d3)));
        }
#else
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
#else
    int s = 0;
    for (int j = 0; j < 32; ++j) {
        s += a[j]*b[j];
    }
    return s;
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
        q53_unpack(x + i, v5, v3);
        const float d5 = ggml_kvq_f16_bytes(x[i].d5), d3 = ggml_kvq_f16_bytes(x[i].d3);
        sum += d5*ggml_kvq_fp16_to_fp32(y[2*i].d)*(float) q53_dot32(v5, y[2*i].qs)
             + d3*ggml_kvq_fp16_to_fp32(y[2*i + 1].d)*(float) q53_dot32(v3, y[2*i + 1].qs);
    }
    *s = sum;
}
