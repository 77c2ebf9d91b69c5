// q53_64: 4.5 bits/value split unevenly inside a block of 64 (the first 32 values in 5 bits, the
// last 32 in 3 bits, each half with its own f16 scale): the reference quantizer and dequantizer
// (ggml-base). The rule is pykvq/ref/q53.py's; the tests hold this file to it bit for bit.
//
// A pre-RoPE key file laid out for it (convert/prerope.py: the important rotary pairs of every 64
// channels in the first half) spends 5 bits where the loss reads the keys and 3 where it hardly does.
#include "ggml-kvq.h"

#include <float.h>
#include <math.h>
#include <string.h>

// one half of a block: q*_0's rule with `half` = 2^(bits-1), its scale d = vmax/-half times the factor f_k
// (k = 0 .. Q53_N_SCALES-1, f_k = (35 + k)/50: 0.70 .. 1.20, f_15 = 1 is q*_0's own) whose read-back values have
// the least squared error (double, summed in order; the first of equals). NaN is read as 0, +-inf as +-FLT_MAX,
// |d| saturates at 65504 (so no block decodes to inf or NaN: docs/FORMATS.md, Edge inputs).
// Why: for near-Gaussian blocks (keys after the online Hadamard) the signed max is not the best scale: the
// search cuts the squared error by ~11% (5 bits) and ~13% (3 bits); the format and its decoders are unchanged.
#define Q53_N_SCALES 26
static void q53_quantize_half(const float * x, int half, uint8_t d_out[2], uint8_t * q) {
    float v[QK_Q53/2];
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < QK_Q53/2; ++j) {
        v[j] = isnan(x[j]) ? 0.0f : fmaxf(-FLT_MAX, fminf(FLT_MAX, x[j]));
        if (amax < fabsf(v[j])) {
            amax = fabsf(v[j]);
            vmax = v[j];
        }
    }
    double best = INFINITY;
    for (int k = 0; k < Q53_N_SCALES; ++k) {
        const float f = (float) (35 + k) / 50.0f;
        float d = (vmax / (float) -half) * f;
        d = fmaxf(-65504.0f, fminf(65504.0f, d));
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        const uint16_t h = ggml_kvq_fp32_to_fp16(d);
        const float dq = ggml_kvq_fp16_to_fp32(h);
        uint8_t qk[QK_Q53/2];
        double e = 0.0;
        for (int j = 0; j < QK_Q53/2; ++j) {
            const float t = v[j]*id + ((float) half + 0.5f);
            const int   i = t < 1.0f ? 0 : (int) t;           // trunc, and nothing below 0
            qk[j] = (uint8_t) (i > 2*half - 1 ? 2*half - 1 : i);
            const double r = (double) ((float) (qk[j] - half) * dq) - (double) v[j];
            e += r*r;
        }
        if (e < best) {
            best = e;
            d_out[0] = (uint8_t) (h & 0xFF);
            d_out[1] = (uint8_t) (h >> 8);
            memcpy(q, qk, sizeof(qk));
        }
    }
}

void quantize_row_q53_64_ref(const float * x, block_q53_64 * y, int64_t k) {
    const int64_t nb = k / QK_Q53;
    for (int64_t i = 0; i < nb; ++i) {
        const float * xb = x + i*QK_Q53;
        block_q53_64 * b = y + i;
        uint8_t q5[QK_Q53/2], q3[QK_Q53/2];
        q53_quantize_half(xb, 16, b->d5, q5);
        q53_quantize_half(xb + QK_Q53/2, 4, b->d3, q3);
        uint32_t qh5 = 0, qh3 = 0;
        for (int j = 0; j < 16; ++j) {
            b->qs5[j] = (uint8_t) ((q5[j] & 15) | ((q5[j + 16] & 15) << 4));
        }
        memset(b->qs3, 0, sizeof(b->qs3));
        for (int j = 0; j < 32; ++j) {
            qh5 |= (uint32_t) (q5[j] >> 4) << j;
            qh3 |= (uint32_t) (q3[j] >> 2) << j;
            b->qs3[j % 8] |= (uint8_t) ((q3[j] & 3) << (2*(j / 8)));
        }
        for (int j = 0; j < 4; ++j) {
            b->qh5[j] = (uint8_t) (qh5 >> (8*j));
            b->qh3[j] = (uint8_t) (qh3 >> (8*j));
        }
    }
}

void dequantize_row_q53_64(const block_q53_64 * x, float * y, int64_t k) {
    const int64_t nb = k / QK_Q53;
    for (int64_t i = 0; i < nb; ++i) {
        const block_q53_64 * b = x + i;
        const float d5 = ggml_kvq_f16_bytes(b->d5), d3 = ggml_kvq_f16_bytes(b->d3);
        float * o = y + i*QK_Q53;
        for (int j = 0; j < 32; ++j) {
            const int lo = j < 16 ? b->qs5[j] & 15 : b->qs5[j - 16] >> 4;
            const int q5 = lo | (((b->qh5[j / 8] >> (j % 8)) & 1) << 4);
            const int q3 = ((b->qs3[j % 8] >> (2*(j / 8))) & 3) | (((b->qh3[j / 8] >> (j % 8)) & 1) << 2);
            o[j]      = (float) (q5 - 16)*d5;
            o[j + 32] = (float) (q3 - 4)*d3;
        }
    }
}

bool ggml_kvq_validate_row_q53(const void * data, size_t nbytes) {
    if (nbytes % sizeof(block_q53_64) != 0) {
        return false;
    }
    const block_q53_64 * b = (const block_q53_64 *) data;
    for (size_t i = 0; i < nbytes / sizeof(block_q53_64); ++i) {
        if (!isfinite(ggml_kvq_f16_bytes(b[i].d5)) || !isfinite(ggml_kvq_f16_bytes(b[i].d3))) {
            return false;
        }
    }
    return true;
}
