// Non-uniform quantization (nuq*): reference quantizers and dequantizers, the
// codebook plumbing through op_params, and ggml-base's thread-local codebook
// slots (ggml-base). The rule is written out in ggml-kvq.h and in
// pykvq/ref/nuq.py; the tests hold this file to the numpy reference bit for bit.
#include "ggml-kvq.h"

#include <math.h>
#include <string.h>

static const int8_t nuq_fallback4[16] = GGML_KVQ_NUQ_FALLBACK_4;
static const int8_t nuq_fallback3[8]  = GGML_KVQ_NUQ_FALLBACK_3;
static const int8_t nuq_fallback2[4]  = GGML_KVQ_NUQ_FALLBACK_2;

bool ggml_kvq_is_nuq(enum ggml_type type) {
    return ggml_kvq_type_is_nuq(type);
}

int ggml_kvq_nuq_n_codes(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_NUQ4:  return 16;
        case GGML_TYPE_NUQ3:
        case GGML_TYPE_NUQ3O:
        case GGML_TYPE_NUQ3_64: return 8;
        case GGML_TYPE_NUQ2:
        case GGML_TYPE_NUQ2O:
        case GGML_TYPE_NUQ2_64: return 4;
        default:              return 0;
    }
}

int ggml_kvq_nuq_block(enum ggml_type type) {
    return ggml_kvq_type_is_nuq(type) ? ggml_kvq_type_qk(type) : 0;
}

size_t ggml_kvq_nuq_type_size(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_NUQ4:  return sizeof(block_nuq4);
        case GGML_TYPE_NUQ3:  return sizeof(block_nuq3);
        case GGML_TYPE_NUQ2:  return sizeof(block_nuq2);
        case GGML_TYPE_NUQ3O: return sizeof(block_nuq3o);
        case GGML_TYPE_NUQ2O: return sizeof(block_nuq2o);
        case GGML_TYPE_NUQ3_64: return sizeof(block_nuq3_64);
        case GGML_TYPE_NUQ2_64: return sizeof(block_nuq2_64);
        default:              return 0;
    }
}

const int8_t * ggml_kvq_nuq_fallback(enum ggml_type type) {
    switch (ggml_kvq_nuq_n_codes(type)) {
        case 16: return nuq_fallback4;
        case 8:  return nuq_fallback3;
        case 4:  return nuq_fallback2;
        default: return NULL;
    }
}

bool ggml_kvq_nuq_codebook_ok(const int8_t * cb, int n) {
    if (cb == NULL || n < 2 || n > GGML_KVQ_NUQ_MAX_CODES) {
        return false;
    }
    for (int j = 0; j < n; ++j) {
        if (cb[j] < -127 || (j > 0 && cb[j] <= cb[j - 1])) {
            return false;
        }
    }
    return true;
}

//
// op_params
//

static void nuq_write_slot(struct ggml_tensor * node, int offs, const int8_t * cb, int n) {
    int8_t slot[GGML_KVQ_NUQ_MAX_CODES] = {0};
    memcpy(slot, cb, (size_t) n);
    memcpy((char *) node->op_params + offs, slot, sizeof(slot));
}

static void nuq_set_slots(struct ggml_tensor * node, const int8_t * cb_a, int n_a, const int8_t * cb_b, int n_b) {
    int32_t head[5];
    memcpy(head, node->op_params, sizeof(head));

    unsigned bits = 0;   // setting replaces both slots
    if (cb_a) {
        GGML_ASSERT(ggml_kvq_nuq_codebook_ok(cb_a, n_a) && "nuq codebook: need n_codes strictly ascending entries in [-127, 127]");
        nuq_write_slot(node, GGML_KVQ_CB_OFFS_A, cb_a, n_a);
        bits |= 1u;
    } else {
        memset((char *) node->op_params + GGML_KVQ_CB_OFFS_A, 0, GGML_KVQ_NUQ_MAX_CODES);
    }
    if (cb_b) {
        GGML_ASSERT(ggml_kvq_nuq_codebook_ok(cb_b, n_b) && "nuq codebook: need n_codes strictly ascending entries in [-127, 127]");
        nuq_write_slot(node, GGML_KVQ_CB_OFFS_B, cb_b, n_b);
        bits |= 2u;
    } else {
        memset((char *) node->op_params + GGML_KVQ_CB_OFFS_B, 0, GGML_KVQ_NUQ_MAX_CODES);
    }
    node->op_params[GGML_KVQ_CB_TAG] = (int32_t) (GGML_KVQ_CB_MAGIC | bits);

    GGML_ASSERT(memcmp(head, node->op_params, sizeof(head)) == 0);  // ggml's own op_params untouched
}

void ggml_kvq_set_codebook(struct ggml_tensor * node, const int8_t * cb) {
    GGML_ASSERT(node != NULL && node->op != GGML_OP_FLASH_ATTN_EXT && "use ggml_kvq_set_codebooks_fa for flash attention");
    // the one nuq type among the node and its sources
    const struct ggml_tensor * ts[4] = { node, node->src[0], node->src[1], node->src[2] };
    int n = 0;
    for (int i = 0; i < 4; ++i) {
        if (ts[i] && ggml_kvq_type_is_nuq(ts[i]->type)) {
            const int ni = ggml_kvq_nuq_n_codes(ts[i]->type);
            GGML_ASSERT((n == 0 || n == ni) && "ggml_kvq_set_codebook: nuq tensors with different codebook sizes");
            n = ni;
        }
    }
    GGML_ASSERT(n > 0 && "ggml_kvq_set_codebook: the node neither reads nor writes a nuq tensor");
    nuq_set_slots(node, cb, n, cb, n);
}

void ggml_kvq_set_codebooks_fa(struct ggml_tensor * fa, const int8_t * cb_k, const int8_t * cb_v) {
    GGML_ASSERT(fa != NULL && fa->op == GGML_OP_FLASH_ATTN_EXT);
    const struct ggml_tensor * k = fa->src[1];
    const struct ggml_tensor * v = fa->src[2];
    // a codebook for a K or V that is not a nuq type (say f16 K, nuq V) is dropped
    if (!ggml_kvq_type_is_nuq(k->type)) { cb_k = NULL; }
    if (!ggml_kvq_type_is_nuq(v->type)) { cb_v = NULL; }
    nuq_set_slots(fa, cb_k, ggml_kvq_nuq_n_codes(k->type), cb_v, ggml_kvq_nuq_n_codes(v->type));
}

unsigned ggml_kvq_get_codebooks(const struct ggml_tensor * node, int8_t * cb_a, int8_t * cb_b) {
    const int32_t tag = node->op_params[GGML_KVQ_CB_TAG];
    if ((tag & (int32_t) GGML_KVQ_CB_MASK) != (int32_t) GGML_KVQ_CB_MAGIC) {
        memset(cb_a, 0, GGML_KVQ_NUQ_MAX_CODES);
        memset(cb_b, 0, GGML_KVQ_NUQ_MAX_CODES);
        return 0;
    }
    const unsigned bits = (unsigned) tag & 3u;
    if (bits & 1u) {
        memcpy(cb_a, (const char *) node->op_params + GGML_KVQ_CB_OFFS_A, GGML_KVQ_NUQ_MAX_CODES);
    } else {
        memset(cb_a, 0, GGML_KVQ_NUQ_MAX_CODES);
    }
    if (bits & 2u) {
        memcpy(cb_b, (const char *) node->op_params + GGML_KVQ_CB_OFFS_B, GGML_KVQ_NUQ_MAX_CODES);
    } else {
        memset(cb_b, 0, GGML_KVQ_NUQ_MAX_CODES);
    }
    return bits;
}

//
// ggml-base's thread-local slots (read by the trait functions)
//

static _Thread_local struct {
    int8_t   a[GGML_KVQ_NUQ_MAX_CODES];
    int8_t   b[GGML_KVQ_NUQ_MAX_CODES];
    unsigned bits;
} nuq_tl;

void ggml_kvq_bind_codebooks(const int8_t * cb_a, const int8_t * cb_b) {
    unsigned bits = 0;
    if (cb_a) { memcpy(nuq_tl.a, cb_a, GGML_KVQ_NUQ_MAX_CODES); bits |= 1u; }
    if (cb_b) { memcpy(nuq_tl.b, cb_b, GGML_KVQ_NUQ_MAX_CODES); bits |= 2u; }
    nuq_tl.bits = bits;
}

static inline const int8_t * nuq_cb_or_fallback(const int8_t * cb, enum ggml_type type) {
    return cb ? cb : ggml_kvq_nuq_fallback(type);
}

static inline const int8_t * nuq_tl_a(enum ggml_type type) {
    return (nuq_tl.bits & 1u) ? nuq_tl.a : ggml_kvq_nuq_fallback(type);
}

static inline const int8_t * nuq_tl_b(enum ggml_type type) {
    return (nuq_tl.bits & 2u) ? nuq_tl.b : ggml_kvq_nuq_fallback(type);
}

//
// the rule
//

// idx of every value of one dense block of n (x[skip] counts as 0 when skip >= 0);
// returns d in float32.
static float nuq_index_block(const float * x, int n, int skip, const int8_t * cb, int n_codes, uint8_t * idx) {
    float mid[GGML_KVQ_NUQ_MAX_CODES - 1];
    for (int j = 0; j + 1 < n_codes; ++j) {
        mid[j] = ((float) cb[j] + (float) cb[j + 1]) * 0.5f;
    }
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float a = i == skip ? 0.0f : fabsf(x[i]);
        if (a > amax) {        // NaN compares false: counts as 0
            amax = a;
        }
    }
    const float d  = ggml_kvq_nuq_clamp_d(amax / 127.0f);   // never inf as f16
    const float id = ggml_kvq_nuq_use_id(d) ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; ++i) {
        const float v = (i == skip || isnan(x[i]) ? 0.0f : x[i]) * id;   // NaN is read as 0
        int k = 0;
        for (int j = 0; j + 1 < n_codes; ++j) {
            k += v > mid[j];
        }
        idx[i] = (uint8_t) k;
    }
    return d;
}


static inline void nuq_put_f16(uint8_t * p, float f) {
    const uint16_t h = ggml_kvq_fp32_to_fp16(f);
    p[0] = (uint8_t) (h & 0xFF);
    p[1] = (uint8_t) (h >> 8);
}

// 2-bit fields of a block of n: byte j holds idx(j + k*n/4) & 3 at bits 2k
static void nuq_pack_low2(const uint8_t * idx, int n, uint8_t * qs) {
    const int q = n / 4;
    for (int j = 0; j < q; ++j) {
        qs[j] = (uint8_t) ((idx[j] & 3) | ((idx[j + q] & 3) << 2) | ((idx[j + 2*q] & 3) << 4) | ((idx[j + 3*q] & 3) << 6));
    }
}

static void nuq_pack_high(const uint8_t * idx, int n, uint8_t * qh) {
    memset(qh, 0, (size_t) n / 8);
    for (int i = 0; i < n; ++i) {
        qh[i / 8] |= (uint8_t) (((idx[i] >> 2) & 1) << (i % 8));
    }
}

static inline void nuq_unpack_low2(const uint8_t * qs, int n, uint8_t * idx) {
    const int q = n / 4;
    for (int j = 0; j < q; ++j) {
        for (int k = 0; k < 4; ++k) {
            idx[j + k*q] = (qs[j] >> (2*k)) & 3;
        }
    }
}

// the third bit of each index: bit i of qh (nuq_pack_high's layout)
static inline void nuq_unpack_high(const uint8_t * qh, int n, uint8_t * idx) {
    for (int j = 0; j < n; ++j) {
        idx[j] |= ((qh[j / 8] >> (j % 8)) & 1) << 2;
    }
}

void ggml_kvq_nuq_pack(enum ggml_type type, const uint8_t * idx, float d, float ov, int oi, void * blk) {
    uint8_t * b = (uint8_t *) blk;
    nuq_put_f16(b, d);
    switch (type) {
        case GGML_TYPE_NUQ4: {
            block_nuq4 * y = blk;
            for (int j = 0; j < QK_NUQ/2; ++j) {
                y->qs[j] = (uint8_t) (idx[j] | (idx[j + QK_NUQ/2] << 4));
            }
        } break;
        case GGML_TYPE_NUQ3: {
            block_nuq3 * y = blk;
            nuq_pack_low2(idx, QK_NUQ, y->qs);
            nuq_pack_high(idx, QK_NUQ, y->qh);
        } break;
        case GGML_TYPE_NUQ2: {
            block_nuq2 * y = blk;
            nuq_pack_low2(idx, QK_NUQ, y->qs);
        } break;
        case GGML_TYPE_NUQ3O: {
            block_nuq3o * y = blk;
            nuq_put_f16(y->ov, ggml_kvq_nuq_ov(ov));
            y->oi = (uint8_t) oi;
            nuq_pack_low2(idx, QK_NUQO, y->qs);
            nuq_pack_high(idx, QK_NUQO, y->qh);
        } break;
        case GGML_TYPE_NUQ2O: {
            block_nuq2o * y = blk;
            nuq_put_f16(y->ov, ggml_kvq_nuq_ov(ov));
            y->oi = (uint8_t) oi;
            nuq_pack_low2(idx, QK_NUQO, y->qs);
        } break;
        case GGML_TYPE_NUQ3_64: {
            block_nuq3_64 * y = blk;
            nuq_pack_low2(idx, QK_NUQO, y->qs);
            nuq_pack_high(idx, QK_NUQO, y->qh);
        } break;
        case GGML_TYPE_NUQ2_64: {
            block_nuq2_64 * y = blk;
            nuq_pack_low2(idx, QK_NUQO, y->qs);
        } break;
        default:
            GGML_ABORT("not a nuq type");
    }
}

static void nuq_quantize_row(enum ggml_type type, const float * x, void * vy, int64_t k, const int8_t * cb) {
    const int     n_codes = ggml_kvq_nuq_n_codes(type);
    const int     qk      = ggml_kvq_nuq_block(type);
    const size_t  bs      = ggml_kvq_nuq_type_size(type);
    const bool    outl    = ggml_kvq_type_outl(type);
    uint8_t       idx[QK_NUQO];
    for (int64_t i = 0; i < k / qk; ++i, x += qk) {
        const int   oi = outl ? ggml_kvq_nuq_outlier(x, qk) : -1;
        const float d  = nuq_index_block(x, qk, oi, cb, n_codes, idx);
        ggml_kvq_nuq_pack(type, idx, d, outl ? x[oi] : 0.0f, outl ? oi : 0, (char *) vy + i*bs);
    }
}

static void nuq_dequantize_row(enum ggml_type type, const void * vx, float * y, int64_t k, const int8_t * cb) {
    const int    qk = ggml_kvq_nuq_block(type);
    const size_t bs = ggml_kvq_nuq_type_size(type);
    float c[GGML_KVQ_NUQ_MAX_CODES];
    for (int j = 0; j < ggml_kvq_nuq_n_codes(type); ++j) {
        c[j] = (float) cb[j];
    }
    uint8_t idx[QK_NUQO] = {0};   // (qk comes from the table: gcc cannot see every index is written)
    for (int64_t i = 0; i < k / qk; ++i, y += qk) {
        const uint8_t * b = (const uint8_t *) vx + i*bs;
        const float     d = ggml_kvq_f16_bytes(b);
        int oi = -1;
        float ov = 0.0f;
        switch (type) {
            case GGML_TYPE_NUQ4: {
                const block_nuq4 * x = (const block_nuq4 *) b;
                for (int j = 0; j < QK_NUQ/2; ++j) {
                    idx[j] = x->qs[j] & 0x0F;
                    idx[j + QK_NUQ/2] = x->qs[j] >> 4;
                }
            } break;
            case GGML_TYPE_NUQ3: {
                const block_nuq3 * x = (const block_nuq3 *) b;
                nuq_unpack_low2(x->qs, QK_NUQ, idx);
                nuq_unpack_high(x->qh, QK_NUQ, idx);
            } break;
            case GGML_TYPE_NUQ2: {
                nuq_unpack_low2(((const block_nuq2 *) b)->qs, QK_NUQ, idx);
            } break;
            case GGML_TYPE_NUQ3O: {
                const block_nuq3o * x = (const block_nuq3o *) b;
                nuq_unpack_low2(x->qs, QK_NUQO, idx);
                nuq_unpack_high(x->qh, QK_NUQO, idx);
                oi = x->oi;
                ov = ggml_kvq_f16_bytes(x->ov);
            } break;
            case GGML_TYPE_NUQ2O: {
                const block_nuq2o * x = (const block_nuq2o *) b;
                nuq_unpack_low2(x->qs, QK_NUQO, idx);
                oi = x->oi;
                ov = ggml_kvq_f16_bytes(x->ov);
            } break;
            case GGML_TYPE_NUQ3_64: {
                const block_nuq3_64 * x = (const block_nuq3_64 *) b;
                nuq_unpack_low2(x->qs, QK_NUQO, idx);
                nuq_unpack_high(x->qh, QK_NUQO, idx);
            } break;
            case GGML_TYPE_NUQ2_64: {
                nuq_unpack_low2(((const block_nuq2_64 *) b)->qs, QK_NUQO, idx);
            } break;
            default:
                GGML_ABORT("not a nuq type");
        }
        for (int j = 0; j < qk; ++j) {
            y[j] = d * c[idx[j]];
        }
        if (oi >= 0 && oi < qk) {
            y[oi] = ov;
        }
    }
}

#define NUQ_CODECS(name, TYPE, block_t)                                                                  \
    void quantize_row_##name##_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb) {        \
        nuq_quantize_row(TYPE, x, y, k, nuq_cb_or_fallback(cb, TYPE));                                   \
    }                                                                                                    \
    void dequantize_row_##name##_cb(const void * x, float * y, int64_t k, const int8_t * cb) {          \
        nuq_dequantize_row(TYPE, x, y, k, nuq_cb_or_fallback(cb, TYPE));                                 \
    }                                                                                                    \
    void quantize_row_##name##_ref(const float * GGML_RESTRICT x, block_t * GGML_RESTRICT y, int64_t k) { \
        nuq_quantize_row(TYPE, x, y, k, nuq_tl_a(TYPE));                                                 \
    }                                                                                                    \
    void dequantize_row_##name(const block_t * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {    \
        nuq_dequantize_row(TYPE, x, y, k, nuq_tl_b(TYPE));                                               \
    }

NUQ_CODECS(nuq4,  GGML_TYPE_NUQ4,  block_nuq4)
NUQ_CODECS(nuq3,  GGML_TYPE_NUQ3,  block_nuq3)
NUQ_CODECS(nuq2,  GGML_TYPE_NUQ2,  block_nuq2)
NUQ_CODECS(nuq3o, GGML_TYPE_NUQ3O, block_nuq3o)
NUQ_CODECS(nuq2o, GGML_TYPE_NUQ2O, block_nuq2o)
NUQ_CODECS(nuq3_64, GGML_TYPE_NUQ3_64, block_nuq3_64)
NUQ_CODECS(nuq2_64, GGML_TYPE_NUQ2_64, block_nuq2_64)

bool ggml_kvq_validate_row_nuq(enum ggml_type type, const void * data, size_t nbytes) {
    const size_t bs = ggml_kvq_nuq_type_size(type);
    if (bs == 0 || nbytes % bs != 0) {
        return false;
    }
    const bool outl = ggml_kvq_type_outl(type);
    for (size_t i = 0; i < nbytes / bs; ++i) {
        const uint8_t * b = (const uint8_t *) data + i*bs;
        if (!isfinite(ggml_kvq_f16_bytes(b))) {
            return false;
        }
        // ov at bytes 2-3 and oi at byte 4 in both outlier layouts
        if (outl && (!isfinite(ggml_kvq_f16_bytes(b + 2)) || b[4] >= QK_NUQO)) {
            return false;
        }
    }
    return true;
}
