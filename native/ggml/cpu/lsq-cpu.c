// CPU encoders with least-squares block scales (native/ggml/lsq.c has the rule): the same bits as the reference, the
// 26 candidate scales side by side in AVX2 registers. A cache row is written once per token, but at decode that
// is one thread's work on the critical path (~3 us a block in scalar code), so the search must be cheap.
#include "../lsq-rule.h"  // first: no fused multiply-add in this file, the intrinsics included
#include "ggml-kvq-cpu.h"

#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>

void ggml_kvq_cpu_lsq_block(const float * x, int half, uint8_t d_out[2], uint8_t * q) {
    enum { N = GGML_KVQ_LSQ_N, NS = GGML_KVQ_LSQ_N_SCALES, NV = (NS + 7)/8 };
    float v[N];
    const float vmax = ggml_kvq_lsq_values(x, v);
    // the candidates' d, 1/d and f16 d (lanes past NS: never read back)
    float id[8*NV];
    uint16_t h[8*NV];
    __m256 vid[NV], vdq[NV];
    __m256d e[2*NV];
    {
        const __m256 base = _mm256_set1_ps(vmax / (float) -half);
        const __m256 lim  = _mm256_set1_ps(65504.0f);
        for (int g = 0; g < NV; ++g) {
            const __m256 f = _mm256_div_ps(_mm256_add_ps(_mm256_set1_ps(35.0f + 8*g), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)),
                                           _mm256_set1_ps(50.0f));
            const __m256 d = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), _mm256_min_ps(lim, _mm256_mul_ps(base, f)));
            const __m256 nz = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_UQ);
            vid[g] = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), d), nz);
#if defined(__F16C__)
            const __m128i hh = _mm256_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT);
            vdq[g] = _mm256_cvtph_ps(hh);
            _mm_storeu_si128((__m128i *) (h + 8*g), hh);
#else
            float dd[8];
            _mm256_storeu_ps(dd, d);
            for (int l = 0; l < 8; ++l) {
                h[8*g + l] = ggml_kvq_fp32_to_fp16(dd[l]);
                dd[l] = ggml_kvq_fp16_to_fp32(h[8*g + l]);
            }
            vdq[g] = _mm256_loadu_ps(dd);
#endif
            _mm256_storeu_ps(id + 8*g, vid[g]);
            e[2*g] = e[2*g + 1] = _mm256_setzero_pd();
        }
    }
    const __m256 c = _mm256_set1_ps((float) half + 0.5f), top = _mm256_set1_ps((float) (2*half - 1));
    const __m256 one = _mm256_set1_ps(1.0f), hv = _mm256_set1_ps((float) half);
    for (int j = 0; j < N; ++j) {
        const __m256  vj = _mm256_set1_ps(v[j]);
        const __m256d vd = _mm256_set1_pd((double) v[j]);
        for (int g = 0; g < NV; ++g) {
            const __m256 t = _mm256_add_ps(_mm256_mul_ps(vj, vid[g]), c);
            // t >= 1 ? min(t, top) : 0 (NaN: 0), then trunc
            const __m256 tc = _mm256_and_ps(_mm256_min_ps(t, top), _mm256_cmp_ps(t, one, _CMP_GE_OQ));
            const __m256 w  = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvttps_epi32(tc)), hv), vdq[g]);
            const __m256d r0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w)), vd);
            const __m256d r1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)), vd);
            e[2*g]     = _mm256_add_pd(e[2*g], _mm256_mul_pd(r0, r0));
            e[2*g + 1] = _mm256_add_pd(e[2*g + 1], _mm256_mul_pd(r1, r1));
        }
    }
    double err[8*NV];
    for (int g = 0; g < 2*NV; ++g) {
        _mm256_storeu_pd(err + 4*g, e[g]);
    }
    ggml_kvq_lsq_store(err, v, id, h, half, d_out, q);
}

#else

void ggml_kvq_cpu_lsq_block(const float * x, int half, uint8_t d_out[2], uint8_t * q) {
    ggml_kvq_lsq_block(x, half, d_out, q);
}

#endif

void quantize_row_q4_0_lsq_cpu(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_kvq_quantize_row_q4_0_with(x, y, k, ggml_kvq_cpu_lsq_block);
}

void quantize_row_q5_0_lsq_cpu(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_kvq_quantize_row_q5_0_with(x, y, k, ggml_kvq_cpu_lsq_block);
}

ggml_from_float_t ggml_kvq_cpu_encoder_from_float(const struct ggml_tensor * dst) {
    if (ggml_kvq_get_encoder(dst) != GGML_KVQ_ENCODER_LSQ) {
        return NULL;
    }
    switch (dst->type) {
        case GGML_TYPE_Q4_0: return quantize_row_q4_0_lsq_cpu;
        case GGML_TYPE_Q5_0: return quantize_row_q5_0_lsq_cpu;
        default:             return NULL;     // other types keep their own encoder (q53_64 always searches)
    }
}
