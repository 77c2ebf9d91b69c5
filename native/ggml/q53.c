// q53_64: 4.5 bits/value split unevenly inside a block of 64 (the first 32 values in 5 bits, the
// last 32 in 3 bits, each half with its own f16 scale): the reference quantizer and dequantizer
// (ggml-base). The rule is pykvq/ref/q53.py's; the tests hold this file to it bit for bit.
//
// A pre-RoPE key file laid out for it (convert/prerope.py: the important rotary pairs of every 64
// channels in the first half) spends 5 bits where the loss reads the keys and 3 where it hardly does.
// q42_64 is the same split one bit lower (4 and 2 bits, 3.5 bits/value), q32_64 one more (3 and 2 bits), below.
#include "ggml-kvq.h"

#include <float.h>
#include <math.h>
#include <string.h>

// each half: q*_0's rule with a least-squares scale (ggml_kvq_lsq_block, native/ggml/lsq.c), half = 2^(bits-1)
GGML_KVQ_STATIC_ASSERT(QK_Q53/2 == GGML_KVQ_LSQ_N, "a q53_64 half is one least-squares block");
GGML_KVQ_STATIC_ASSERT(QK_Q42/2 == GGML_KVQ_LSQ_N, "a q42_64 half is one least-squares block");
GGML_KVQ_STATIC_ASSERT(QK_Q32/2 == GGML_KVQ_LSQ_N, "a q32_64 half is one least-squares block");

// the halves' shared layouts: 32 values of 3 bits (q53_64 and q32_64: the low bits as nuq3's 2-bit fields, byte j
// bits 2k..2k+1 = value j + 8k; the high bit as bit i of a little-endian 32-bit word) or of 2 bits (q42_64 and
// q32_64: the same 2-bit fields)
static void q53_pack2(const uint8_t * q, uint8_t * qs) {
    memset(qs, 0, 8);
    for (int j = 0; j < 32; ++j) {
        qs[j % 8] |= (uint8_t) ((q[j] & 3) << (2*(j / 8)));
    }
}

static void q53_pack3(const uint8_t * q, uint8_t * qs, uint8_t * qh) {
    q53_pack2(q, qs);
    uint32_t h = 0;
    for (int j = 0; j < 32; ++j) {
        h |= (uint32_t) (q[j] >> 2) << j;
    }
    for (int j = 0; j < 4; ++j) {
        qh[j] = (uint8_t) (h >> (8*j));
    }
}

// the 4-bit half (q42_64, q4t2_64): q4_0's nibble order, byte j = q4(j) | q4(j + 16) << 4
static void q53_pack4(const uint8_t * q, uint8_t * qs) {
    for (int j = 0; j < 16; ++j) {
        qs[j] = (uint8_t) (q[j] | (q[j + 16] << 4));
    }
}

static inline int q53_get4(const uint8_t * qs, int j) {
    return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
}

static inline int q53_get2(const uint8_t * qs, int j) {
    return (qs[j % 8] >> (2*(j / 8))) & 3;
}

static inline int q53_get3(const uint8_t * qs, const uint8_t * qh, int j) {
    return q53_get2(qs, j) | (((qh[j / 8] >> (j % 8)) & 1) << 2);
}

void quantize_row_q53_64_ref(const float * x, block_q53_64 * y, int64_t k) {
    ggml_kvq_quantize_row_q53_64_with(x, y, k, ggml_kvq_lsq_block);
}

void ggml_kvq_quantize_row_q53_64_with(const float * x, block_q53_64 * y, int64_t k, ggml_kvq_lsq_block_t block) {
    const int64_t nb = k / QK_Q53;
    for (int64_t i = 0; i < nb; ++i) {
        const float * xb = x + i*QK_Q53;
        block_q53_64 * b = y + i;
        uint8_t q5[QK_Q53/2], q3[QK_Q53/2];
        block(xb, 16, b->d5, q5);
        block(xb + QK_Q53/2, 4, b->d3, q3);
        uint32_t qh5 = 0;
        for (int j = 0; j < 16; ++j) {
            b->qs5[j] = (uint8_t) ((q5[j] & 15) | ((q5[j + 16] & 15) << 4));
        }
        for (int j = 0; j < 32; ++j) {
            qh5 |= (uint32_t) (q5[j] >> 4) << j;
        }
        for (int j = 0; j < 4; ++j) {
            b->qh5[j] = (uint8_t) (qh5 >> (8*j));
        }
        q53_pack3(q3, b->qs3, b->qh3);
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
            o[j]      = (float) (q5 - 16)*d5;
            o[j + 32] = (float) (q53_get3(b->qs3, b->qh3, j) - 4)*d3;
        }
    }
}

bool ggml_kvq_validate_row_q53(enum ggml_type type, const void * data, size_t nbytes) {
    // every type of the family starts with two f16 scales, but q4t2_64 (one, then its trellis half's scale code) and
    // t32_64 (two codes); every code is a finite scale
    if (type == GGML_TYPE_T32_64) {
        return true;
    }
    const size_t size = type == GGML_TYPE_Q42_64  ? sizeof(block_q42_64)
                      : type == GGML_TYPE_Q4T2_64 ? sizeof(block_q4t2_64)
                      : type == GGML_TYPE_Q32_64  ? sizeof(block_q32_64) : sizeof(block_q53_64);
    return ggml_kvq_validate_f16_scales(data, nbytes, size, type == GGML_TYPE_Q4T2_64 ? 1 : 2);
}

// q42_64: the first half q4_0's rule (half = 8), the second the same rule with 4 levels (half = 2)
void quantize_row_q42_64_ref(const float * x, block_q42_64 * y, int64_t k) {
    ggml_kvq_quantize_row_q42_64_with(x, y, k, ggml_kvq_lsq_block);
}

void ggml_kvq_quantize_row_q42_64_with(const float * x, block_q42_64 * y, int64_t k, ggml_kvq_lsq_block_t block) {
    const int64_t nb = k / QK_Q42;
    for (int64_t i = 0; i < nb; ++i) {
        const float * xb = x + i*QK_Q42;
        block_q42_64 * b = y + i;
        uint8_t q4[QK_Q42/2], q2[QK_Q42/2];
        block(xb, 8, b->d4, q4);
        block(xb + QK_Q42/2, 2, b->d2, q2);
        q53_pack4(q4, b->qs4);
        q53_pack2(q2, b->qs2);
    }
}

void dequantize_row_q42_64(const block_q42_64 * x, float * y, int64_t k) {
    const int64_t nb = k / QK_Q42;
    for (int64_t i = 0; i < nb; ++i) {
        const block_q42_64 * b = x + i;
        const float d4 = ggml_kvq_f16_bytes(b->d4), d2 = ggml_kvq_f16_bytes(b->d2);
        float * o = y + i*QK_Q42;
        for (int j = 0; j < 32; ++j) {
            o[j]      = (float) (q53_get4(b->qs4, j) - 8)*d4;
            o[j + 32] = (float) (q53_get2(b->qs2, j) - 2)*d2;
        }
    }
}

// q32_64: the first half q53_64's 3-bit rule and layout (half = 4), the second q42_64's 2-bit one (half = 2)
void quantize_row_q32_64_ref(const float * x, block_q32_64 * y, int64_t k) {
    ggml_kvq_quantize_row_q32_64_with(x, y, k, ggml_kvq_lsq_block);
}

void ggml_kvq_quantize_row_q32_64_with(const float * x, block_q32_64 * y, int64_t k, ggml_kvq_lsq_block_t block) {
    const int64_t nb = k / QK_Q32;
    for (int64_t i = 0; i < nb; ++i) {
        const float * xb = x + i*QK_Q32;
        block_q32_64 * b = y + i;
        uint8_t q3[QK_Q32/2], q2[QK_Q32/2];
        block(xb, 4, b->d3, q3);
        block(xb + QK_Q32/2, 2, b->d2, q2);
        q53_pack3(q3, b->qs3, b->qh3);
        q53_pack2(q2, b->qs2);
    }
}

void dequantize_row_q32_64(const block_q32_64 * x, float * y, int64_t k) {
    const int64_t nb = k / QK_Q32;
    for (int64_t i = 0; i < nb; ++i) {
        const block_q32_64 * b = x + i;
        const float d3 = ggml_kvq_f16_bytes(b->d3), d2 = ggml_kvq_f16_bytes(b->d2);
        float * o = y + i*QK_Q32;
        for (int j = 0; j < 32; ++j) {
            o[j]      = (float) (q53_get3(b->qs3, b->qh3, j) - 4)*d3;
            o[j + 32] = (float) (q53_get2(b->qs2, j) - 2)*d2;
        }
    }
}

// q4t2_64: the first half q42_64's (half = 8), the second a tail-biting trellis block of 32 values (native/ggml/tcq.c)
void quantize_row_q4t2_64_ref(const float * x, block_q4t2_64 * y, int64_t k) {
    ggml_kvq_quantize_row_q4t2_64_with(x, y, k, ggml_kvq_lsq_block, NULL);
}

void ggml_kvq_quantize_row_q4t2_64_with(const float * x, block_q4t2_64 * y, int64_t k, ggml_kvq_lsq_block_t block,
                                        ggml_kvq_tcq_viterbi_t viterbi) {
    const int64_t nb = k / QK_Q4T2;
    for (int64_t i = 0; i < nb; ++i) {
        const float * xb = x + i*QK_Q4T2;
        block_q4t2_64 * b = y + i;
        uint8_t q4[QK_Q4T2/2];
        block(xb, 8, b->d4, q4);
        q53_pack4(q4, b->qs4);
        ggml_kvq_tcq_quantize_run(GGML_TYPE_TCQ2_64, xb + QK_Q4T2/2, QK_Q4T2/2, &b->d2, b->qs2, viterbi);
    }
}

void dequantize_row_q4t2_64(const block_q4t2_64 * x, float * y, int64_t k) {
    const int64_t nb = k / QK_Q4T2;
    for (int64_t i = 0; i < nb; ++i) {
        const block_q4t2_64 * b = x + i;
        const float d4 = ggml_kvq_f16_bytes(b->d4);
        float * o = y + i*QK_Q4T2;
        for (int j = 0; j < 32; ++j) {
            o[j] = (float) (q53_get4(b->qs4, j) - 8)*d4;
        }
        ggml_kvq_tcq_dequantize_run(GGML_TYPE_TCQ2_64, &b->d2, b->qs2, QK_Q4T2/2, o + 32);
    }
}

// t32_64: two tail-biting trellis blocks of 32 values, tcq3_64's rule and tables, then tcq2_64's
void quantize_row_t32_64_ref(const float * x, block_t32_64 * y, int64_t k) {
    ggml_kvq_quantize_row_t32_64_with(x, y, k, NULL);
}

void ggml_kvq_quantize_row_t32_64_with(const float * x, block_t32_64 * y, int64_t k, ggml_kvq_tcq_viterbi_t viterbi) {
    for (int64_t i = 0; i < k / QK_T32; ++i) {
        const float * xb = x + i*QK_T32;
        ggml_kvq_tcq_quantize_run(GGML_TYPE_TCQ3_64, xb, QK_T32/2, &y[i].d3, y[i].qs3, viterbi);
        ggml_kvq_tcq_quantize_run(GGML_TYPE_TCQ2_64, xb + QK_T32/2, QK_T32/2, &y[i].d2, y[i].qs2, viterbi);
    }
}

void dequantize_row_t32_64(const block_t32_64 * x, float * y, int64_t k) {
    for (int64_t i = 0; i < k / QK_T32; ++i) {
        ggml_kvq_tcq_dequantize_run(GGML_TYPE_TCQ3_64, &x[i].d3, x[i].qs3, QK_T32/2, y + i*QK_T32);
        ggml_kvq_tcq_dequantize_run(GGML_TYPE_TCQ2_64, &x[i].d2, x[i].qs2, QK_T32/2, y + i*QK_T32 + 32);
    }
}
