// Least-squares block scales for q*_0-style blocks: the encoder of q53_64's halves, and a second encoder of
// the stock q4_0 / q5_0 formats that a pykvq cache write may ask for (ggml_kvq_set_encoder). The rule is
// pykvq/ref/scale_search.py's; the tests hold this file to it bit for bit.
//
// Why: q*_0 maps a block's signed max to the extreme level. For near-Gaussian blocks (keys and values after
// the online Hadamard) that is not the scale whose levels land nearest: searching 26 multiples of it cuts the
// squared error by ~11-13%. Only the stored d changes, so every decoder (CPU, CUDA, RPC, old builds) reads
// the result unchanged.
#include "ggml-kvq.h"

#include <float.h>
#include <math.h>
#include <string.h>

void ggml_kvq_lsq_block(const float * x, int half, uint8_t d_out[2], uint8_t * q) {
    float v[GGML_KVQ_LSQ_N];
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
        v[j] = isnan(x[j]) ? 0.0f : fmaxf(-FLT_MAX, fminf(FLT_MAX, x[j]));
        if (amax < fabsf(v[j])) {
            amax = fabsf(v[j]);
            vmax = v[j];
        }
    }
    double best = INFINITY;
    for (int k = 0; k < GGML_KVQ_LSQ_N_SCALES; ++k) {
        const float f = (float) (35 + k) / 50.0f;
        float d = (vmax / (float) -half) * f;
        d = fmaxf(-65504.0f, fminf(65504.0f, d));
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        const uint16_t h = ggml_kvq_fp32_to_fp16(d);
        const float dq = ggml_kvq_fp16_to_fp32(h);
        uint8_t qk[GGML_KVQ_LSQ_N];
        double e = 0.0;
        for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
            const float t = v[j]*id + ((float) half + 0.5f);
            // trunc, clipped to [0, 2*half - 1] before the conversion (a value of the other sign than vmax can
            // overflow int when d saturates: +-inf in one block)
            qk[j] = (uint8_t) (t < 1.0f ? 0 : t >= (float) (2*half - 1) ? 2*half - 1 : (int) t);
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

// q4_0: d[2] qs[16] (qs byte j: q(j) low nibble, q(j+16) high), as ggml-common.h's block_q4_0
void quantize_row_q4_0_lsq(const float * x, void * y, int64_t k) {
    uint8_t * b = (uint8_t *) y;
    for (int64_t i = 0; i < k / GGML_KVQ_LSQ_N; ++i, b += 18) {
        uint8_t q[GGML_KVQ_LSQ_N];
        ggml_kvq_lsq_block(x + i*GGML_KVQ_LSQ_N, 8, b, q);
        for (int j = 0; j < 16; ++j) {
            b[2 + j] = (uint8_t) (q[j] | (q[j + 16] << 4));
        }
    }
}

// q5_0: d[2] qh[4] qs[16] (qh: bit j of the 32-bit word = q(j) >> 4), as block_q5_0
void quantize_row_q5_0_lsq(const float * x, void * y, int64_t k) {
    uint8_t * b = (uint8_t *) y;
    for (int64_t i = 0; i < k / GGML_KVQ_LSQ_N; ++i, b += 22) {
        uint8_t q[GGML_KVQ_LSQ_N];
        ggml_kvq_lsq_block(x + i*GGML_KVQ_LSQ_N, 16, b, q);
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            b[6 + j] = (uint8_t) ((q[j] & 15) | ((q[j + 16] & 15) << 4));
        }
        for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
            qh |= (uint32_t) (q[j] >> 4) << j;
        }
        for (int j = 0; j < 4; ++j) {
            b[2 + j] = (uint8_t) (qh >> (8*j));
        }
    }
}

//
// the cache write's tag (SET_ROWS into a cache tensor)
//

void ggml_kvq_set_encoder(struct ggml_tensor * node, int encoder) {
    GGML_ASSERT(node != NULL && node->op == GGML_OP_SET_ROWS);
    GGML_ASSERT(encoder == GGML_KVQ_ENCODER_STOCK || encoder == GGML_KVQ_ENCODER_LSQ);
    node->op_params[GGML_KVQ_ENC_TAG] = encoder == GGML_KVQ_ENCODER_LSQ ? (int32_t) GGML_KVQ_ENC_MAGIC : 0;
}

int ggml_kvq_get_encoder(const struct ggml_tensor * node) {
    return node->op == GGML_OP_SET_ROWS &&
           node->op_params[GGML_KVQ_ENC_TAG] == (int32_t) GGML_KVQ_ENC_MAGIC ? GGML_KVQ_ENCODER_LSQ : GGML_KVQ_ENCODER_STOCK;
}

ggml_from_float_t ggml_kvq_encoder_from_float(const struct ggml_tensor * dst) {
    if (ggml_kvq_get_encoder(dst) != GGML_KVQ_ENCODER_LSQ) {
        return NULL;
    }
    switch (dst->type) {
        case GGML_TYPE_Q4_0: return quantize_row_q4_0_lsq;
        case GGML_TYPE_Q5_0: return quantize_row_q5_0_lsq;
        default:             return NULL;     // other types keep their own encoder (q53_64 always searches)
    }
}
