// Block floating point reference quantizers and dequantizers (ggml-base).
// The rule is written out in ggml-kvq.h and in pykvq/ref/bfp.py; the tests
// hold this file to the numpy reference bit for bit.
#include "ggml-kvq.h"

#include <math.h>
#include <string.h>

// Shared exponent (biased, E8M0) of a block with mantissas in [-M, M].
// bits = mantissa bits b; M = 2^(b-1) - 1. s stops at 129 - b, the largest s with
// M * 2^s finite: inf and |x| near FLT_MAX saturate instead of decoding to inf.
static uint8_t bfp_exponent(const float * x, int n, int bits) {
    float amax = 0.0f;
    for (int j = 0; j < n; ++j) {
        const float a = fabsf(x[j]);
        if (a > amax) {       // NaN compares false: counts as 0
            amax = a;
        }
    }
    if (amax == 0.0f) {
        return 0;
    }
    const int smax = 129 - bits;
    int s;
    if (isinf(amax)) {
        s = smax;
    } else {
        int E;
        const float f = frexpf(amax, &E);
        const float M = (float) ((1 << (bits - 1)) - 1);
        // smallest s with rint(amax / 2^s) <= M: amax / 2^s < M + 0.5
        s = E - (bits - 1) + (f >= (M + 0.5f) / (float) (1 << (bits - 1)));
    }
    s = s < -127 ? -127 : s > smax ? smax : s;
    return (uint8_t) (s + 127);
}

// 2^-s for the stored exponent; exact (s in [-127, 125]).
static inline float bfp_inv_scale(uint8_t e) {
    return ldexpf(1.0f, 127 - (int) e);
}

static inline int bfp_mantissa(float x, float inv, int M) {
    if (isnan(x)) {
        return 0;
    }
    const float v = nearbyintf(x * inv);  // default rounding mode: half to even
    return v > M ? M : v < -M ? -M : (int) v;
}

// One 4-bit block of qk values: the shared exponent, then nibbles m + 8
// (byte j: element j low, element j + qk/2 high). Both bfp4 sizes use it.
static void bfp4_quantize_block(const float * x, uint8_t * e, uint8_t * qs, int qk) {
    *e = bfp_exponent(x, qk, 4);
    const float inv = bfp_inv_scale(*e);
    for (int j = 0; j < qk/2; ++j) {
        const int lo = bfp_mantissa(x[j], inv, 7) + 8;
        const int hi = bfp_mantissa(x[j + qk/2], inv, 7) + 8;
        qs[j] = (uint8_t) (lo | (hi << 4));
    }
}

static void bfp4_dequantize_block(uint8_t e, const uint8_t * qs, float * y, int qk) {
    const float d = ggml_kvq_e8m0_to_fp32(e);
    for (int j = 0; j < qk/2; ++j) {
        y[j]        = d * (float) ((qs[j] & 0x0F) - 8);
        y[j + qk/2] = d * (float) ((qs[j] >> 4) - 8);
    }
}

void quantize_row_bfp4_32_ref(const float * GGML_RESTRICT x, block_bfp4_32 * GGML_RESTRICT y, int64_t k) {
    for (int64_t i = 0; i < k / QK_BFP32; ++i) {
        bfp4_quantize_block(x + i*QK_BFP32, &y[i].e, y[i].qs, QK_BFP32);
    }
}

void quantize_row_bfp4_64_ref(const float * GGML_RESTRICT x, block_bfp4_64 * GGML_RESTRICT y, int64_t k) {
    for (int64_t i = 0; i < k / QK_BFP64; ++i) {
        bfp4_quantize_block(x + i*QK_BFP64, &y[i].e, y[i].qs, QK_BFP64);
    }
}

void quantize_row_bfp8_32_ref(const float * GGML_RESTRICT x, block_bfp8_32 * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_BFP32;
    for (int64_t i = 0; i < nb; ++i, x += QK_BFP32) {
        const uint8_t e = bfp_exponent(x, QK_BFP32, 8);
        const float inv = bfp_inv_scale(e);
        y[i].e = e;
        for (int j = 0; j < QK_BFP32; ++j) {
            y[i].qs[j] = (int8_t) bfp_mantissa(x[j], inv, 127);
        }
    }
}

void dequantize_row_bfp4_32(const block_bfp4_32 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    for (int64_t i = 0; i < k / QK_BFP32; ++i) {
        bfp4_dequantize_block(x[i].e, x[i].qs, y + i*QK_BFP32, QK_BFP32);
    }
}

void dequantize_row_bfp4_64(const block_bfp4_64 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    for (int64_t i = 0; i < k / QK_BFP64; ++i) {
        bfp4_dequantize_block(x[i].e, x[i].qs, y + i*QK_BFP64, QK_BFP64);
    }
}

void dequantize_row_bfp8_32(const block_bfp8_32 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_BFP32;
    for (int64_t i = 0; i < nb; ++i, y += QK_BFP32) {
        const float d = ggml_kvq_e8m0_to_fp32(x[i].e);
        for (int j = 0; j < QK_BFP32; ++j) {
            y[j] = d * (float) x[i].qs[j];
        }
    }
}
