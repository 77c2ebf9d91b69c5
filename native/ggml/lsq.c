// Least-squares block scales for q*_0-style blocks: the encoder of q53_64's halves, and a second encoder of
// the stock q4_0 / q5_0 formats that a pykvq cache write may ask for (ggml_kvq_set_encoder). The rule is
// pykvq/ref/scale_search.py's; the tests hold this file to it bit for bit.
//
// Why: q*_0 maps a block's signed max to the extreme level. For near-Gaussian blocks (keys and values after
// the online Hadamard) that is not the scale whose levels land nearest: searching 26 multiples of it cuts the
// squared error by ~11-13%. Only the stored d changes, so every decoder (CPU, CUDA, RPC, old builds) reads
// the result unchanged.
#include "lsq-rule.h"     // first: no fused multiply-add in this file

#include <string.h>

void ggml_kvq_lsq_block(const float * x, int half, uint8_t d_out[2], uint8_t * q) {
    enum { N = GGML_KVQ_LSQ_N, NS = GGML_KVQ_LSQ_N_SCALES };
    float v[N];
    const float vmax = ggml_kvq_lsq_values(x, v);
    float id[NS], dq[NS];
    uint16_t h[NS];
    for (int k = 0; k < NS; ++k) {
        const float f = (float) (35 + k) / 50.0f;
        const float d = fmaxf(-65504.0f, fminf(65504.0f, (vmax / (float) -half) * f));
        id[k] = d != 0.0f ? 1.0f/d : 0.0f;
        h[k]  = ggml_kvq_fp32_to_fp16(d);
        dq[k] = ggml_kvq_fp16_to_fp32(h[k]);
    }
    // every candidate's error summed over j in order (as the reference sums), the candidates side by side:
    // independent sums, and the same bits as one candidate at a time
    double e[NS] = { 0.0 };
    for (int j = 0; j < N; ++j) {
        for (int k = 0; k < NS; ++k) {
            const double r = (double) ((float) (ggml_kvq_lsq_level(v[j], id[k], half) - half) * dq[k]) - (double) v[j];
            e[k] += r*r;
        }
    }
    ggml_kvq_lsq_store(e, v, id, h, half, d_out, q);
}

// q4_0: d[2] qs[16] (qs byte j: q(j) low nibble, q(j+16) high), as ggml-common.h's block_q4_0
void ggml_kvq_quantize_row_q4_0_with(const float * x, void * y, int64_t k, ggml_kvq_lsq_block_t block) {
    uint8_t * b = (uint8_t *) y;
    for (int64_t i = 0; i < k / GGML_KVQ_LSQ_N; ++i, b += 18) {
        uint8_t q[GGML_KVQ_LSQ_N];
        block(x + i*GGML_KVQ_LSQ_N, 8, b, q);
        for (int j = 0; j < 16; ++j) {
            b[2 + j] = (uint8_t) (q[j] | (q[j + 16] << 4));
        }
    }
}

// q5_0: d[2] qh[4] qs[16] (qh: bit j of the 32-bit word = q(j) >> 4), as block_q5_0
void ggml_kvq_quantize_row_q5_0_with(const float * x, void * y, int64_t k, ggml_kvq_lsq_block_t block) {
    uint8_t * b = (uint8_t *) y;
    for (int64_t i = 0; i < k / GGML_KVQ_LSQ_N; ++i, b += 22) {
        uint8_t q[GGML_KVQ_LSQ_N];
        block(x + i*GGML_KVQ_LSQ_N, 16, b, q);
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

void quantize_row_q4_0_lsq(const float * x, void * y, int64_t k) {
    ggml_kvq_quantize_row_q4_0_with(x, y, k, ggml_kvq_lsq_block);
}

void quantize_row_q5_0_lsq(const float * x, void * y, int64_t k) {
    ggml_kvq_quantize_row_q5_0_with(x, y, k, ggml_kvq_lsq_block);
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
