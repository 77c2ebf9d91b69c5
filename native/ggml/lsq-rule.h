// pykvq: the scalar pieces of the least-squares block rule (native/ggml/lsq.c; pykvq/ref/scale_search.py), shared by the
// reference and the CPU's SIMD search. Include it first: it turns off fused multiply-add for the rest of the file
// (the intrinsics included), because the rule rounds every product before it is added, as numpy does (clang on ARM,
// and GCC on any target with FMA, would fuse).
#pragma once

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "ggml-kvq.h"

#include <float.h>
#include <math.h>
#include <stdint.h>

// v: x with NaN read as 0 and +-inf as +-FLT_MAX; returns the signed value of largest |v| (the first of equals)
static inline float ggml_kvq_lsq_values(const float * x, float * v) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
        v[j] = isnan(x[j]) ? 0.0f : fmaxf(-FLT_MAX, fminf(FLT_MAX, x[j]));
        if (amax < fabsf(v[j])) {
            amax = fabsf(v[j]);
            vmax = v[j];
        }
    }
    return vmax;
}

// the level of v at inverse scale id: trunc(v*id + half + 0.5) clipped to [0, 2*half - 1] before the conversion
// (a value of the other sign than vmax can overflow int when d saturates: +-inf in one block), NaN (0 times an
// inverse that overflows) as 0
static inline int ggml_kvq_lsq_level(float v, float id, int half) {
    const float t   = v*id + ((float) half + 0.5f);
    const float top = (float) (2*half - 1);
    return (int) (t >= 1.0f ? (t < top ? t : top) : 0.0f);
}

// the rule's choice among the candidates: the least error e[k] over k < GGML_KVQ_LSQ_N_SCALES (the first of equals);
// its f16 scale h[k] to d_out and the levels of v at its inverse scale id[k] to q
static inline void ggml_kvq_lsq_store(const double * e, const float * v, const float * id, const uint16_t * h, int half,
                                      uint8_t d_out[2], uint8_t * q) {
    int best = 0;
    for (int k = 1; k < GGML_KVQ_LSQ_N_SCALES; ++k) {
        if (e[k] < e[best]) {
            best = k;
        }
    }
    d_out[0] = (uint8_t) (h[best] & 0xFF);
    d_out[1] = (uint8_t) (h[best] >> 8);
    for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
        q[j] = (uint8_t) ggml_kvq_lsq_level(v[j], id[best], half);
    }
}
